"""A host KV cache holds memory only for what it reserves (ktlong/kv/host_cache.py): an empty one
next to nothing, whatever max_seq_len; reserving grows every global table's kv-head ranges in
whole pages (2 MiB ones of K and V, where Linux gives huge pages), zeroed, and keeps what was written below; the byte counts follow."""

import ctypes
import mmap
import os

import pytest
import torch

from ktlong.kv.host_cache import GROWTH_BLOCKS, GROWTH_MAX_BLOCKS, HostKVCache, growth_step, reserved_blocks
from ktlong.kv.layout import kv_layout
from ktlong.kv.pinned import HUGE_PAGE
from ktlong.kv.shared_prefix import granularity, shared_prefix_bytes

# fp32 K/V, 2 kv heads of 64, blocks of 16: 8 KiB of K a block and head; 4,096 blocks (64 MiB of K)
LAYOUT = kv_layout(4, 2, 64, 16, 1 << 16, "fp32", anchor_type="DYNAMIC", anchor_num=1)
PER_BLOCK = shared_prefix_bytes(LAYOUT, 1)  # every global table's bytes of one block, all heads


def resident(host: HostKVCache) -> int:
    """Bytes of the cache's tables that are in memory, page by page (mincore): the kernel's count."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = 0
    for kind in host._kinds():
        for t in kind:
            if not t.numel():
                continue
            start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
            length = t.data_ptr() + t.numel() * t.element_size() - start
            pages = -(-length // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(start, length, vec) == 0
            total += sum(v & 1 for v in vec) * mmap.PAGESIZE
    return total


def test_an_empty_cache_holds_next_to_nothing_and_reserving_holds_what_it_says():
    host = HostKVCache(LAYOUT, pin=False)
    whole = LAYOUT.dram_cache_bytes()
    assert whole > 256 << 20
    assert set(host.committed.values()) == {0} and host.dram_bytes == 0
    assert resident(host) == 0  # the mappings are there, their pages are not
    host.reserve(1000, [1])  # one layer first, as a prefill reaches it: 63 blocks, and room past them
    step = growth_step(LAYOUT)  # whole 2 MiB pages of a head's K (512 blocks here)
    held = host.committed[1]
    assert step % LAYOUT.page_blocks() == 0 and held % step == 0 and 63 + 16 <= held < 63 + 16 + step
    assert host.committed == {0: 0, 1: held, 2: 0, 3: 0} and host.dram_bytes == held * PER_BLOCK // 4
    one_layer = len(host.shared_tables()) // 4 * LAYOUT.num_kv_heads  # its kv-head ranges
    assert host.dram_bytes <= resident(host) <= host.dram_bytes + one_layer * HUGE_PAGE
    host.reserve(1000)  # every layer
    assert set(host.committed.values()) == {held} and host.dram_bytes == held * PER_BLOCK
    # whole pages of every kv head's range; where Linux gives huge pages to every mapping (THP
    # "always"), a range of a side table may hold one 2 MiB page more than its blocks fill
    ranges = len(host.shared_tables()) * LAYOUT.num_kv_heads
    assert host.dram_bytes <= resident(host) <= host.dram_bytes + ranges * HUGE_PAGE
    host.reserve(500)  # within what it holds: nothing changes
    assert host.dram_bytes == held * PER_BLOCK
    host.reserve(LAYOUT.capacity)  # to the end, never past it
    assert set(host.committed.values()) == {LAYOUT.num_blocks} and host.dram_bytes == whole


def test_growing_keeps_what_was_written_and_zeroes_the_new_blocks():
    host = HostKVCache(LAYOUT, pin=False)
    host.reserve(100)
    first = host.committed[0]
    g = torch.Generator().manual_seed(0)
    for t in host.shared_tables():
        t[:, :first].normal_(generator=g)
    held = [t[:, :first].clone() for t in host.shared_tables()]
    host.advance(100)
    host.reserve(first * LAYOUT.block_size + 1)
    assert min(host.committed.values()) > first
    for t, was in zip(host.shared_tables(), held):
        assert torch.equal(t[:, :first], was)
        assert not t[:, first:host.committed[0]].any()


def test_a_cache_made_on_a_shared_prefix_holds_none_of_its_own_until_it_reserves():
    g = granularity(LAYOUT)
    source = HostKVCache(LAYOUT, pin=False)
    source.reserve(2 * g * LAYOUT.block_size)
    source.advance(2 * g * LAYOUT.block_size)
    made = HostKVCache(LAYOUT, pin=False, prefix=(source, g))
    assert set(made.committed.values()) == {0} and made.dram_bytes == 0 and made.shared_bytes == g * PER_BLOCK
    made.reserve(made.num_tokens + 1)  # its own blocks past the prefix
    assert made.committed[0] > g and made.dram_bytes == (made.committed[0] - g) * PER_BLOCK


@pytest.fixture
def page_locks(monkeypatch):
    """Page-locking simulated (no GPU here): each range a cache would lock, as (address, bytes), in
    order; nothing is unlocked; pieces of at most 1 MiB (PIN_PIECE_BYTES)."""
    from ktlong.kv import host_cache, pinned

    locked = []
    monkeypatch.setattr(pinned, "pin_in_place", lambda t: locked.append((t.data_ptr(), t.numel() * t.element_size())))
    monkeypatch.setattr(pinned.PinnedTensors, "_unlock", lambda self: None)
    monkeypatch.setattr(pinned.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(host_cache, "PIN_PIECE_BYTES", 1 << 20)
    return locked


def pieces_within(locked: list, t: torch.Tensor) -> list:
    """The locked ranges that start inside tensor t's bytes, in address order."""
    start, size = t.data_ptr(), t.numel() * t.element_size()
    return sorted((p, n) for p, n in locked if start <= p < start + size)


