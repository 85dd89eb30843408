"""From command-line flags to a loaded model and its session: the part local_chat.py and the
server share (their flags for the model, the long-context options and the config files, and
the order: config, model check, memory plan, weights, session)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ktlong.config import SECRETS, Config, parse_set
from ktlong.errors import ConfigError
from ktlong.options import OPTIONS, SECTIONS
from ktlong.regular_file import user_path

if TYPE_CHECKING:
    from ktlong.models.loader import LoadedModel

# flag -> option: every option declared with a flag (ktlong/options.py), and --gguf_path for the model
FLAG_TO_OPTION = {o.flag: name for name, o in OPTIONS.items() if o.flag} | {"gguf_path": "model"}
FLAG_TYPES = {"int": int, "float": float, "str": str}


def add_option_flag(p, o, *aliases: str):
    """--FLAG for option o (its declaration's flag, type, choices and comment), unset (None) when
    not given, so the configuration's layers below it show through."""
    shown = "(hidden)" if o.name in SECRETS else o.default if o.default != "" else "none"
    extra = {"choices": o.choices} if o.choices else {}
    if o.type in ("bool", "auto_bool"):
        extra = {"action": argparse.BooleanOptionalAction, "default": None}
    else:
        extra["type"] = FLAG_TYPES[o.type]
    flag_help = f"{o.comment()} (default: {shown})".replace("%", "%%")
    p.add_argument(f"--{o.flag}", *aliases, help=flag_help, **extra)


def add_config_flags(p: argparse.ArgumentParser, server: bool = False):
    """The flags of the options declared with one (ktlong/options.py), grouped by section (the
    server's section only with server), with --gguf_path, --model_path and the configuration's
    --config and --set."""
    for title, options in SECTIONS:
        flagged = [o for o in options if o.flag]
        if not flagged or (title.startswith("server") and not server):
            continue
        group = p.add_argument_group(title.split(" (")[0])
        if title.startswith("model"):
            group.add_argument("--gguf_path", help="GGUF file, or a folder holding one (as --model)")
            group.add_argument("--model_path", help="folder with the model's files; its .gguf is used when "
                               "--gguf_path is not given (tokenizer and config are read from the GGUF)")
        for o in flagged:
            add_option_flag(group, o)
    cfg = p.add_argument_group("configuration")
    cfg.add_argument("--config", help="YAML file merged over ~/.config/ktlong/config.yaml")
    cfg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="set any option, e.g. --set block_size=64 (repeatable)")


def overrides_from(args, flag_to_option: dict[str, str] = FLAG_TO_OPTION) -> dict:
    """Options the command line sets: --set pairs, then the named flags (which win)."""
    out = parse_set(args.set)
    named = [f"--{flag}" for flag in ("gguf_path", "model", "model_path") if getattr(args, flag, None)]
    if len(named) > 1:
        raise ConfigError(f"{' and '.join(named)} each name the model; give one of them.")
    if args.model_path:
        folder = user_path(args.model_path)
        ggufs = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
        if not ggufs:
            raise ConfigError(f"--model_path {args.model_path} is not a folder holding a .gguf file; give "
                              "such a folder, or the file itself with --gguf_path.")
        out["model"] = (str(ggufs[0]), "--model_path")
    for flag, option in flag_to_option.items():
        value = getattr(args, flag, None)
        if value is not None:
            out[option] = (value, f"--{flag}")
    return out


@dataclass
class Started:
    lm: "LoadedModel"
    config: Config
    max_seq_len: int
    session: object  # LongContextSession, or None for the dense session the caller makes
    tp: object = None  # TensorParallel when tensor_parallel > 1


def cpu_engine_refusal(config: Config, gf, model_config) -> str | None:
    """Why normal mode does not run on the torch-free CPU engine (ktlong/models/cpu_llama.py);
    None: it does. The cpu_engine option's auto, resolved here."""
    from ktlong.device import device_type
    from ktlong.models.cpu_llama import unsupported
    from ktlong.parallel.launch import launched_world

    if config.cpu_engine != "auto":
        return f"cpu_engine is {config.cpu_engine}"
    if (config.mode != "normal" or config.tensor_parallel > 1 or launched_world() > 1
            or device_type(config.device) != "cpu"):
        return "it runs normal mode on one CPU process"
    if not config.cpu_stored_weights or config.kv_type not in ("auto", "bf16") or config.dtype not in ("auto", "float32"):
        return "it keeps the weights as stored, a bf16 cache and float32 compute"
    return unsupported(gf, model_config)


