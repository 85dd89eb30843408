"""Decode attention over selected KV blocks in one Triton kernel for a batch of conversations, for
GPUs (`context_attention: gpu`): the blocks where they lie in pinned DRAM, read over PCIe.

Gathering the selected pages, widening them to float32 and attending with torch ops
(operators/window_attention.attention_over_prefix, the tests' reference) writes the widened pages
to memory and passes over them about twenty times a layer. Here one program takes one
conversation's kv head's query group and a share of its selected blocks, reads each block where
it lies (bf16, fp16, fp32, or q8_0 with its scales, widened in registers), and keeps an online
softmax; a second kernel merges the shares by log-sum-exp. The arithmetic is float32 throughout,
as the CPU's operator attends to the rest of the selection: the two parts must agree to float32
rounding, or a later selection can flip. Its products run on tensor cores as three TF32 products
(tl.dot's tf32x3: float32's accuracy, within the tests' 1e-5 of the float32 reference), 0.8 ms a
token faster at 1M than IEEE float32 on the H200 (`precision`).

Every conversation of a batch is one launch: each has its own tables (its DRAM cache, its
selection), so the kernel takes the first conversation's tensors as bases and, per conversation,
how far each of its tensors lies from them (`_offsets`; one address space: pinned host memory is
mapped into the device's). Eight 128K conversations at 8B shapes are 1,024 programs a layer
reading over PCIe together, where one launch each left the bus idle between them.

Where a block lies, first match first:
- `near`: a device copy of each kv head's leading blocks (ktlong/kv/resident.py), same layout;
- `kept`: the blocks this layer read from DRAM for the conversation's last tokens, in slots on
  the device (`KeptBlocks`). Real text keeps most of a token's blocks for the next token (Qwen2.5
  at 128K: 72-83%), and a block still selected is not read over PCIe again. `_plan_kept` runs
  first: each selected block's slot, and a free slot for each block read from DRAM, which the
  attention kernel writes as it reads it;
- another conversation's slot: conversations whose caches hold one document in one copy
  (ktlong/kv/shared_prefix.py; `share_group`) read a block of it that several of them select
  once in a step. `_plan_shared` finds, for each block a conversation would read from DRAM, the
  first conversation of its group that reads it from DRAM this step or holds it in a slot; a
  second, small launch of the attention kernel then reads it from there (after the first wrote
  it) into a share of its own, and keeps it in the borrower's slot too;
- DRAM otherwise.

This module needs triton; ktlong/decode/dram_blocks.py imports it when it is asked for.
The CPU's tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.member_tables import MemberTables, member_table

SHARES = 16  # programs per kv head: a share of its hit blocks each
BORROW_SHARES = 4  # programs per kv head and conversation for the blocks it borrows (few of them: most are skipped)
KEYS = 32  # tokens per tile: a [32, head_dim] float32 tile of K and of V fit in registers (a whole
           # 128-token block spilled: 770 us a call on the H100 at 8B shapes); 4096 // head_dim at
           # most (head_dim 256, gemma3: 16; 32 asked for 272 KiB of shared memory, past the H200's 227)
ALIGN = 16  # the tables' offsets are whole multiples of 16 elements, so the loads keep their vector width

# where a conversation's tensors lie from the first one's, per conversation: the tables (k, v, their
# scales; near: the same four; kept: the same four) in units of ALIGN elements, then count, index,
# valid, kept rows and kept plan in elements; then numbers (below)
TABLES = ("k", "v", "ks", "vs", "near_k", "near_v", "near_ks", "near_vs", "kept_k", "kept_v", "kept_ks", "kept_vs")
SCALARS = ("count", "index", "valid", "kept_rows", "kept_plan")
# then the conversation's shared document (SHARE_GROUP: which one, -1 for none; its blocks; the
# DRAM table's blocks per kv head), and last its selection's width (index's columns: each
# conversation's own, as its anchors reach its own length)
SHARE_GROUP = tl.constexpr(len(TABLES) + len(SCALARS))
WIDTH = len(TABLES) + len(SCALARS) + 4


class NearPages(NamedTuple):
    """A device copy of a layer's pages (ktlong/kv/resident.py), laid out as the DRAM ones: each
    kv head's first `count` blocks (a 0-dim int64 device tensor, read at launch) are read here."""
    count: torch.Tensor
    num_blocks: int  # blocks per kv head in both tables: row h * num_blocks + b is block b of head h
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None


