"""Chat with a GGUF model: `python local_chat.py [--gguf_path MODEL.gguf] [--prompt_file doc.txt]`.

Flags follow KTransformers' local_chat; every option of configs/default.yaml can also be set
with --set key=value. Piped standard input is read as one message per line.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from ktlong.session.startup import add_config_flags

    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="local_chat.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Chat with a long-context GGUF model on one GPU plus host memory, or on the CPU.",
        epilog="Options not listed here: --set KEY=VALUE with any key of configs/default.yaml; "
               "`python -m ktlong.config show` prints them all with their values. "
               "`python -m ktlong.server` serves the same model over an OpenAI-compatible API.")
    add_config_flags(p)
    chat = p.add_argument_group("chat")
    chat.add_argument("--prompt_file", help="text file sent as the first message; an empty line resends it")
    chat.add_argument("--save_kv", metavar="PATH", help="long-context mode: after each answer, save the KV cache "
                      "and the conversation to PATH (also /save PATH in the chat; under torchrun each rank its part, "
                      "PATH.rank0-of-2 and so on)")
    chat.add_argument("--load_kv", metavar="PATH", help="long-context mode: start from a cache saved with "
                      "--save_kv, with its conversation (also /load PATH)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ktlong.cli import interrupted, print_error
    from ktlong.errors import KtlongError
    from ktlong.parallel.launch import quiet_unless_main

    quiet_unless_main()
    try:
        return run(args)
    except KtlongError as e:
        print_error(e)
        return 2
    except KeyboardInterrupt:  # before the chat (loading, say): in the chat Ctrl-C stops an answer
        return interrupted()


def run(args) -> int:
    from ktlong.chat.loop import ChatLoop
    from ktlong.chat.text_file import max_text_bytes, read_text_file
    from ktlong.cli import print_error
    from ktlong.config import load_config
    from ktlong.errors import ConfigError, KtlongError
    from ktlong.session.startup import overrides_from, start

    config = load_config(args.config, overrides_from(args))
    if args.prompt_file:  # refused before the model loads, not after
        read_text_file(args.prompt_file, "--prompt_file", max_text_bytes(config.max_seq_len))
    if args.save_kv:  # before a prefill that may take minutes
        from ktlong.session.saved_cache import check_save_path

        check_save_path(args.save_kv)
    if args.load_kv:  # a path no file system takes, before the model loads
        from ktlong.regular_file import user_path

        user_path(args.load_kv)
    if (args.save_kv or args.load_kv) and config.mode != "long_context":
        raise ConfigError("--save_kv and --load_kv keep the long-context KV cache; add --mode long_context.")
    started = start(config)
    tp = started.tp  # under tensor parallelism every rank chats; rank 0 reads the input for all
    failed = ChatLoop(started.lm, config, started.max_seq_len, args.prompt_file, session=started.session,
                      save_kv=args.save_kv, load_kv=args.load_kv, tp=tp).run(
        interactive=sys.stdin.isatty(), wrap_reader=tp.lines_from_main if tp is not None else None)
    if failed:
        print_error(KtlongError(f"{' and '.join(failed)} could not be done (the notices above say why)."))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
