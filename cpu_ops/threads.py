"""How many Numba threads the decode operators use."""

from __future__ import annotations

import os

import numba


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def decode_threads(requested: int = 0, spare_core: bool = True) -> int:
    """`requested`, or every core but one where a Python thread drives a GPU meanwhile
    (spare_core): a parallel region whose worker shares that thread's core waits a scheduler
    timeslice (measured: block scoring at 128K took 0.36 ms with 8 of 16 threads, 4-6 ms with all
    16). On the CPU alone the calling thread is one of the region's workers: every core."""
    cores = usable_cores()
    return max(1, min(requested or cores - (1 if spare_core else 0), numba.config.NUMBA_NUM_THREADS))


def set_decode_threads(requested: int = 0) -> int:
    threads = decode_threads(requested)
    numba.set_num_threads(threads)
    return threads
