"""`python -m ktlong.server [--host 127.0.0.1] [--port 8000] [local_chat.py's model flags]`."""

from __future__ import annotations

import argparse
import os
import sys

API_KEY_VARIABLE = "KTLONG_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    from ktlong.session.startup import add_config_flags

    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m ktlong.server",
        description="Serve a long-context GGUF model over the OpenAI API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, /health).",
        epilog="A request that extends the previous conversation reuses its KV cache. Under torchrun "
               "(--tensor_parallel N) rank 0 serves and every rank runs each prefill and step, one "
               "conversation at a time. Options not listed here: --set KEY=VALUE with any key of "
               "configs/default.yaml.")
    add_config_flags(p, server=True)
    return p


def model_id(config_model: str, path) -> str:
    """The name clients send as 'model': the packaged name, or the GGUF file's stem."""
    if config_model and not config_model.endswith(".gguf") and os.sep not in config_model and "/" not in config_model:
        return config_model
    return path.stem


def serving_session(started):
    """The session the server runs: the long-context one, or a dense one (both warmed up)."""
    from ktlong.session.chunked import dense_session

    return started.session or dense_session(started.lm.model, started.config, started.max_seq_len)


def make_app(started, log=None, session=None):
    """The app for a loaded model and its session (tests build one in-process from this).
    session: serving_session's, or what wraps it (under torchrun, ktlong/parallel/mirrored_session.py)."""
    from ktlong.server.app import build_app
    from ktlong.server.protocol import Defaults, Prompting
    from ktlong.server.worker import Worker
    from ktlong.gguf.chat_template import ChatTemplate

    config, lm = started.config, started.lm
    session = session or serving_session(started)
    # without the model's template, messages are sent as plain "role: text" lines
    template = lm.chat_template if config.use_chat_template else ChatTemplate(None)
    prompting = Prompting(lm.tokenizer, template, config.system_prompt, started.max_seq_len,
                          Defaults(config.max_new_tokens, config.temperature, config.top_p, config.top_k, config.seed,
                                   config.presence_penalty, config.frequency_penalty))
    api_key = config.api_key or os.environ.get(API_KEY_VARIABLE, "")
    worker = Worker(session, lm.tokenizer, config.queue_size, log, config.finish_prefill_on_disconnect,
                    cache_store(config, started, session, log), config.max_num_seqs,
                    config.prefill_slice_ms / 1000)
    return build_app(worker, prompting, model_id(config.model, lm.path), api_key, config.keepalive_seconds,
                     config.body_timeout_seconds), api_key


def cache_store(config, started, session, log=None):
    """The conversations kept besides the session's (ktlong/server/cache_store.py): long-context
    sessions that save their cache, on models without sliding-window layers (whose DRAM keeps
    only a tail, which no later request can reuse), in one process (the ranks under torchrun
    mirror one conversation); None otherwise."""
    from ktlong.errors import ConfigError
    from ktlong.kv.memory_plan import GIB, dram_limit
    from ktlong.server.cache_store import CacheStore
    from ktlong.session.saved_cache import fingerprint

    check_cache_dir(config)
    if started.tp is not None:
        return None
    if started.session is None or not session.saves_cache or session.layout.sliding:
        if config.cache_dir:
            raise ConfigError("cache_dir cannot keep this model's caches: its sliding-window layers keep only "
                              "a tail in DRAM; drop --cache_dir.")
        return None
    write = (lambda line: print(line, file=log or sys.stderr, flush=True))
    return CacheStore(session, fingerprint(started.lm.path, session, config), int(config.cache_dram_gb * GIB),
                      config.cache_dir, int(config.cache_disk_gb * GIB), config.cache_min_tokens, write,
                      dram_limit(session.model.device.type == "cuda"))


def check_cache_dir(config):
    """What cache_dir asks of the config, refused before the model loads: long-context mode, in
    one process (the ranks under torchrun mirror one conversation), a folder it can write in."""
    from ktlong.errors import ConfigError
    from ktlong.regular_file import user_path
    from ktlong.server.cache_store import ready_folder

    if config.cache_dir and config.tensor_parallel > 1:
        raise ConfigError("Under torchrun the server keeps no cache of conversations on disk; drop --cache_dir, "
                          "or serve in one process.")
    if config.cache_dir and config.mode != "long_context":
        raise ConfigError("cache_dir keeps long-context caches: add --mode long_context, or drop --cache_dir "
                          "(a model with sliding-window layers cannot reuse them).")
    if config.cache_dir:
        ready_folder(user_path(config.cache_dir))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ktlong.cli import interrupted, print_error
    from ktlong.config import load_config
    from ktlong.errors import KtlongError
    from ktlong.parallel.launch import launched_rank
    from ktlong.session.startup import FLAG_TO_OPTION, overrides_from, start

    mirrored = None  # under torchrun, rank 0's session, which tells the other ranks what to run
    listener = None
    try:
        config = load_config(args.config, overrides_from(args, FLAG_TO_OPTION))
        check_cache_dir(config)
        if launched_rank() == 0:  # before minutes of loading, and held through them
            listener = reserve_port(config.host, config.port)
        started = start(config, cpu_engine=False)  # its grammars and logprobs are torch operations
        session = serving_session(started)
        if started.tp is not None:
            from ktlong.parallel.mirrored_session import MirroredSession, follow

            if not started.tp.is_main:  # the other ranks run what rank 0 runs, until it closes
                return follow(session, started.tp)
            session = mirrored = MirroredSession(session, started.tp)
        app, api_key = make_app(started, session=session)
        return serve(config, started, app, api_key, listener)
    except KtlongError as e:
        print_error(e)
        return 2
    except KeyboardInterrupt:  # while it loads: serving, Ctrl-C stops the server (serve)
        return interrupted()
    finally:
        if mirrored is not None:
            mirrored.close()
        if listener is not None:
            listener.close()


def serve(config, started, app, api_key, listener) -> int:
    """Listen until stopped (Ctrl-C, SIGTERM); the running answers end first."""
    import uvicorn

    from ktlong.server.gc_passes import freeze_startup
    from ktlong.server.stopping import StoppingServer

    if config.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"[warning: listening on {config.host} without an API key; anyone who reaches this port can "
              f"use the model (set --api_key or ${API_KEY_VARIABLE})]", file=sys.stderr)
    port = listener.getsockname()[1]  # the one taken, where --port 0 asked for any
    print(f"[serving {model_id(config.model, started.lm.path)} at http://{config.host}:{port}/v1 "
          f"({config.mode} mode, max_seq_len {started.max_seq_len:,}, {app.state.worker.max_rows} at once, "
          f"queue {config.queue_size})]",
          file=sys.stderr, flush=True)
    freeze_startup()  # the model, the session and the app: never walked by the garbage collector again
    server = StoppingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                           timeout_graceful_shutdown=5), app.state.worker.shutdown)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn raises the signal again once it has shut down
        pass
    return 0


def reserve_port(host: str, port: int):
    """The address bound (not yet listening: a client is refused until uvicorn listens), so no
    other process takes the port while the model loads; an address this machine cannot listen on
    (a port in use, say) is refused in one sentence."""
    import socket

    from ktlong.errors import ConfigError

    sock = None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind((host, port))
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ConfigError(f"Cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host, "
                          "or stop what uses it.") from None


if __name__ == "__main__":
    code = main()
    # Everything that holds state is written once main returns (the streams ended, the caches on disk).
    # Skip the interpreter's teardown: freeing the JIT-compiled kernels and the weights takes
    # seconds on a small machine, and a supervisor restarting the server waits for the exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
