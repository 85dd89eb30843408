"""Chat with a GGUF model: `python local_chat.py [--gguf_path MODEL.gguf] [--prompt_file doc.txt]`.

Flags follow KTransformers' local_chat; every option of configs/default.yaml can also be set
with --set key=value. Piped standard input is read as one message per line.
"""

from __future__ import annotations

import argparse
import sys

import yaml


def default_values() -> dict:
    from ktlong.config import DEFAULT_FILE

    return yaml.safe_load(DEFAULT_FILE.read_text())


def build_parser() -> argparse.ArgumentParser:
    d = default_values()
    p = argparse.ArgumentParser(
        prog="local_chat.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Chat with a long-context GGUF model on one GPU plus host memory, or on the CPU.",
        epilog="Options not listed here: --set KEY=VALUE with any key of configs/default.yaml; "
               "`python -m ktlong.config show` prints them all with their values.")
    model = p.add_argument_group("model")
    model.add_argument("--gguf_path", help="GGUF file, or a folder holding one")
    model.add_argument("--model", help=f"packaged model name or GGUF path (default: {d['model']})")
    model.add_argument("--model_path", help="folder with the model's files; its .gguf is used when "
                       "--gguf_path is not given (tokenizer and config are read from the GGUF)")
    model.add_argument("--device", help=f"auto, cpu, cuda or cuda:N (default: {d['device']})")
    model.add_argument("--rope_scaling", choices=["auto", "none", "linear", "yarn"],
                       help="RoPE context extension, as llama.cpp's --rope-scaling (default: auto, the GGUF's)")
    model.add_argument("--rope_scale", type=float, help="its factor, as --rope-scale (default: the GGUF's)")
    model.add_argument("--yarn_orig_ctx", type=int, help="YaRN's original context, as --yarn-orig-ctx "
                       "(default: the GGUF's)")
    run = p.add_argument_group("long context")
    run.add_argument("--mode", choices=["normal", "long_context"], help=f"default: {d['mode']}")
    run.add_argument("--max_seq_len", type=int, help="longest prompt plus answer in tokens "
                     "(default: the model's context length)")
    run.add_argument("--cpu_infer", type=int, help=f"CPU threads (default: {d['threads_num']} = every core but one)")
    run.add_argument("--use_cuda_graph", action=argparse.BooleanOptionalAction, default=None,
                     help="long-context decode on a GPU: replay its device part from CUDA graphs "
                          f"(default: {d['use_cuda_graph']}, on with CUDA)")
    gen = p.add_argument_group("generation")
    gen.add_argument("--prompt_file", help="text file sent as the first message; an empty line resends it")
    gen.add_argument("--max_new_tokens", type=int, help=f"default: {d['max_new_tokens']}")
    gen.add_argument("--temperature", type=float, help=f"0 = greedy (default: {d['temperature']})")
    gen.add_argument("--save_kv", metavar="PATH", help="long-context mode: after each answer, save the KV cache "
                     "and the conversation to PATH (also /save PATH in the chat)")
    gen.add_argument("--load_kv", metavar="PATH", help="long-context mode: start from a cache saved with "
                     "--save_kv, with its conversation (also /load PATH)")
    cfg = p.add_argument_group("configuration")
    cfg.add_argument("--config", help="YAML file merged over ~/.config/ktlong/config.yaml")
    cfg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="set any option, e.g. --set block_size=64 (repeatable)")
    return p


FLAG_TO_OPTION = {"model": "model", "gguf_path": "model", "mode": "mode", "device": "device",
                  "max_seq_len": "max_seq_len", "cpu_infer": "threads_num",
                  "use_cuda_graph": "use_cuda_graph", "max_new_tokens": "max_new_tokens",
                  "temperature": "temperature", "rope_scaling": "rope_scaling", "rope_scale": "rope_scale",
                  "yarn_orig_ctx": "yarn_orig_ctx"}


def overrides_from(args) -> dict:
    from pathlib import Path

    from ktlong.config import parse_set

    out = parse_set(args.set)
    if args.model_path and not args.gguf_path and not args.model:
        ggufs = sorted(Path(args.model_path).expanduser().glob("*.gguf"))
        if ggufs:
            out["model"] = (str(ggufs[0]), "--model_path")
    for flag, option in FLAG_TO_OPTION.items():
        value = getattr(args, flag)
        if value is not None:
            out[option] = (value, f"--{flag}")
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ktlong.errors import KtlongError

    try:
        return run(args)
    except KtlongError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from ktlong.chat.loop import ChatLoop
    from ktlong.config import load_config
    from ktlong.device import resolve_device, resolve_dtype
    from ktlong.gguf.loader import load_model, open_model
    from ktlong.errors import ConfigError
    from ktlong.gguf.model_config import RopeOptions
    from ktlong.session.plan import apply_threads, plan_session

    config = load_config(args.config, overrides_from(args))
    if (args.save_kv or args.load_kv) and config.mode != "long_context":
        raise ConfigError("--save_kv and --load_kv keep the long-context KV cache; add --mode long_context.")
    gf, model_config = open_model(config.model, RopeOptions.of(config))  # checks the file, reads no weight
    max_seq_len = config.check_against_model(model_config.num_layers, model_config.context_length)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.use_cuda_graph is True and (device.type != "cuda" or config.mode != "long_context"):
        print("[use_cuda_graph: graphs replay the long-context decode step on a GPU; ignored here]",
              file=sys.stderr)
    plan = None
    if config.mode == "long_context":
        plan = plan_session(config, model_config, gf.num_weight_elements, max_seq_len, device, dtype)
        print(plan.describe(), file=sys.stderr)
        plan.check()
    else:
        apply_threads(config.threads_num)
    lm = load_model(config.model, device, dtype, RopeOptions.of(config))
    c = lm.config
    print(f"[loaded {lm.path.name}: {c.arch}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} "
          f"heads, context {c.context_length}, on {device} in {lm.load_seconds:.1f}s; "
          f"max_seq_len {max_seq_len}]", file=sys.stderr)
    session = None
    if plan is not None:
        from ktlong.session.long_context import LongContextSession

        session = LongContextSession.from_config(lm.model, config, plan)
    ChatLoop(lm, config, max_seq_len, args.prompt_file, session=session, save_kv=args.save_kv,
             load_kv=args.load_kv).run(interactive=sys.stdin.isatty())
    return 0


if __name__ == "__main__":
    sys.exit(main())
