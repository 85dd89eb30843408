"""Host memory the GPU copies to and from: page-locked in place, on 2 MiB pages."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
from typing import Callable

import numpy as np
import torch

from ktlong.errors import KtlongError
from ktlong.kv.copy_2d import copy_rows_2d, registered_runs


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor):
    """Ask Linux for 2 MiB pages under a large, untouched tensor (THP in "madvise" mode). Decode
    reads a few 32-64 KiB blocks scattered over GiBs per head and layer; with 4 KiB pages nearly
    every block starts with TLB misses. Best effort: nothing happens where it is not supported."""
    nbytes = t.numel() * t.element_size()
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(MADV_HUGEPAGE))


def copy_heads(dst: torch.Tensor, src: torch.Tensor):
    """Copy [heads, ...] views between host and device, each head a contiguous range of a
    head-major table, asynchronously. One torch copy of the whole view would not be: torch goes
    through a contiguous pageable host tensor, and a copy to or from pageable memory holds the
    host until the stream reaches it (behind everything queued before it). So the heads cross as
    the rows of one 2-D copy on the current stream (ktlong/kv/copy_2d.py), or one copy each
    where that does not apply (a view whose heads are not contiguous ranges); on the CPU, one copy."""
    if src.numel() == 0 or copy_rows_2d(dst, src):  # empty: a resident layer's rows, usually
        return
    if not (src.is_cuda or dst.is_cuda):  # within DRAM: one copy, nothing to hold up
        dst.copy_(src)
        return
    for h in range(src.shape[0]):  # a head's rows may lie in several page-locked pieces: a copy each
        for a, b in registered_runs(src[h] if dst.is_cuda else dst[h]):
            dst[h][a:b].copy_(src[h][a:b], non_blocking=True)


# CUDA's codes: part of a range is page-locked already (cudaErrorHostMemoryAlreadyRegistered), a
# range is not page-locked (cudaErrorHostMemoryNotRegistered)
_ALREADY_LOCKED, _NOT_LOCKED = 712, 713
# tensors whose unlock failed: held here, so that their memory is not given back (and its addresses
# handed to a new mapping) while CUDA still counts it page-locked; unlocked again before each lock
_STILL_LOCKED: list[torch.Tensor] = []


def pin_in_place(t: torch.Tensor):
    """Page-lock a tensor's own memory for asynchronous copies. torch's pinned allocator rounds
    every allocation up to a power of two, so a layer of 1 GiB + one block would take 2 GiB;
    registering the exact allocation costs exactly its size."""
    retry_unlocks()
    nbytes = t.numel() * t.element_size()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err == _ALREADY_LOCKED:
        raise KtlongError(f"could not page-lock {nbytes / 2**20:.1f} MiB of DRAM at {t.data_ptr():#x}: CUDA holds "
                          "part of it page-locked already (error 712), which is a defect of ktlong; please report it.")
    if err:
        raise KtlongError(f"could not page-lock {nbytes / 2**30:.1f} GiB of DRAM for the KV cache (CUDA error "
                          f"{err}); lower max_seq_len.")


def unpin(t: torch.Tensor):
    """Unlock what pin_in_place locked. Where CUDA refuses now, t is kept (its memory stays mapped
    under the lock) and unlocked again before the next lock."""
    if int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) not in (0, _NOT_LOCKED):
        _STILL_LOCKED.append(t)


def retry_unlocks():
    """Unlock again what unpin could not; what CUDA still refuses stays held."""
    if _STILL_LOCKED:
        failed = list(_STILL_LOCKED)
        _STILL_LOCKED.clear()
        for t in failed:
            unpin(t)


@contextlib.contextmanager
def collection_paused():
    """No garbage collection while the block runs: for a CUDA graph capture on this thread, where a
    collection could free a dropped cache and unlock its DRAM, a call CUDA refuses during a
    capture (the unlock fails and the capture is lost)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class PinnedTensors:
    """Tensors page-locked in place (pin_in_place), unlocked when this object goes: the owner
    of host buffers that the GPU copies to and from keeps one. enabled False (no GPU): `pin`
    hands tensors back as they are."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._tensors: list[torch.Tensor] = []

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled and t.numel():
            pin_in_place(t)
            self._tensors.append(t)
        return t

    @contextlib.contextmanager
    def released(self):
        """Unlocked while the block runs, locked again after it: pages mapped anew under a
        tensor (ktlong/kv/shared_prefix.py) are not the ones the GPU's mapping locked. No device
        work may read them meanwhile."""
        if self._tensors:
            torch.cuda.synchronize()
        self._unlock()
        try:
            yield
        finally:
            for t in self._tensors:
                pin_in_place(t)

    def close(self, between: Callable[[], None] | None = None):
        """Unlock every tensor and let them go (their memory too, if nothing else holds them),
        between() after each: a prefill's 8 GiB of hidden states (1M tokens at 8B shapes) took
        1.1 s to unlock at once on the H200, a step as long for the streams decoding beside it."""
        while self._tensors:
            unpin(self._tensors.pop())
            if between is not None:
                between()

    def _unlock(self):
        for t in self._tensors:
            unpin(t)

    def __del__(self):
        self._unlock()


def host_words(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor, 16-bit values as uint16 words (as stored_view gives DRAM)."""
    sixteen = t.dtype in (torch.bfloat16, torch.float16, torch.int16)
    return t.view(torch.int16).numpy().view(np.uint16) if sixteen else t.numpy()
