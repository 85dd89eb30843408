"""One copy in DRAM of the leading blocks that several conversations' caches hold: agents over
one repository, one user's questions about one document.

Every table of a host cache (ktlong/kv/host_cache.py) is head-major, [KV, blocks, ...], on a
mapping of its own, so a kv head's leading blocks are one contiguous range. A shared prefix keeps
those ranges of every table of every global layer in memory files (memfd), one per table, and
each cache that holds the prefix maps the files' pages over its own ranges (shared, fixed): the
bytes exist once however many caches hold them, and every reader (prefill's history loads, the
GPU's reads of pinned DRAM, the CPU operator, saved caches) sees a cache as before. The kernel
counts the references: the pages go with the last mapping and the files.

Nobody writes a shared block. A conversation's own tokens begin at the first block past the
prefix; a cache cut back into its prefix (a follow-up that diverges there) takes private copies
first, and an emptied one fresh pages (HostKVCache.unshare).

Mappings are whole pages: the prefix's blocks of every table must fill whole pages, and every
head's range must start on one (`granularity`). A layout where that never holds does not share.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

from ktlong.kv.host_memory import PAGE, mapping_libc

_PROT_RW = 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MADV_HUGEPAGE = 14


def granularity(layout) -> int:
    """The fewest blocks a shared prefix may be made of (it is a multiple of them): every table's
    share of them fills whole pages. 0: this layout cannot share (sliding-window layers keep only
    a tail, a head's range does not start on a page, or the platform maps no memory files)."""
    if layout.sliding or not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return 0
    if any(layout.num_blocks * s % PAGE for s in layout.table_block_bytes()):
        return 0
    return layout.page_blocks()


def shareable_blocks(layout, tokens: int) -> int:
    """The whole blocks of a `tokens`-long common prefix a cache can share: a multiple of granularity."""
    g = granularity(layout)
    return tokens // layout.block_size // g * g if g else 0


def shared_prefix_bytes(layout, blocks: int) -> int:
    """DRAM that `blocks` shared blocks of every table of every global layer take, once."""
    return blocks * sum(layout.table_block_bytes()) * layout.num_kv_heads * len(layout.global_layers)


def dram_held(hosts) -> int:
    """DRAM that host caches (ktlong/kv/host_cache.py) take, the blocks they share counted once."""
    prefixes = {id(h.shared): h.shared.nbytes for h in hosts if h.shared is not None}
    return sum(h.dram_bytes for h in hosts) + sum(prefixes.values())


def _ranges(t: torch.Tensor, blocks: int) -> tuple[int, int, int]:
    """A table's (address, bytes per kv head, bytes of a kv head's first `blocks` blocks)."""
    head_bytes = t[0].numel() * t.element_size()
    return t.data_ptr(), head_bytes, blocks * (head_bytes // t.shape[1])


def _map(addr: int, length: int, flags: int, fd: int = -1, offset: int = 0):
    libc = mapping_libc()
    if libc.mmap(addr, length, _PROT_RW, flags | _MAP_FIXED, fd, offset) != addr:
        raise OSError(ctypes.get_errno(), "could not map a KV table's shared prefix")
    libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(_MADV_HUGEPAGE))  # best effort


class SharedPrefix:
    """The first `blocks` blocks of every kv head of every table, once, in memory files. Made
    from one cache's tables: their bytes move into the files, which are mapped back in their
    place, a table at a time (DRAM holds one table twice at most, never the whole prefix);
    `map_over` makes any other cache's tables of the same layout hold them (or fewer of them)."""

    def __init__(self, tables: list[torch.Tensor], blocks: int):
        self.blocks = blocks
        self.files: list[tuple[int, int]] = []  # per table: (memory file, its bytes per kv head)
        self.nbytes = 0
        try:
            for t in tables:
                heads, (_, _, length) = t.shape[0], _ranges(t, blocks)
                fd = os.memfd_create("ktlong-kv-prefix", os.MFD_CLOEXEC)
                self.files.append((fd, length))
                os.ftruncate(fd, heads * length)
                with mmap.mmap(fd, heads * length, flags=mmap.MAP_SHARED) as region:
                    dst = torch.frombuffer(region, dtype=torch.uint8).view(heads, length)
                    dst.copy_(t.view(torch.uint8).view(heads, -1)[:, :length])
                    del dst  # the buffer's export ends before the region closes
                self._map_table(t, fd, length, blocks)  # the table's own pages there go
                self.nbytes += heads * length
        except BaseException:
            self.close()
            raise

    def map_over(self, tables: list[torch.Tensor], blocks: int):
        """The first `blocks` (at most self.blocks) blocks of each table become the files' pages:
        whatever the cache held there before is dropped."""
        assert blocks <= self.blocks and len(tables) == len(self.files)
        for t, (fd, length) in zip(tables, self.files):
            self._map_table(t, fd, length, blocks)

    def _map_table(self, t: torch.Tensor, fd: int, length: int, blocks: int):
        addr, head_bytes, part = _ranges(t, blocks)
        for h in range(t.shape[0]):
            _map(addr + h * head_bytes, part, _MAP_SHARED, fd, h * length)

    def close(self):
        for fd, _ in self.files:
            os.close(fd)
        self.files = []

    def __del__(self):
        self.close()


def map_private(tables: list[torch.Tensor], blocks: int, keep: bool):
    """Private pages again under each table's first `blocks` blocks of every kv head (where a
    shared prefix was mapped); keep: with the bytes they held (a copy), else zeros."""
    for t in tables:
        addr, head_bytes, part = _ranges(t, blocks)
        rows = t.view(torch.uint8).view(t.shape[0], -1)[:, :part]
        held = rows.clone() if keep else None
        for h in range(t.shape[0]):
            _map(addr + h * head_bytes, part, _MAP_PRIVATE | _MAP_ANONYMOUS)
        if held is not None:
            rows.copy_(held)
