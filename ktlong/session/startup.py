"""From command-line flags to a loaded model and its session: the part local_chat.py and the
server share (their flags for the model, the long-context options and the config files, and
the order: config, model check, memory plan, weights, session)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ktlong.config import DEFAULT_FILE, Config, parse_set
from ktlong.errors import ConfigError

if TYPE_CHECKING:
    from ktlong.models.loader import LoadedModel

# flag -> option of configs/default.yaml
FLAG_TO_OPTION = {"model": "model", "gguf_path": "model", "mode": "mode", "device": "device",
                  "max_seq_len": "max_seq_len", "cpu_infer": "threads_num",
                  "use_cuda_graph": "use_cuda_graph", "max_new_tokens": "max_new_tokens",
                  "temperature": "temperature", "rope_scaling": "rope_scaling", "rope_scale": "rope_scale",
                  "yarn_orig_ctx": "yarn_orig_ctx", "tensor_parallel": "tensor_parallel"}


def default_values() -> dict:
    return yaml.safe_load(DEFAULT_FILE.read_text())


def add_config_flags(p: argparse.ArgumentParser) -> dict:
    """The model, long-context, generation and configuration flags; returns the defaults shown."""
    d = default_values()
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
    run.add_argument("--tensor_parallel", type=int, metavar="N", help="split heads and MLP columns over N "
                     "ranks (GPUs, or CPU processes); start with torchrun --nproc_per_node N "
                     f"(default: {d['tensor_parallel']})")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max_new_tokens", type=int, help=f"default: {d['max_new_tokens']}")
    gen.add_argument("--temperature", type=float, help=f"0 = greedy (default: {d['temperature']})")
    cfg = p.add_argument_group("configuration")
    cfg.add_argument("--config", help="YAML file merged over ~/.config/ktlong/config.yaml")
    cfg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="set any option, e.g. --set block_size=64 (repeatable)")
    return d


def overrides_from(args, flag_to_option: dict[str, str] = FLAG_TO_OPTION) -> dict:
    """Options the command line sets: --set pairs, then the named flags (which win)."""
    out = parse_set(args.set)
    named = [f"--{flag}" for flag in ("gguf_path", "model", "model_path") if getattr(args, flag, None)]
    if len(named) > 1:
        raise ConfigError(f"{' and '.join(named)} each name the model; give one of them.")
    if args.model_path:
        folder = Path(args.model_path).expanduser()
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


def start(config: Config, log=None) -> Started:
    """Check the model file, plan (and refuse what does not fit) before any weight is read, load
    the weights, and build the long-context session when the mode asks for one."""
    from ktlong.device import resolve_device, resolve_dtype
    from ktlong.models.loader import load_model, open_model
    from ktlong.gguf.model_config import RopeOptions
    from ktlong.parallel.group import join_ranks
    from ktlong.parallel.shard import rank_share
    from ktlong.session.plan import apply_threads, plan_session

    log = log or sys.stderr
    gf, model_config = open_model(config.model, RopeOptions.of(config))  # checks the file, reads no weight
    max_seq_len = config.check_against_model(model_config.num_layers, model_config.context_length)
    device = resolve_device(config.device)
    tp, device = join_ranks(config.tensor_parallel, model_config, device)
    num_weight_elements = gf.num_weight_elements
    if tp is not None:
        model_config, num_weight_elements = rank_share(model_config, num_weight_elements, tp.world)
        print(f"[rank {tp.rank} of {tp.world}: {model_config.num_heads} heads, {model_config.num_kv_heads} kv "
              f"heads, {len(os.sched_getaffinity(0))} cores]", file=log)
    dtype = resolve_dtype(config.dtype, device)
    if config.use_cuda_graph is True and (device.type != "cuda" or config.mode != "long_context"):
        print("[use_cuda_graph: graphs replay the long-context decode step on a GPU; ignored here]", file=log)
    plan = None
    if config.mode == "long_context":
        plan = plan_session(config, model_config, num_weight_elements, max_seq_len, device, dtype)
        print(plan.describe(), file=log)
        plan.check()
    else:
        apply_threads(config.threads_num)
    lm = load_model(config.model, device, dtype, RopeOptions.of(config), tp)
    c = lm.config
    print(f"[loaded {lm.path.name}: {c.arch}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} "
          f"heads, context {c.context_length}, on {device} in {lm.load_seconds:.1f}s; "
          f"max_seq_len {max_seq_len}]", file=log)
    session = None
    if plan is not None:
        from ktlong.session.long_context import LongContextSession

        session = LongContextSession.from_config(lm.model, config, plan)
    return Started(lm, config, max_seq_len, session, tp)
