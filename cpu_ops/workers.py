"""Threads that share out a prefill chunk's work on the CPU engine (ktlong/models/cpu_llama.py).

Each piece of work is a BLAS product on one thread or a Numba kernel on one thread (a worker's
Numba threads are set to 1), both of which release the GIL, so the pieces run in parallel. This beats letting numpy's BLAS and
Numba's OpenMP each start their own threads: those spin a while after their work, on the cores
the other needs next (4K on 2 cores: 88 prompt tokens/s with both thread pools).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import numba


class Workers:
    def __init__(self, count: int):
        self.count = max(1, count)
        self.pool = ThreadPoolExecutor(self.count, thread_name_prefix="ktlong-prefill", initializer=numba.set_num_threads,
                                       initargs=(1,)) if self.count > 1 else None

    def map(self, fn: Callable, items: Iterable) -> list:
        """fn over items, the results in order (on this thread alone with one worker)."""
        return list(self.pool.map(fn, items)) if self.pool is not None else [fn(item) for item in items]

    def close(self) -> None:
        """Let the threads end (they are idle between chunks)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def spans(self, length: int) -> list[tuple[int, int]]:
        """0..length cut into one near-equal span a worker."""
        cuts = [length * i // self.count for i in range(self.count + 1)]
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