def test_sharing_locks_nothing_and_the_caches_next_reservation_locks_the_prefix_without_zeroing_it(page_locks):
    """A join that shares a document maps its pages and returns: page-locking them (1.4-2.0 s for
    a 128K document at 8B shapes, every stream waiting) is left to the cache's next reservation
    (its prefill's first, a piece at a time between its slices): that locks the prefix's pages
    with its own, in the same bounded pieces, and zeroes only its own blocks."""
    locked = page_locks
    g = granularity(LAYOUT)
    source = HostKVCache(LAYOUT, pin=True)
    source.reserve(3 * g * LAYOUT.block_size)
    for t in source.shared_tables():
        t[:, :3 * g] = 7
    source.advance(3 * g * LAYOUT.block_size)
    made = HostKVCache(LAYOUT, pin=True)
    locked.clear()
    made.share(source, 2 * g)
    assert not any(pieces_within(locked, t) for t in made.shared_tables())  # mapped, not locked
    assert set(made.committed.values()) == {0}
    made.reserve(3 * g * LAYOUT.block_size)
    for t in made.shared_tables():
        blocks = made.committed[1]
        for h in range(t.shape[0]):
            pieces = pieces_within(locked, t[h, :blocks])  # the prefix's pages too, from the head's start
            assert pieces[0][0] == t[h].data_ptr() and sum(n for _, n in pieces) == t[h, :blocks].nbytes
        assert (t[:, :2 * g] == 7).all() and not t[:, 2 * g:blocks].any()  # the prefix kept, its own zeroed
    source._pinned._tensors = made._pinned._tensors = []  # nothing was locked: nothing to unlock