def start(config: Config, log=None, cpu_engine: bool = True) -> Started:
    """Check the model file, plan (and refuse what does not fit) before any weight is read, load
    the weights, and build the long-context session when the mode asks for one. Normal mode on
    a CPU runs the torch-free engine where cpu_engine_refusal allows, and never imports torch;
    cpu_engine False: torch's model always (the server's grammars and logprobs are torch's)."""
    from ktlong.gguf.chat_template import configured_template
    from ktlong.models.loader import load_cpu_model, open_model
    from ktlong.gguf.model_config import RopeOptions
    from cpu_ops.threads import decode_threads

    log = log or sys.stderr
    gf, model_config = open_model(config.model, RopeOptions.of(config))  # checks the file, reads no weight
    template = configured_template(config.chat_template_file)
    max_seq_len = config.check_against_model(model_config.num_layers, model_config.context_length)
    refusal = cpu_engine_refusal(config, gf, model_config) if cpu_engine else ""
    if refusal is None:
        import numba

        from ktlong.kv.free_memory import available_dram_bytes, check_dense_cache

        check_dense_cache(model_config, max_seq_len, 2, available_dram_bytes(), "DRAM")  # bfloat16 words
        numba.set_num_threads(decode_threads(config.threads_num, spare_core=False))
        with _loading(gf.path, model_config, "cpu (numpy and Numba)", max_seq_len, log):
            lm = load_cpu_model(gf, model_config, template)
        return Started(lm, config, max_seq_len, None)
    return _start_torch(config, gf, model_config, template, max_seq_len, refusal, log)


@contextmanager
def _loading(path, c, where: str, max_seq_len: int, log):
    """The model's line: its head flushed before the weights are read (a fresh install's wait
    for the CPU kernels of their types falls there too), the time at its end; a failure ends the
    line first, so that its own message starts a line. Ranks under torchrun share a terminal:
    each prints its line whole, at the end."""
    from ktlong.parallel.launch import launched_world

    head = (f"[loading {path.name}: {c.arch}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} heads, "
            f"context {c.context_length}, on {where}")
    alone = launched_world() <= 1
    if max_seq_len > c.context_length:  # a run that was refused before this point never says it
        print(f"[max_seq_len {max_seq_len:,} is past the model's context of {c.context_length:,} tokens: what lies "
              "past them it reads poorly; rope_scaling and rope_scale extend its context]", file=log, flush=True)
    if alone:
        print(head, end="", file=log, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        if alone:
            print(file=log, flush=True)
        raise
    print(f"{'' if alone else head} in {time.perf_counter() - start:.1f}s; max_seq_len {max_seq_len}]", file=log,
          flush=True)


def _start_torch(config: Config, gf, model_config, template, max_seq_len: int, refusal: str, log) -> Started:
    """refusal: why the CPU engine does not run this (empty: it was not asked to)."""
    import torch

    from ktlong.device import resolve_device, resolve_dtype
    from ktlong.models.loader import load_model
    from ktlong.gguf.model_config import RopeOptions
    from ktlong.gguf.weights import CpuWeights
    from ktlong.parallel.group import join_ranks
    from ktlong.parallel.shard import shard_config
    from cpu_ops.threads import decode_threads
    from ktlong.session.plan import apply_threads, plan_for_file, resolve_dense_kv_dtype

    device = resolve_device(config.device)
    if refusal and config.mode == "normal" and config.cpu_engine == "auto" and device.type == "cpu" and config.tensor_parallel <= 1:
        print(f"[torch's engine: the CPU engine does not run this, as {refusal}]", file=log)
    tp, device = join_ranks(config.tensor_parallel, model_config, device)
    dtype, world = resolve_dtype(config.dtype, device), tp.world if tp is not None else 1
    plan = plan_for_file(config, gf, model_config, max_seq_len, device, dtype, world) \
        if config.mode == "long_context" else None
    if tp is not None:
        model_config = shard_config(model_config, tp.world)
        print(f"[rank {tp.rank} of {tp.world}: {model_config.num_heads} heads, {model_config.num_kv_heads} kv "
              f"heads, {len(os.sched_getaffinity(0))} cores]", file=log)
    if config.use_cuda_graph is True and (device.type != "cuda" or config.mode != "long_context"):
        print("[use_cuda_graph: graphs replay the long-context decode step on a GPU; ignored here]", file=log)
    if plan is not None:
        print(plan.describe(), file=log)
        plan.check()
        apply_threads(plan.threads, plan.torch_threads)
    else:  # refused here, before any weight is read
        from ktlong.kv.free_memory import available_dram_bytes, check_dense_cache

        kv_dtype = resolve_dense_kv_dtype(config.kv_type, device, dtype)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_dram_bytes()
        check_dense_cache(model_config, max_seq_len, kv_dtype.itemsize, free,
                          "GPU memory" if device.type == "cuda" else "DRAM")
        apply_threads(decode_threads(config.threads_num, spare_core=device.type != "cpu"), config.threads_num)
    with _loading(gf.path, model_config, str(device), max_seq_len, log):
        lm = load_model(config.model, device, dtype, RopeOptions.of(config), tp, template, CpuWeights.of(config))
    session = None
    if plan is not None:
        from ktlong.session.long_context import LongContextSession

        session = LongContextSession.from_plan(lm.model, plan)
    return Started(lm, config, max_seq_len, session, tp)