class KeptBlocks(NamedTuple):
    """The device's copy of the blocks a layer read from DRAM for recent tokens: S slots per kv
    head, laid out as the DRAM pages (slot s of head h is row h * S + s)."""
    k: torch.Tensor  # [KV * S, B, R]
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    rows: torch.Tensor  # [KV, S] int64: the DRAM row each slot holds, -1 for none
    plan: torch.Tensor  # [2, KV, S] int32, scratch of a step: each selected block's slot (-1: read from
                        # DRAM or near; <= -2: another conversation's slot, -2 - (slot * batch +
                        # that conversation)), and the slot a block read from DRAM is written to


class LayerPages(NamedTuple):
    """One conversation's global layer as the kernel reads it: its DRAM pages [rows, B, R] (q8_0:
    int8, with scales [rows, B, D/32] int16 words of float16), the rows of each kv head's selected
    blocks (index [KV, S] int64) and the tokens of them that count (valid [KV] int64, whole
    blocks, first ones first), and where copies of some of them lie on the device."""
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    index: torch.Tensor
    valid: torch.Tensor
    near: NearPages | None = None
    kept: KeptBlocks | None = None
    share_group: int = -1  # conversations of a batch with one group hold their first blocks in one copy
    shared_blocks: int = 0  # how many (per kv head): a block of them is read once for all of them


