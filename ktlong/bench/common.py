"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import statistics

from ktlong.errors import KtlongError


def parse_lengths(text: str) -> list[int]:
    """'32k,128k,1m' -> [32768, 131072, 1048576]."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            scale = {"k": 1 << 10, "m": 1 << 20}.get(item[-1:], 1)
            value = int(float(item.rstrip("km")) * scale)
        except ValueError:
            value = 0
        if value <= 0:
            raise KtlongError(f"length {item!r} in {text!r} is not a token count; write lengths like 4096,32k,1m.")
        out.append(value)
    return out


def require_cuda(what: str):
    import torch

    if not torch.cuda.is_available():
        raise KtlongError(f"{what} needs a CUDA GPU and this machine has none; run it on a GPU machine.")


def median(values) -> float:
    return statistics.median(values)


def print_table(headers: list[str], rows: list[list]):
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


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
