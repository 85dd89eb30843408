"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import statistics

from ktlong.errors import KtlongError


def require_cuda(what: str):
    import torch

    if not torch.cuda.is_available():
        raise KtlongError(f"{what} needs a CUDA GPU and this machine has none; run it on a GPU machine.")


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
