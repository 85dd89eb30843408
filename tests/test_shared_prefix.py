"""Caches that hold one copy of a common prefix (ktlong/kv/shared_prefix.py): a cache that shares
another's leading blocks reads the same values, and they are one copy (a byte written through
one cache's table shows in the other's, which a second copy could not do); its own blocks stay its
own; cutting a cache back into its prefix gives it private copies, emptying it fresh pages, and
neither touches the other cache; the granularity makes whole pages of every table."""

import dataclasses
import math

import pytest
import torch

from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.host_memory import PAGE
from ktlong.kv.layout import kv_layout
from ktlong.kv.shared_prefix import granularity, shareable_blocks

# fp32: 2 KiB of K a block and kv head, 128 B of each side table; 64 blocks, so heads start on pages
LAYOUT = kv_layout(2, 2, 32, 16, 1024, "fp32", anchor_type="DYNAMIC", anchor_num=2)


def filled(seed: int) -> HostKVCache:
    host = HostKVCache(LAYOUT, pin=False)
    host.reserve(LAYOUT.capacity)
    g = torch.Generator().manual_seed(seed)
    for t in host.shared_tables():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    host.advance(LAYOUT.capacity)
    return host


def snapshot(host: HostKVCache) -> list[torch.Tensor]:
    return [t.clone() for t in host.shared_tables()]


def leading(tables, blocks):
    return [t[:, :blocks] for t in tables]


def test_the_granularity_is_the_fewest_blocks_that_fill_whole_pages_of_every_table():
    for kv_type, head_dim, block, anchors in (("fp32", 32, 16, 2), ("q8_0", 128, 128, 1), ("q8_0", 64, 32, 0),
                                             ("bf16", 128, 64, 3), ("q4_0", 128, 128, 1)):
        layout = kv_layout(2, 8, head_dim, block, 1 << 17, kv_type, anchor_type="FIX", anchor_num=anchors)
        sizes = layout.table_block_bytes()
        fewest = next(n for n in range(1, 4097) if all(n * s % PAGE == 0 for s in sizes))
        assert granularity(layout) == fewest, (kv_type, head_dim, block)
        assert shareable_blocks(layout, 5 * fewest * block + block - 1) == 5 * fewest
    # the layouts made for a max_seq_len round it up to whole pages of every table's head range
    small = kv_layout(2, 2, 32, 16, 512, "q8_0")
    g = granularity(small)
    assert g and small.num_blocks % g == 0 and 512 <= small.capacity < 512 + g * 16
    # a head's range not starting on a page, or a model whose sliding layers keep only a tail
    assert granularity(dataclasses.replace(small, num_blocks=32)) == 0
    assert granularity(kv_layout(2, 2, 32, 16, 1 << 15, "bf16", sliding=(True, False), local_windows_len=64)) == 0


def test_a_shared_prefix_is_one_copy_that_each_cache_reads_as_its_own():
    g = granularity(LAYOUT)
    assert g == 32  # 2 of the 64 blocks could not share
    source, other = filled(1), filled(2)
    before, theirs = snapshot(source), snapshot(other)
    other.reset()
    other.share(source, g)
    assert other.num_tokens == g * LAYOUT.block_size and other.shared_blocks == source.shared_blocks == g
    # both read the source's leading blocks; past them each keeps its own
    for mine, was, new, own in zip(source.shared_tables(), before, other.shared_tables(), theirs):
        assert torch.equal(mine, was)
        assert torch.equal(new[:, :g], was[:, :g]) and torch.equal(new[:, g:], own[:, g:])
    # one copy: the same pages under both caches' tables
    k_source, k_other = source.k[1], other.k[1]
    k_source[1, 3, 5, 7] = 123.0
    assert k_other[1, 3, 5, 7].item() == 123.0
    k_other[0, g, 0, 0] = -5.0  # past the prefix each writes its own
    k1 = len(LAYOUT.table_block_bytes())  # layer 1's K among the tables
    assert k_source[0, g, 0, 0].item() == before[k1][0, g, 0, 0].item()
    per_table = sum(LAYOUT.table_block_bytes()) * LAYOUT.num_kv_heads * len(LAYOUT.global_layers)
    assert source.shared_bytes == other.shared_bytes == g * per_table == source.shared.nbytes


