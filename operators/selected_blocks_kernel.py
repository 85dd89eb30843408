"""Decode attention over selected KV blocks in one Triton kernel, for GPUs
(`context_attention: gpu`): the blocks where they lie in pinned DRAM, read over PCIe.

Gathering the selected pages, widening them to float32 and attending with torch ops
(operators/window_attention.attention_over_prefix, the tests' reference) writes the widened pages
to memory and passes over them about twenty times a layer. Here one program takes one kv head's
query group and a share of its selected blocks, reads each block where it lies (bf16, fp16, fp32,
or q8_0 with its scales, widened in registers), and keeps an online softmax; a few torch ops merge the shares by log-sum-exp. The
arithmetic is float32 throughout, as the CPU's operator attends to the rest of the selection:
the two parts must agree to float32 rounding, or a later selection can flip. Its products run
on tensor cores as three TF32 products (tl.dot's tf32x3: float32's accuracy, within the tests'
1e-5 of the float32 reference), 0.8 ms a token faster at 1M than IEEE float32 on the H200
(`precision`).

This module needs triton; ktlong/decode/dram_blocks.py imports it when it is asked for.
The CPU's tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from operators.checks import expect

SHARES = 16  # programs per kv head: a share of its hit blocks each
KEYS = 32  # tokens per tile: a [32, head_dim] float32 tile of K and of V fit in registers (a whole
           # 128-token block spilled: 770 us a call on the H100 at 8B shapes)


@triton.jit
def _per_value(words, KEYS: tl.constexpr, DIM: tl.constexpr):
    """Scale words [KEYS, DIM / 32] (float16 bits) -> float32 [KEYS, DIM], each to its 32 values."""
    scales = words.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.broadcast_to(scales[:, :, None], (KEYS, DIM // 32, 32)), (KEYS, DIM))


@triton.jit
def _selected_blocks_attention(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, near_k_ptr, near_v_ptr, near_ks_ptr, near_vs_ptr,
                             near_ptr, index_ptr, valid_ptr, out_ptr, lse_ptr,
                             group, max_selected, num_blocks, scale,
                             stride_row, stride_token, stride_srow, stride_stoken,
                             BLOCK: tl.constexpr, DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr, PER_SHARE: tl.constexpr,
                             QUANT: tl.constexpr, PRECISION: tl.constexpr):
    """Kv head h's query rows (group of them, padded to ROWS) over its hit blocks
    PER_SHARE * s .. PER_SHARE * (s + 1) - 1 that count (valid tokens) -> this share's out [ROWS,
    DIM] (normalised by its own softmax sum) and lse [ROWS]; 0 and -inf where it holds none.
    A block among each head's first `near` (read from near_ptr) is read from the near_* tables
    (the device's copy), the others from k_ptr.. (DRAM): the same rows, the same arithmetic."""
    h, share = tl.program_id(0), tl.program_id(1)
    num_shares = tl.num_programs(1)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + (h * group + rows[:, None]) * DIM + dims[None, :], mask=(rows < group)[:, None],
                other=0.0).to(tl.float32)
    valid_blocks = tl.load(valid_ptr + h) // BLOCK
    near = tl.load(near_ptr)
    run_max = tl.full((ROWS,), float("-inf"), tl.float32)
    run_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for i in range(0, PER_SHARE):
        b = share * PER_SHARE + i
        if b < valid_blocks:
            row = tl.load(index_ptr + h * max_selected + b)
            near_block = row % num_blocks < near  # on the device; else in DRAM, over PCIe
            for start in range(0, BLOCK, KEYS):  # KEYS tokens at a time: the tiles stay in registers
                tokens = start + tl.arange(0, KEYS)
                at = row * stride_row + tokens[:, None] * stride_token + dims[None, :]
                # both tables masked by one uniform condition: one of the loads reads, and each keeps
                # its pointer's alignment (a pointer chosen at run time would lose it, and the loads'
                # vector width with it)
                near_tile = tl.full((KEYS, DIM), 0, tl.int1) | near_block
                keys = tl.where(near_tile, tl.load(near_k_ptr + at, mask=near_tile, other=0),
                                tl.load(k_ptr + at, mask=~near_tile, other=0)).to(tl.float32)  # [KEYS, DIM]
                values = tl.where(near_tile, tl.load(near_v_ptr + at, mask=near_tile, other=0),
                                  tl.load(v_ptr + at, mask=~near_tile, other=0)).to(tl.float32)
                if QUANT:  # each scale word read once ([KEYS, DIM / 32]), then spread over its 32 values
                    groups = tl.arange(0, DIM // 32)
                    s_at = row * stride_srow + tokens[:, None] * stride_stoken + groups[None, :]
                    near_words = tl.full((KEYS, DIM // 32), 0, tl.int1) | near_block
                    ks = tl.where(near_words, tl.load(near_ks_ptr + s_at, mask=near_words, other=0),
                                  tl.load(ks_ptr + s_at, mask=~near_words, other=0))
                    vs = tl.where(near_words, tl.load(near_vs_ptr + s_at, mask=near_words, other=0),
                                  tl.load(vs_ptr + s_at, mask=~near_words, other=0))
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
    at = (h * num_shares + share) * ROWS + rows
    tl.store(out_ptr + at[:, None] * DIM + dims[None, :], out)
    tl.store(lse_ptr + at, lse)


@triton.jit
def _merge_shares(out_ptr, lse_ptr, base_o_ptr, base_lse_ptr, o_ptr, o_lse_ptr, group,
                  SHARES: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BASE: tl.constexpr):
    """Kv head h's shares (and, with BASE, a state over other keys: the window's) -> its query
    rows' out [group, DIM] and lse [group], merged by log-sum-exp; 0 and -inf where all are empty."""
    h = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    real = rows < group
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    for share in range(SHARES):
        top = tl.maximum(top, tl.load(lse_ptr + (h * SHARES + share) * ROWS + rows))
    if BASE:
        base_lse = tl.load(base_lse_ptr + h * group + rows, mask=real, other=float("-inf"))
        top = tl.maximum(top, base_lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for share in range(SHARES):
        w = tl.exp(tl.load(lse_ptr + (h * SHARES + share) * ROWS + rows) - top)
        part = tl.load(out_ptr + ((h * SHARES + share) * ROWS + rows[:, None]) * DIM + dims[None, :])
        total += w
        acc += w[:, None] * part
    if BASE:
        w = tl.exp(base_lse - top)
        part = tl.load(base_o_ptr + (h * group + rows[:, None]) * DIM + dims[None, :], mask=real[:, None], other=0.0)
        total += w
        acc += w[:, None] * part
    held = total > 0
    o = tl.where(held[:, None], acc / tl.where(held, total, 1.0)[:, None], 0.0)
    merged = tl.where(held, top + tl.log(tl.where(held, total, 1.0)), float("-inf"))
    tl.store(o_ptr + (h * group + rows[:, None]) * DIM + dims[None, :], o, mask=real[:, None])
    tl.store(o_lse_ptr + h * group + rows, merged, mask=real)


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


class NearPages(NamedTuple):
    """A device copy of a layer's pages (ktlong/kv/resident.py), laid out as the DRAM ones: each
    kv head's first `count` blocks (a 0-dim int64 device tensor, read at launch) are read here."""
    count: torch.Tensor
    num_blocks: int  # blocks per kv head in both tables: row h * num_blocks + b is block b of head h
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None


def selected_blocks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scales: torch.Tensor | None,
                            v_scales: torch.Tensor | None, hit_index: torch.Tensor, hit_valid: torch.Tensor,
                            scale: float, base=None,
                            near: NearPages | None = None, out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, D] (float32, or a narrower float widened here); k, v: one layer's pages [rows, B, R]
    (q8_0: int8 with k_scales, v_scales [rows, B, D/32] int16 words of float16); hit_index [KV, S]
    rows of each kv head's hit blocks, hit_valid [KV] tokens that count (whole blocks, first ones
    first) -> out [H, D], lse [H] float32 (natural log; -inf and 0 for a head that holds nothing).
    base: a state (out [H, D], lse [H] float32) over other keys to merge in, e.g. the window's, or
    a function that returns one, called after the shares' kernel is queued (another stream's work
    to join: it then runs beside the reads).
    near: a device copy of the leading blocks, read instead of k, v where it holds them. out: an
    [H, D] float32 tensor to write the result into. Fixed shapes, no sync."""
    expect("q", q, ndim=2, dtype=(torch.float32, torch.bfloat16, torch.float16))
    expect("k", k, ndim=3)
    expect("v", v, shape=tuple(k.shape), dtype=k.dtype)
    expect("hit_index", hit_index, ndim=2, dtype=torch.int64, device=q.device)
    expect("hit_valid", hit_valid, shape=(hit_index.shape[0],), dtype=torch.int64, device=q.device)
    if k_scales is not None:
        expect("k_scales", k_scales, shape=(k.shape[0], k.shape[1], None), dtype=torch.int16)
        expect("v_scales", v_scales, shape=tuple(k_scales.shape), dtype=torch.int16)
    # k, v and their scales may lie on q's device or in host memory registered with CUDA (the DRAM
    # cache, read in place over PCIe); torch cannot tell registered memory, so their device is not checked
    num_heads, dim = q.shape
    num_kv, max_selected = hit_index.shape
    if num_heads % num_kv:
        raise ValueError(f"q's {num_heads} heads must be whole groups of hit_index's {num_kv} kv heads")
    quant = k_scales is not None
    ks, vs = (k_scales, v_scales) if quant else (hit_index, hit_index)  # placeholders, never read
    if near is None:  # no device copy: the DRAM tables stand in for one (either branch reads them)
        near = NearPages(hit_valid[0], 1, k, v, ks, vs)
    elif (near.k.shape != k.shape or near.k.stride() != k.stride() or near.k.dtype != k.dtype
          or near.v.stride() != k.stride() or quant and near.k_scales.stride() != k_scales.stride()):
        raise ValueError("the device copy of the pages must be laid out as the DRAM pages")
    merged = torch.empty((num_heads, dim), dtype=torch.float32, device=q.device) if out is None else out
    expect("out", merged, shape=(num_heads, dim), dtype=torch.float32, device=q.device)
    if not merged.is_contiguous():
        raise ValueError("out must be contiguous")
    group = num_heads // num_kv
    rows = max(16, triton.next_power_of_2(group))
    shares = min(SHARES, max(max_selected, 1))
    per_share = -(-max_selected // shares)
    part = torch.empty((num_kv, shares, rows, dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_kv, shares, rows), dtype=torch.float32, device=q.device)
    near_ks, near_vs = (near.k_scales, near.v_scales) if quant else (ks, vs)
    _selected_blocks_attention[(num_kv, shares)](
        q.contiguous(), k, v, ks, vs, near.k, near.v, near_ks, near_vs, near.count, hit_index, hit_valid,
        part, part_lse, group, max_selected, near.num_blocks, scale, k.stride(0), k.stride(1),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        BLOCK=k.shape[1], DIM=dim, ROWS=rows, KEYS=min(KEYS, k.shape[1]), PER_SHARE=per_share, QUANT=quant,
        PRECISION=precision(dim))
    merged_lse = torch.empty(num_heads, dtype=torch.float32, device=q.device)
    base = base() if callable(base) else base
    base_o, base_lse = (base[0].float().contiguous(), base[1].float().contiguous()) if base is not None else (part, part_lse)
    _merge_shares[(num_kv,)](part, part_lse, base_o, base_lse, merged, merged_lse, group,
                             SHARES=shares, ROWS=rows, DIM=dim, BASE=base is not None)
    return merged, merged_lse
