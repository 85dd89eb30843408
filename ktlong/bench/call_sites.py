"""Where a piece of code spends its torch calls: every call into torch counted by the line of
project code that made it. On a GPU, a call is roughly a kernel launch or a copy, so this says
which lines a host-bound step (a follow-up's prefill) pays for, where the profiler's operator
table only says which operators."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from torch.overrides import TorchFunctionMode

PROJECT = str(Path(__file__).resolve().parents[2])
# reads of a tensor's metadata, which launch nothing and dispatch nothing
METADATA = {"__get__", "dim", "size", "stride", "numel", "element_size", "data_ptr", "storage_offset",
            "is_contiguous", "is_pinned", "__len__"}


class CallSites(TorchFunctionMode):
    """Counts torch calls (not metadata reads) by their nearest caller inside the project (file:line)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in METADATA:
            return func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(PROJECT):
            frame = frame.f_back
        where = "elsewhere" if frame is None else \
            f"{frame.f_code.co_filename[len(PROJECT) + 1:]}:{frame.f_lineno}"
        self.counts[where] += 1
        return func(*args, **(kwargs or {}))


def print_call_sites(counts: collections.Counter, per: int = 1, name: str = "run", top: int = 20):
    """The most frequent call sites, as calls per `name` (per: how many there were)."""
    print(f"torch calls: {sum(counts.values()) / per:.0f} per {name}; the busiest lines:")
    for where, n in counts.most_common(top):
        print(f"  {n / per:8.1f}  {where}")
