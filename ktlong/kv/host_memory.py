"""Host tensors that own their memory mapping, so that pages of a file can later be mapped over
them in place.

A saved KV cache is read back into a cache that must keep growing (the conversation goes on)
and keeps its head-major layout, so the file cannot simply become the cache. Instead each host
table lives on its own anonymous mapping, aligned to 2 MiB, and loading replaces the pages that
hold saved blocks by private (copy-on-write) mappings of the file: no copy, the values are read
from disk as the mapping is made and shared with the page cache, and a write (a new token in a
partly filled block) copies only its page. Pinned (page-locked) tables are not mapped over:
page-locking a private file mapping would copy every page anyway.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

from ktlong.kv.pinned import HUGE_PAGE

PAGE = mmap.PAGESIZE
_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_POPULATE = 0x02, 0x10, 0x20, 0x8000


def mapping_libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor on an anonymous mapping of its own, its first byte 2 MiB aligned.
    The mapping lives as long as the tensor (and its views) do."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, which transparent huge pages usually skip
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def map_file_pages(dst: torch.Tensor, fd: int, offset: int, nbytes: int) -> int:
    """Map the whole pages of the file's bytes offset..offset+nbytes over dst's memory, private
    (writes stay in DRAM, the file is never changed); returns how many leading bytes are now the
    file's: a multiple of the page size, 0 where dst's start or offset is not page-aligned. dst
    must be contiguous, at least nbytes long and lie in a tensor from mapped_empty (a mapping
    this process owns), never in memory of the general allocator."""
    length = nbytes // PAGE * PAGE
    addr = dst.data_ptr()
    if not sys.platform.startswith("linux") or addr % PAGE or offset % PAGE or length == 0:
        return 0
    assert dst.is_contiguous() and dst.numel() * dst.element_size() >= nbytes
    libc = mapping_libc()
    # Mapped read-only and populated: the kernel reads and maps every page now, in one call, not
    # on a fault each (populating a writable private mapping would copy every page); then made
    # writable, which copies a page only when it is written.
    got = libc.mmap(addr, length, _PROT_READ, _MAP_PRIVATE | _MAP_FIXED | _MAP_POPULATE, fd, offset)
    if got == addr and libc.mprotect(addr, length, _PROT_READ | _PROT_WRITE) == 0:
        return length
    # A failed MAP_FIXED may already have dropped the old pages, and a mapping left read-only
    # would fault on the next write: put fresh writable memory back; the caller copies instead.
    again = libc.mmap(addr, length, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS, -1, 0)
    if again != addr:
        raise OSError(ctypes.get_errno(), "could not restore a KV table's memory after a failed file mapping")
    return 0
