"""How many Numba threads the decode operators use."""

from __future__ import annotations

import os

import numba


def decode_threads(requested: int = 0) -> int:
    """`requested`, or every core but one: the Python thread that drives the GPU needs a core,
    and a parallel region whose worker shares it waits a scheduler timeslice (measured: block
    scoring at 128K took 0.36 ms with 8 of 16 threads, 4-6 ms with all 16)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(requested or cores - 1, numba.config.NUMBA_NUM_THREADS))


def set_decode_threads(requested: int = 0) -> int:
    threads = decode_threads(requested)
    numba.set_num_threads(threads)
    return threads
