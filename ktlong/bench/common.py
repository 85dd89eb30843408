"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import statistics

from ktlong.errors import KtlongError


def require_cuda(what: str):
    import torch

    if not torch.cuda.is_available():
        raise KtlongError(f"{what} needs a CUDA GPU and this machine has none; run it on a GPU machine.")


RUNS = 100  # the most runs a bench repeats an arm for its median: it has settled long before


def median(values) -> float:
    return statistics.median(values)


def time_cuda(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, measured with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def long_context_config(args, reads: frozenset[str], command: str, why: str):
    """The config of a bench that runs a packaged or GGUF model in long-context mode: its --set
    options, each one it reads (refused otherwise, in one sentence that says `why`), with its
    --model and --device."""
    from ktlong.config import load_config, parse_set, refuse_unread

    overrides = parse_set(args.set)
    refuse_unread(overrides, reads, f"python -m ktlong.bench {command}", why)
    overrides["mode"] = ("long_context", command)
    overrides["model"] = (args.model, "--model")
    if args.device:
        overrides["device"] = (args.device, "--device")
    return load_config(overrides=overrides, write_user_file=False)