@triton.jit
def _per_value(words, KEYS: tl.constexpr, DIM: tl.constexpr):
    """Scale words [KEYS, DIM / 32] (float16 bits) -> float32 [KEYS, DIM], each to its 32 values."""
    scales = words.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.broadcast_to(scales[:, :, None], (KEYS, DIM // 32, 32)), (KEYS, DIM))


@triton.jit
def _table(ptr, offsets, i: tl.constexpr):
    """Table i of this program's conversation (its offset is in units of ALIGN elements)."""
    return ptr + tl.load(offsets + i) * 16


@triton.jit
def _tile(near_ptr, kept_ptr, far_ptr, at, at_kept, at_dest, near, kept, fill, KEPT: tl.constexpr):
    """One tile as stored, from the device copy (near), the kept slots or DRAM; a tile read from
    DRAM goes to its slot too (fill). The masks are uniform: one load reads, and each keeps its
    pointer's alignment (a pointer chosen at run time would lose it, and the loads' vector width)."""
    tile = tl.where(near, tl.load(near_ptr + at, mask=near, other=0), tl.load(far_ptr + at, mask=~near & ~kept, other=0))
    if KEPT:
        tile = tl.where(kept, tl.load(kept_ptr + at_kept, mask=kept, other=0), tile)
        tl.store(kept_ptr + at_dest, tile, mask=fill)
    return tile


@triton.jit
def _plan_kept(index_ptr, valid_ptr, count_ptr, rows_ptr, plan_ptr, offsets_ptr, num_blocks,
               BLOCK: tl.constexpr, SLOTS: tl.constexpr, NEAR: tl.constexpr, WIDTH: tl.constexpr):
    """Conversation b's kv head h: each selected block that a slot holds -> that slot; each other
    block read from DRAM -> a slot no selected block holds (the k-th such block the k-th such
    slot), which then holds it. Blocks read from the device's copy take no slot."""
    h, b = tl.program_id(0), tl.program_id(1)
    num_kv = tl.num_programs(0)
    offsets = offsets_ptr + b * WIDTH
    index_ptr += tl.load(offsets + 13)
    valid_ptr += tl.load(offsets + 14)
    rows_ptr += tl.load(offsets + 15)
    plan_ptr += tl.load(offsets + 16)
    columns = tl.load(offsets + WIDTH - 1)  # the selection's width (last column)
    i = tl.arange(0, SLOTS)
    real = i < columns
    rows = tl.load(index_ptr + h * columns + i, mask=real, other=-1)
    live = i < tl.load(valid_ptr + h) // BLOCK
    if NEAR:
        live = live & (rows % num_blocks >= tl.load(count_ptr + tl.load(offsets + 12)))
    held = tl.load(rows_ptr + h * columns + i, mask=real, other=-2)
    same = (rows[:, None] == held[None, :]) & live[:, None]  # [entry, slot]
    src = tl.max(tl.where(same, i[None, :], -1), 1)
    used = tl.max(same.to(tl.int32), 0) > 0
    missing = live & (src < 0)
    free = real & ~used
    rank_missing = tl.cumsum(missing.to(tl.int32), 0)
    rank_free = tl.cumsum(free.to(tl.int32), 0)
    match = missing[:, None] & free[None, :] & (rank_missing[:, None] == rank_free[None, :])
    dest = tl.where(src >= 0, src, tl.max(tl.where(match, i[None, :], -1), 1))
    filled = tl.max(tl.where(match, rows[:, None], -1), 0)  # per slot: the block it now holds, or -1
    tl.store(plan_ptr + h * columns + i, src.to(tl.int32), mask=real)
    tl.store(plan_ptr + (num_kv + h) * columns + i, dest.to(tl.int32), mask=real)
    tl.store(rows_ptr + h * columns + i, tl.where(filled >= 0, filled, held), mask=real)


@triton.jit
def _entries(index_ptr, valid_ptr, count_ptr, plan_ptr, offsets_ptr, c, h, i, BLOCK: tl.constexpr,
             NEAR: tl.constexpr, WIDTH: tl.constexpr):
    """Conversation c's kv head h's entries i (after _plan_kept): its share group, its blocks
    (absolute, per head), which may lend theirs or borrow (live, from DRAM, within its shared
    blocks), their slots (the kept one, else the one a DRAM read fills) and their plan's source."""
    at = offsets_ptr + c * WIDTH
    columns = tl.load(at + WIDTH - 1)
    real = i < columns
    rows = tl.load(index_ptr + tl.load(at + 13) + h * columns + i, mask=real, other=-1)
    src = tl.load(plan_ptr + tl.load(at + 16) + h * columns + i, mask=real, other=-1)
    dest = tl.load(plan_ptr + tl.load(at + 16) + (tl.num_programs(0) + h) * columns + i, mask=real, other=-1)
    blocks = rows - h * tl.load(at + SHARE_GROUP + 2)
    live = real & (i < tl.load(valid_ptr + tl.load(at + 14) + h) // BLOCK) & (blocks < tl.load(at + SHARE_GROUP + 1))
    if NEAR:
        live = live & (blocks >= tl.load(count_ptr + tl.load(at + 12)))
    return tl.load(at + SHARE_GROUP), blocks, live, tl.where(src >= 0, src, dest), src


@triton.jit
def _plan_shared(index_ptr, valid_ptr, count_ptr, plan_ptr, offsets_ptr, batch, BLOCK: tl.constexpr,
                 SLOTS: tl.constexpr, NEAR: tl.constexpr, WIDTH: tl.constexpr):
    """Kv head h of conversation b (program 1's index + 1) when it shares a document with an
    earlier one: each block it would read from DRAM that the first conversation of its group
    holding it reads from DRAM too, or from its own slot, this step -> read there instead (its
    plan's source becomes -2 - (that slot * batch + that conversation); the borrowed pass reads
    it, after the first pass wrote it). That first holder is never itself a borrower of the block
    (none before it holds it), so its slot is whole by then, and the programs of the later
    conversations may run in any order: one that borrows a block has an earlier holder of it,
    which every later one finds first."""
    h, b = tl.program_id(0), tl.program_id(1) + 1
    i = tl.arange(0, SLOTS)
    group, blocks, live, _, src = _entries(index_ptr, valid_ptr, count_ptr, plan_ptr, offsets_ptr, b, h, i,
                                           BLOCK, NEAR, WIDTH)
    wanted = live & (src == -1) & (group >= 0)
    code = tl.full((SLOTS,), -1, tl.int32)
    for c in range(0, b):
        their_group, theirs, lends, slot, their_src = _entries(index_ptr, valid_ptr, count_ptr, plan_ptr,
                                                               offsets_ptr, c, h, i, BLOCK, NEAR, WIDTH)
        lends = lends & (their_src >= -1) & (their_group == group)
        match = (wanted & (code == -1))[:, None] & lends[None, :] & (blocks[:, None] == theirs[None, :])
        found = tl.max(tl.where(match, slot[None, :], -1), 1)
        code = tl.where(found >= 0, -2 - (found * batch + c), code)
    at = offsets_ptr + b * WIDTH
    columns = tl.load(at + WIDTH - 1)
    tl.store(plan_ptr + tl.load(at + 16) + h * columns + i, tl.where(code <= -2, code, src).to(tl.int32),
             mask=i < columns)


@triton.jit
def _selected_blocks_attention(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, near_k_ptr, near_v_ptr, near_ks_ptr, near_vs_ptr,
                               kept_k_ptr, kept_v_ptr, kept_ks_ptr, kept_vs_ptr, count_ptr, index_ptr, valid_ptr,
                               plan_ptr, offsets_ptr, out_ptr, lse_ptr,
                               num_heads, group, num_blocks, scale, first_share, all_shares,
                               stride_row, stride_token, stride_srow, stride_stoken,
                               BLOCK: tl.constexpr, DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
                               PER_SHARE: tl.constexpr, QUANT: tl.constexpr, NEAR: tl.constexpr, KEPT: tl.constexpr,
                               WIDTH: tl.constexpr, PRECISION: tl.constexpr, SHARING: tl.constexpr,
                               BORROWED: tl.constexpr):
    """Conversation b's kv head h's query rows (group of them, padded to ROWS) over its hit blocks
    PER_SHARE * s .. PER_SHARE * (s + 1) - 1 that count (valid tokens) -> share first_share + s
    of all_shares: out [ROWS, DIM] (normalised by its own softmax sum) and lse [ROWS]; 0 and -inf
    where it holds none. SHARING (_plan_shared ran): the blocks another conversation reads for it
    are left out, or with BORROWED only they are read, from that one's slot (and kept in its own)."""
    h, share, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv, batch = tl.num_programs(0), tl.num_programs(2)
    kept_k0, kept_v0, kept_ks0, kept_vs0 = kept_k_ptr, kept_v_ptr, kept_ks_ptr, kept_vs_ptr  # the first's
    offsets = offsets_ptr + b * WIDTH
    k_ptr, v_ptr = _table(k_ptr, offsets, 0), _table(v_ptr, offsets, 1)
    index_ptr += tl.load(offsets + 13)
    valid_ptr += tl.load(offsets + 14)
    columns = tl.load(offsets + WIDTH - 1)  # the selection's width (last column)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + (b * num_heads + h * group + rows[:, None]) * DIM + dims[None, :],
                mask=(rows < group)[:, None], other=0.0).to(tl.float32)
    valid_blocks = tl.load(valid_ptr + h) // BLOCK
    near = 0
    if NEAR:
        near_k_ptr, near_v_ptr = _table(near_k_ptr, offsets, 4), _table(near_v_ptr, offsets, 5)
        near = tl.load(count_ptr + tl.load(offsets + 12))
    if KEPT:
        kept_k_ptr, kept_v_ptr = _table(kept_k_ptr, offsets, 8), _table(kept_v_ptr, offsets, 9)
        plan_ptr += tl.load(offsets + 16)
    if QUANT:
        ks_ptr, vs_ptr = _table(ks_ptr, offsets, 2), _table(vs_ptr, offsets, 3)
        if NEAR:
            near_ks_ptr, near_vs_ptr = _table(near_ks_ptr, offsets, 6), _table(near_vs_ptr, offsets, 7)
        if KEPT:
            kept_ks_ptr, kept_vs_ptr = _table(kept_ks_ptr, offsets, 10), _table(kept_vs_ptr, offsets, 11)
    run_max = tl.full((ROWS,), float("-inf"), tl.float32)
    run_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for i in range(0, PER_SHARE):
        e = share * PER_SHARE + i
        if e < valid_blocks:
            row = tl.load(index_ptr + h * columns + e)
            near_block = row % num_blocks < near  # on the device; else kept, or in DRAM over PCIe
            kept_block = near_block & ~near_block
            fill_block = kept_block
            slot, dest = row, row
            far_k, far_v, far_ks, far_vs = k_ptr, v_ptr, ks_ptr, vs_ptr
            take = True
            if KEPT:
                src = tl.load(plan_ptr + h * columns + e)
                kept_block = ~near_block & (src >= 0)
                fill_block = ~near_block & (src < 0)
                slot = h * columns + tl.maximum(src, 0)
                dest = h * columns + tl.maximum(tl.load(plan_ptr + (num_kv + h) * columns + e), 0)
                if SHARING:
                    if BORROWED:  # from the lender's slot, into this one's own
                        take = src <= -2
                        code = tl.maximum(-2 - src, 0)
                        lender = offsets_ptr + (code % batch) * WIDTH
                        far_k, far_v = _table(kept_k0, lender, 8), _table(kept_v0, lender, 9)
                        if QUANT:
                            far_ks, far_vs = _table(kept_ks0, lender, 10), _table(kept_vs0, lender, 11)
                        row = h * tl.load(lender + WIDTH - 1) + code // batch
                    else:
                        take = src > -2
            if take:
                for start in range(0, BLOCK, KEYS):  # KEYS tokens at a time: the tiles stay in registers
                    tokens = start + tl.arange(0, KEYS)
                    at = tokens[:, None] * stride_token + dims[None, :]
                    near_tile = tl.full((KEYS, DIM), 0, tl.int1) | near_block
                    kept_tile = tl.full((KEYS, DIM), 0, tl.int1) | kept_block
                    fill_tile = tl.full((KEYS, DIM), 0, tl.int1) | fill_block
                    keys = _tile(near_k_ptr, kept_k_ptr, far_k, row * stride_row + at, slot * stride_row + at,
                                 dest * stride_row + at, near_tile, kept_tile, fill_tile, KEPT).to(tl.float32)
                    values = _tile(near_v_ptr, kept_v_ptr, far_v, row * stride_row + at, slot * stride_row + at,
                                   dest * stride_row + at, near_tile, kept_tile, fill_tile, KEPT).to(tl.float32)
                    if QUANT:  # each scale word read once ([KEYS, DIM / 32]), then spread over its 32 values
                        s_at = tokens[:, None] * stride_stoken + tl.arange(0, DIM // 32)[None, :]
                        near_words = tl.full((KEYS, DIM // 32), 0, tl.int1) | near_block
                        kept_words = tl.full((KEYS, DIM // 32), 0, tl.int1) | kept_block
                        fill_words = tl.full((KEYS, DIM // 32), 0, tl.int1) | fill_block
                        ks = _tile(near_ks_ptr, kept_ks_ptr, far_ks, row * stride_srow + s_at,
                                   slot * stride_srow + s_at, dest * stride_srow + s_at, near_words, kept_words,
                                   fill_words, KEPT)
                        vs = _tile(near_vs_ptr, kept_vs_ptr, far_vs, row * stride_srow + s_at,
                                   slot * stride_srow + s_at, dest * stride_srow + s_at, near_words, kept_words,
                                   fill_words, KEPT)
                        keys = keys * _per_value(ks, KEYS, DIM)
                        values = values * _per_value(vs, KEYS, DIM)
                    logits = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [ROWS, KEYS]
                    new_max = tl.maximum(run_max, tl.max(logits, 1))
                    correction = tl.exp(run_max - new_max)
                    p = tl.exp(logits - new_max[:, None])
                    run_sum = run_sum * correction + tl.sum(p, 1)
                    acc = acc * correction[:, None] + tl.dot(p, values, input_precision=PRECISION)
                    run_max = new_max
    held = run_sum > 0
    out = tl.where(held[:, None], acc / tl.where(held, run_sum, 1.0)[:, None], 0.0)
    lse = tl.where(held, run_max + tl.log(tl.where(held, run_sum, 1.0)), float("-inf"))
    at = ((b * num_kv + h) * all_shares + first_share + share) * ROWS + rows
    tl.store(out_ptr + at[:, None] * DIM + dims[None, :], out)
    tl.store(lse_ptr + at, lse)


@triton.jit
def _merge_shares(out_ptr, lse_ptr, base_o_ptr, base_lse_ptr, o_ptr, o_lse_ptr, num_heads, group,
                  SHARES: tl.constexpr, SLOTS: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
                  BASE: tl.constexpr):
    """Conversation b's kv head h's query row g: its SHARES shares (and, with BASE, a state over
    other keys: the window's) -> its out [DIM] and lse, merged by log-sum-exp; 0 and -inf where
    all are empty. Every share in one load (SLOTS: SHARES rounded up to a power of two), a
    program a query row (a program a kv head walked its padded rows' shares one after another:
    11 us a layer at batch 8, 128K, 8B shapes, on the H200)."""
    h, b, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv = tl.num_programs(0)
    shares = tl.arange(0, SLOTS)
    held_share = shares < SHARES
    dims = tl.arange(0, DIM)
    first = (b * num_kv + h) * SHARES  # this head's first share
    head = b * num_heads + h * group + g  # this query row
    lses = tl.load(lse_ptr + (first + shares) * ROWS + g, mask=held_share, other=float("-inf"))
    top = tl.max(lses, 0)
    if BASE:
        base_lse = tl.load(base_lse_ptr + head)
        top = tl.maximum(top, base_lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lses - top)
    parts = tl.load(out_ptr + ((first + shares[:, None]) * ROWS + g) * DIM + dims[None, :], mask=held_share[:, None],
                    other=0.0)
    total = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * parts, 0)
    if BASE:
        w_base = tl.exp(base_lse - top)
        total += w_base
        acc += w_base * tl.load(base_o_ptr + head * DIM + dims)
    held = total > 0
    tl.store(o_ptr + head * DIM + dims, tl.where(held, acc / tl.where(held, total, 1.0), 0.0))
    tl.store(o_lse_ptr + head, tl.where(held, top + tl.log(tl.where(held, total, 1.0)), float("-inf")))


def precision(head_dim: int) -> str:
    """tl.dot's precision: three TF32 products (float32's accuracy on tensor cores) up to a
    head_dim of 128; IEEE float32 past it, where tf32x3's operand tiles need more shared memory
    than an H200 has (233,472 of 232,448 bytes at Gemma 3's 256)."""
    return "tf32x3" if head_dim <= 128 else "ieee"


def kernel_applies(kv_type: str, block_size: int, head_dim: int) -> bool:
    """Formats and shapes the kernel takes: pages stored as values or q8_0 (q4_0 stays on torch),
    power-of-two block and head sizes of at least 16 (tl.dot's smallest tile)."""
    def power_of_two(n):
        return n >= 16 and n & (n - 1) == 0
    return kv_type in ("bf16", "fp16", "fp32", "q8_0") and power_of_two(block_size) and power_of_two(head_dim)


def _offsets(tensors: list[tuple], extras: list[list[int]], device: torch.device, tables: MemberTables | None,
             signature: tuple) -> tuple[list, torch.Tensor]:
    """Each conversation's tensors (TABLES then SCALARS; None: not read) and numbers (its share
    group, shared blocks, table blocks and selection's width) -> (each column's base, [B, WIDTH]
    int64 on the device: how far each tensor lies from its column's base, in ALIGN elements for
    the tables, then the numbers). tables: the batch's store (member_tables.MemberTables)."""
    names = TABLES + SCALARS
    columns = [([row[i] for row in tensors], ALIGN if i < len(TABLES) else 1, names[i]) for i in range(len(names))]
    return member_table(tables, "selected blocks", columns, [list(numbers) for numbers in zip(*extras)], device,
                        signature)


def _check(layer: LayerPages, first: LayerPages, device: torch.device, heads: int):
    expect("k", layer.k, ndim=3)
    expect("v", layer.v, shape=tuple(layer.k.shape), dtype=layer.k.dtype)
    if layer.k.stride() != first.k.stride() or layer.v.stride() != first.k.stride() or layer.k.dtype != first.k.dtype:
        raise ValueError("every conversation's pages must be laid out as the first one's")
    expect("hit_index", layer.index, shape=(first.index.shape[0], None), dtype=torch.int64, device=device)
    if not layer.index.is_contiguous():
        raise ValueError("hit_index must be contiguous")
    expect("hit_valid", layer.valid, shape=(first.index.shape[0],), dtype=torch.int64, device=device)
    if heads % layer.index.shape[0]:
        raise ValueError(f"q's {heads} heads must be whole groups of hit_index's {layer.index.shape[0]} kv heads")
    if (layer.k_scales is None) != (first.k_scales is None):
        raise ValueError("every conversation's pages must be stored in one format")
    if layer.k_scales is not None:
        expect("k_scales", layer.k_scales, shape=(layer.k.shape[0], layer.k.shape[1], None), dtype=torch.int16)
        expect("v_scales", layer.v_scales, shape=tuple(layer.k_scales.shape), dtype=torch.int16)
        if layer.k_scales.stride() != first.k_scales.stride() or layer.v_scales.stride() != first.k_scales.stride():
            raise ValueError("every conversation's scales must be laid out as the first one's")
    for name, copy in (("near", layer.near), ("kept", layer.kept)):
        if (copy is None) != (getattr(first, name) is None):
            raise ValueError(f"every conversation of a batch has a {name} copy of its blocks, or none does")
        if copy is not None and (copy.k.stride() != layer.k.stride() or copy.v.stride() != layer.k.stride()
                                 or copy.k.dtype != layer.k.dtype or layer.k_scales is not None and (
                                     copy.k_scales.stride() != layer.k_scales.stride()
                                     or copy.v_scales.stride() != layer.k_scales.stride())):
            raise ValueError(f"the {name} copy of the pages must be laid out as the DRAM pages")
    if layer.near is not None and layer.near.num_blocks != first.near.num_blocks:
        raise ValueError("every conversation's device copy must count the same blocks per kv head")
    if layer.kept is not None:
        expect("kept rows", layer.kept.rows, shape=tuple(layer.index.shape), dtype=torch.int64, device=device)
        expect("kept plan", layer.kept.plan, shape=(2, *layer.index.shape), dtype=torch.int32, device=device)


def selected_blocks_attention(q: torch.Tensor, layers: list[LayerPages], scale: float, base=None,
                              out: torch.Tensor | None = None, tables: MemberTables | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D] (float32, or a narrower float widened here): conversation b's queries over its
    selected blocks, layers[b] -> out [B, H, D], lse [B, H] float32 (natural log; -inf and 0 for a
    head that holds nothing). base: a state (out [B, H, D], lse [B, H] float32) over other keys to
    merge in, e.g. the windows', or a function that returns one, called after the shares' kernel
    is queued (another stream's work to join: it then runs beside the reads). out: a [B, H, D]
    float32 tensor to write the result into. tables: the batch's store of its tables
    (member_tables.MemberTables), needed to capture a CUDA graph. Fixed shapes, no sync; a layer's kept
    slots are updated (the blocks read from DRAM join them)."""
    expect("q", q, ndim=3, dtype=(torch.float32, torch.bfloat16, torch.float16))
    batch, num_heads, dim = q.shape
    if len(layers) != batch:
        raise ValueError(f"q holds {batch} conversations' queries, and {len(layers)} conversations' pages were given")
    first = layers[0]
    for layer in layers:
        # the pages may lie on q's device or in host memory registered with CUDA (the DRAM cache,
        # read in place over PCIe); torch cannot tell registered memory, so their device is not checked
        _check(layer, first, q.device, num_heads)
    num_kv = first.index.shape[0]
    max_selected = max(layer.index.shape[1] for layer in layers)
    quant, near, kept = first.k_scales is not None, first.near is not None, first.kept is not None
    num_blocks = first.near.num_blocks if near else 1

    def tensors(layer: LayerPages) -> tuple:
        n, c = layer.near, layer.kept
        return (layer.k, layer.v, layer.k_scales, layer.v_scales,
                *((n.k, n.v, n.k_scales, n.v_scales) if near else (None,) * 4),
                *((c.k, c.v, c.k_scales, c.v_scales) if kept else (None,) * 4),
                n.count if near else None, layer.index, layer.valid,
                c.rows if kept else None, c.plan if kept else None)
    # after the offsets: each one's shared document, its blocks, its table's blocks per head, its width
    extras = [[layer.share_group, layer.shared_blocks, layer.k.shape[0] // num_kv, layer.index.shape[1]]
              for layer in layers]
    groups = [layer.share_group for layer in layers if layer.share_group >= 0 and layer.shared_blocks > 0]
    sharing = kept and len(groups) > len(set(groups))  # two or more of one group: their blocks read once
    signature = (quant, near, kept, sharing, num_blocks, max_selected, tuple(first.k.shape), first.k.stride(),
                 None if first.k_scales is None else first.k_scales.stride())
    at, offsets = _offsets([tensors(layer) for layer in layers], extras, q.device, tables, signature)
    k_at, v_at, ks_at, vs_at, nk, nv, nks, nvs, ck, cv, cks, cvs, count, index, valid, rows_at, plan = at
    # tensors that are not read stand in for their pointers (a placeholder keeps its own alignment)
    ks_at, vs_at = (ks_at, vs_at) if quant else (index, index)
    ks = first.k_scales if quant else first.index
    n = NearPages(count, num_blocks, nk, nv, nks, nvs) if near else NearPages(valid, 1, k_at, v_at, ks_at, vs_at)
    c = KeptBlocks(ck, cv, cks, cvs, rows_at, plan) if kept else KeptBlocks(k_at, v_at, ks_at, vs_at, index, valid)
    merged = torch.empty((batch, num_heads, dim), dtype=torch.float32, device=q.device) if out is None else out
    expect("out", merged, shape=(batch, num_heads, dim), dtype=torch.float32, device=q.device)
    if not merged.is_contiguous():
        raise ValueError("out must be contiguous")
    if kept:
        _plan_kept[(num_kv, batch)](index, valid, n.count, c.rows, c.plan, offsets, num_blocks,
                                    BLOCK=first.k.shape[1], SLOTS=triton.next_power_of_2(max_selected),
                                    NEAR=near, WIDTH=WIDTH)
    if sharing:
        _plan_shared[(num_kv, batch - 1)](index, valid, n.count, c.plan, offsets, batch, BLOCK=first.k.shape[1],
                                SLOTS=triton.next_power_of_2(max_selected), NEAR=near, WIDTH=WIDTH)
    group = num_heads // num_kv
    rows = max(16, triton.next_power_of_2(group))
    shares = min(SHARES, max(max_selected, 1))
    per_share = -(-max_selected // shares)
    # sharing: a few more shares a kv head, the blocks borrowed from another conversation (each
    # program walks its share's entries one after another: one for all of them took 68 us a layer)
    borrow_shares = min(BORROW_SHARES, shares) if sharing else 0
    every = shares + borrow_shares
    part = torch.empty((batch, num_kv, every, rows, dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_kv, every, rows), dtype=torch.float32, device=q.device)
    for first_share, programs, blocks, borrowed in ((0, shares, per_share, False),) + (
            ((shares, borrow_shares, -(-max_selected // max(borrow_shares, 1)), True),) if sharing else ()
    ):  # the borrowed after the lenders' reads
        _selected_blocks_attention[(num_kv, programs, batch)](
            q.contiguous(), k_at, v_at, ks_at, vs_at, n.k, n.v, n.k_scales, n.v_scales, c.k, c.v, c.k_scales,
            c.v_scales, n.count, index, valid, c.plan, offsets, part, part_lse,
            num_heads, group, num_blocks, scale, first_share, every, first.k.stride(0), first.k.stride(1),
            ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
            BLOCK=first.k.shape[1], DIM=dim, ROWS=rows, KEYS=min(KEYS, first.k.shape[1], 4096 // dim),
            PER_SHARE=blocks, QUANT=quant, NEAR=near, KEPT=kept, WIDTH=WIDTH, PRECISION=precision(dim),
            SHARING=sharing, BORROWED=borrowed)
    merged_lse = torch.empty((batch, num_heads), dtype=torch.float32, device=q.device)
    base = base() if callable(base) else base
    base_o, base_lse = (base[0].float().contiguous(), base[1].float().contiguous()) if base is not None else (part, part_lse)
    _merge_shares[(num_kv, batch, group)](part, part_lse, base_o, base_lse, merged, merged_lse, num_heads, group,
                                          SHARES=every, SLOTS=triton.next_power_of_2(every), ROWS=rows, DIM=dim,
                                          BASE=base is not None)
    return merged, merged_lse