def test_a_prefill_reserving_a_chunk_at_a_time_grows_in_bounded_pieces_and_ends_where_one_reservation_would():
    """8B shapes at q8_0 under a max_seq_len of 1M: a layer of a 1M prompt reserved a 4,096-token
    chunk at a time grows by an eighth of what it holds, GROWTH_MAX_BLOCKS at most (in whole
    pages), so each piece is a short pause, and ends holding what reserving the prompt at once
    holds: the prompt and GROWTH_BLOCKS, rounded up to a page, not an eighth more."""
    layout = kv_layout(32, 8, 128, 128, 1_050_624, "q8_0")
    step = growth_step(layout)  # 128 blocks: 2 MiB of a head's K
    prompt = 1_000_000
    blocks = -(-prompt // 128)
    once = reserved_blocks(layout, prompt)
    assert once == -(-(blocks + GROWTH_BLOCKS) // step) * step
    held, pieces = 0, []
    for end in range(4096, prompt + 4096, 4096):
        end = min(end, prompt)
        if -(-end // 128) > held:
            grown = reserved_blocks(layout, end, held, ahead=prompt)
            pieces.append(grown - held)
            held = grown
    assert held == once
    assert max(pieces) <= GROWTH_MAX_BLOCKS + step and len(pieces) < 60
    # a decode step past what a conversation holds grows it by an eighth (at most the cap)
    assert reserved_blocks(layout, 512 * 128 + 1, held=512) == 512 + step
    assert reserved_blocks(layout, 4096 * 128 + 1, held=4096) == 4096 + GROWTH_MAX_BLOCKS
    assert reserved_blocks(layout, layout.capacity, held=8192) == layout.num_blocks


def vm_flags(t: torch.Tensor) -> set[str]:
    """The kernel's flags of the mapping that holds t (/proc/self/smaps): "hg" where it was
    advised MADV_HUGEPAGE."""
    address, flags = t.data_ptr(), None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif head == "VmFlags:" and inside:
                flags = set(line.split()[1:])
    assert flags is not None, "the tensor's mapping is not in smaps"
    return flags


def test_only_a_cache_that_the_cpu_reads_asks_for_huge_pages():
    """Pinned (a GPU reads it over PCIe), K and V stay on small pages: asking for huge ones makes
    Linux compact memory at every fault once DRAM is nearly full. The CPU's own cache asks."""
    on_cpu, for_gpu = HostKVCache(LAYOUT, pin=False), HostKVCache(LAYOUT, pin=True)  # nothing pinned until reserved
    thp = os.path.isdir("/sys/kernel/mm/transparent_hugepage")  # a kernel without THP refuses the advice
    for host, asked in ((on_cpu, thp), (for_gpu, False)):
        assert ("hg" in vm_flags(host.k[1])) == asked and ("hg" in vm_flags(host.v[1])) == asked
        assert "hg" not in vm_flags(host.key_mean[1])  # side tables: read whole, never asked


def test_a_reservation_page_locks_each_heads_range_in_bounded_whole_page_pieces_pausing_after_each(page_locks):
    """While CUDA page-locks a range, other threads' calls into it wait (a prefill's chunks and the
    decode steps beside it, behind its layers' helper): each kv head's range of a table is locked
    in pieces of at most PIN_PIECE_BYTES, or one growth step, which tile it on whole pages (no
    page in two ranges: the driver refuses that), and pace() runs after each."""
    locked = page_locks
    host = HostKVCache(LAYOUT, pin=True)
    locked.clear()  # the sliding layers' tails (none here)
    paces = []
    host.reserve(20_000, [1], pace=lambda: paces.append(len(locked)))
    assert paces == list(range(1, len(locked) + 1))  # one pause after each piece
    blocks, step = host.committed[1], growth_step(LAYOUT)
    counts = []
    for kind in host._kinds():
        t = kind[1][:, :blocks]
        for h in range(t.shape[0] if t.numel() else 0):
            pieces = pieces_within(locked, t[h])
            assert pieces[0][0] == t[h].data_ptr() and sum(n for _, n in pieces) == t[h].nbytes
            assert all(p + n == q for (p, n), (q, _) in zip(pieces, pieces[1:]))  # no gap, no overlap
            assert all(p % mmap.PAGESIZE == 0 and n % mmap.PAGESIZE == 0 for p, n in pieces)
            block = t[h, 0].numel() * t.element_size()
            assert all(n <= max(1 << 20, step * block) for _, n in pieces)
            counts.append(len(pieces))
    assert min(counts[:4]) > 1  # K's and V's heads (5 MiB each) did come in several pieces
    assert all(torch.count_nonzero(kind[1][:, :blocks]) == 0 for kind in host._kinds())  # zeroed
    host._pinned._tensors = []  # nothing was locked: nothing to unlock when it goes


def test_a_decoding_conversation_grows_a_layer_a_step_ahead_of_its_tokens():
    """grow_ahead, called every step after reserve (ktlong/decode/batch.py): once the prompt's
    reservation runs out, each growth comes one layer a step, before the tokens reach it, so
    reserve never grows every layer in one step; each layer grows by what reserve would give it."""
    host = HostKVCache(LAYOUT, pin=False)
    host.reserve(1000, ahead=1000)  # as a prefill leaves it: the prompt and GROWTH_BLOCKS
    held = host.committed[0]
    grown_per_step, reserve_grew = [], 0
    for pos in range(1000, held * LAYOUT.block_size + 200):  # past the prompt's reservation
        before = dict(host.committed)
        host.reserve(pos + 1)
        reserve_grew += host.committed != before
        mid = dict(host.committed)
        host.grow_ahead(pos + 1)
        grown_per_step.append(sum(host.committed[layer] != mid[layer] for layer in mid))
        assert all(c * LAYOUT.block_size >= pos + 1 for c in host.committed.values())
    assert reserve_grew == 0 and max(grown_per_step) == 1
    assert sum(grown_per_step) == len(host.committed)  # each layer once
    assert set(host.committed.values()) == {reserved_blocks(LAYOUT, held * LAYOUT.block_size, held)}
