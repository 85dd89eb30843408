"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import statistics


def parse_lengths(text: str) -> list[int]:
    """'32k,128k,1m' -> [32768, 131072, 1048576]."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = {"k": 1 << 10, "m": 1 << 20}.get(item[-1], 1)
        out.append(int(float(item.rstrip("km")) * scale))
    return out


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