def test_a_third_cache_shares_more_of_the_second_and_cuts_and_resets_keep_the_others_intact():
    g = granularity(LAYOUT)
    first = filled(3)
    second, third = HostKVCache(LAYOUT, pin=False), HostKVCache(LAYOUT, pin=False)
    second.share(first, g)
    # the second prefills its own blocks past the prefix (here: written directly)
    second.reserve(LAYOUT.capacity)
    for t in second.shared_tables():
        t[:, g:] = t[:, g:].clone().normal_(generator=torch.Generator().manual_seed(9)) if t.is_floating_point() else 1
    second.advance(LAYOUT.capacity - second.num_tokens)
    held = snapshot(second)
    # the third shares all 64 blocks of the second: the second's bytes become a new shared copy
    third.share(second, 2 * g)
    assert second.shared_blocks == third.shared_blocks == 2 * g and second.shared is third.shared
    assert first.shared_blocks == g and first.shared is not second.shared
    for a, b in zip(snapshot(second), held):
        assert torch.equal(a, b)
    for a, b in zip(third.shared_tables(), held):
        assert torch.equal(a, b)
    first_values = snapshot(first)

    # the third is cut back into its prefix (a follow-up diverging there): private copies, same values
    third.truncate(g * LAYOUT.block_size + 3)
    assert third.shared is None
    for a, b in zip(third.shared_tables(), held):
        assert torch.equal(a, b)
    third.k[0][0, 0, 0, 0] = 77.0
    assert second.k[0][0, 0, 0, 0].item() == held[0][0, 0, 0, 0].item()

    # the second is emptied: zeros for it, nothing changes for the first
    second.reset()
    assert second.shared is None and not any(t.any() for t in second.shared_tables())
    for a, b in zip(snapshot(first), first_values):
        assert torch.equal(a, b)
    assert math.isclose(first.shared_bytes, first.shared.nbytes)


def test_a_cache_shares_only_what_its_source_holds_and_only_when_empty():
    g = granularity(LAYOUT)
    source, other = filled(4), filled(5)
    with pytest.raises(AssertionError):
        other.share(source, g)  # not empty
    other.reset()
    source.truncate(g * LAYOUT.block_size - 1)
    with pytest.raises(AssertionError):
        other.share(source, g)  # the source holds less than the prefix


def test_a_cache_made_on_a_prefix_holds_it_and_commits_only_its_own_blocks():
    g = granularity(LAYOUT)
    source = filled(6)
    made = HostKVCache(LAYOUT, pin=False, prefix=(source, g))
    assert made.num_tokens == g * LAYOUT.block_size and made.shared is source.shared
    for a, b in zip(made.shared_tables(), source.shared_tables()):
        assert torch.equal(a[:, :g], b[:, :g]) and not a[:, g:].any()


def test_the_plan_counts_a_shared_document_once():
    from ktlong.kv.memory_plan import plan_memory
    from ktlong.models.random_model import num_weight_elements, random_config

    c = random_config("llama-3.1-8b")
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, 1 << 17, "q8_0")
    args = (c, 2 * num_weight_elements(c), 2, layout, 8192, 24 << 30, True)
    alone = plan_memory(*args, conversations=8)
    shared = plan_memory(*args, conversations=8, shared_tokens=100_000)
    # 100,000 tokens: 781 whole blocks, 776 of them in multiples of the granularity (8)
    once = 776 * sum(layout.table_block_bytes()) * c.num_kv_heads * c.num_layers
    assert shared.dram_shared == once
    assert alone.dram_total - shared.dram_total == 7 * once
    free = alone.dram_cache * 3 + 10
    assert alone.conversations_that_fit(1 << 50, free) == 3
    assert shared.conversations_that_fit(1 << 50, free) == 1 + (free - alone.dram_cache) // (alone.dram_cache - once)
    assert "shared document, less its 7 copies" in shared.table()
    # with a GPU, each cache is page-locked whole: a shared document lets no more of them fit than RAM spans
    ram = 5 * alone.dram_cache
    assert shared.conversations_that_fit(1 << 50, 1 << 50, ram) == int(0.9 * ram) // alone.dram_cache == 4


def test_a_remap_that_fails_half_way_leaves_nothing_of_the_prefix_to_write_into(monkeypatch):
    """A cache whose mapping of a shared prefix failed part of the way through is still marked as
    sharing, so that emptying it maps private pages over every range again: a conversation later
    prefilled into it cannot write into the other cache's blocks."""
    import ktlong.kv.shared_prefix as shared_prefix

    g = granularity(LAYOUT)
    source, other = filled(7), HostKVCache(LAYOUT, pin=False)
    source_values = snapshot(source)
    real, calls = shared_prefix._map, []

    def failing(addr, length, flags, fd=-1, offset=0):
        calls.append(addr)
        if len(calls) == 5 and fd != -1:
            raise OSError(12, "could not map a KV table's shared prefix")
        real(addr, length, flags, fd, offset)

    HostKVCache(LAYOUT, pin=False, prefix=(source, g))  # the source's bytes are the shared copy now
    monkeypatch.setattr(shared_prefix, "_map", failing)
    calls.clear()
    with pytest.raises(OSError):
        other.share(source, g)
    monkeypatch.setattr(shared_prefix, "_map", real)
    assert other.shared is source.shared
    other.reset()  # a new conversation on this cache
    for t in other.shared_tables():
        t.fill_(9)  # its prefill writes everywhere
    for a, b in zip(snapshot(source), source_values):
        assert torch.equal(a, b)
