"""Decode attention over selected KV blocks in one Triton kernel, for GPUs
(`context_attention: gpu`): the blocks where they lie in pinned DRAM, read over PCIe.

Gathering the selected pages, widening them to float32 and attending with torch ops
(operators/window_attention.attention_over_prefix, the tests' reference) writes the widened pages
to memory and passes over them about twenty times a layer. Here one program takes one kv head's
query group and a share of its selected blocks, reads each block where it lies (bf16, fp16, fp32,
or q8_0 with its scales, widened in registers), and keeps an online softmax. The device's own
window (the sinks and the local window, one buffer of which keys lo..hi-1 count) is cut into
shares the same way by a second kernel, and a third merges every share by log-sum-exp: a global
layer's whole decode attention is three launches, with fixed shapes for CUDA graphs. The
arithmetic is float32 throughout (tl.dot in IEEE precision), as the CPU's operator attends to
the rest of the selection: the two parts must agree to float32 rounding, or a later selection
can flip.

This module needs triton; ktlong/decode/dram_blocks.py imports it when it is asked for.
The CPU's tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect

SHARES = 16  # programs per kv head: a share of its hit blocks each
WINDOW_SHARES = 16  # programs per kv head over the device window: a slice of its buffer each
KEYS = 32  # tokens per tile: a [32, head_dim] float32 tile of K and of V fit in registers (a whole
           # 128-token block spilled: 770 us a call on the H100 at 8B shapes)


@triton.jit
def _selected_blocks_attention(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, index_ptr, valid_ptr, out_ptr, lse_ptr,
                             group, max_selected, scale, total_shares,
                             stride_row, stride_token, stride_srow, stride_stoken,
                             BLOCK: tl.constexpr, DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr, PER_SHARE: tl.constexpr,
                             QUANT: tl.constexpr):
    """Kv head h's query rows (group of them, padded to ROWS) over its hit blocks
    PER_SHARE * s .. PER_SHARE * (s + 1) - 1 that count (valid tokens) -> this share's out [ROWS,
    DIM] (normalised by its own softmax sum) and lse [ROWS], share s of total_shares; 0 and -inf
    where it holds none."""
    h, share = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + (h * group + rows[:, None]) * DIM + dims[None, :], mask=(rows < group)[:, None], other=0.0)
    valid_blocks = tl.load(valid_ptr + h) // BLOCK
    run_max = tl.full((ROWS,), float("-inf"), tl.float32)
    run_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for i in range(0, PER_SHARE):
        b = share * PER_SHARE + i
        if b < valid_blocks:
            row = tl.load(index_ptr + h * max_selected + b)
            for start in range(0, BLOCK, KEYS):  # KEYS tokens at a time: the tiles stay in registers
                tokens = start + tl.arange(0, KEYS)
                at = row * stride_row + tokens[:, None] * stride_token + dims[None, :]
                keys = tl.load(k_ptr + at).to(tl.float32)  # [KEYS, DIM]
                values = tl.load(v_ptr + at).to(tl.float32)
                if QUANT:
                    s_at = row * stride_srow + tokens[:, None] * stride_stoken + dims[None, :] // 32  # a scale per 32
                    keys = keys * tl.load(ks_ptr + s_at).to(tl.float16, bitcast=True).to(tl.float32)
                    values = values * tl.load(vs_ptr + s_at).to(tl.float16, bitcast=True).to(tl.float32)
                logits = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale  # [ROWS, KEYS]
                new_max = tl.maximum(run_max, tl.max(logits, 1))
                correction = tl.exp(run_max - new_max)
                p = tl.exp(logits - new_max[:, None])
                run_sum = run_sum * correction + tl.sum(p, 1)
                acc = acc * correction[:, None] + tl.dot(p, values, input_precision="ieee")
                run_max = new_max
    held = run_sum > 0
    out = tl.where(held[:, None], acc / tl.where(held, run_sum, 1.0)[:, None], 0.0)
    lse = tl.where(held, run_max + tl.log(tl.where(held, run_sum, 1.0)), float("-inf"))
    at = (h * total_shares + share) * ROWS + rows
    tl.store(out_ptr + at[:, None] * DIM + dims[None, :], out)
    tl.store(lse_ptr + at, lse)


@triton.jit
def _window_shares(q_ptr, k_ptr, v_ptr, lo_ptr, hi_ptr, last, out_ptr, lse_ptr, group, scale, total_shares,
                   first_share, stride_head, stride_token,
                   DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr, PER_SHARE: tl.constexpr):
    """Kv head h's query rows over its window buffer's tokens s * PER_SHARE .. (s + 1) *
    PER_SHARE - 1 that lie in lo..hi-1 (the last `last` of them, when last > 0: a sliding-window
    layer's) -> share first_share + s of total_shares, as _selected_blocks_attention writes its
    own. Tiles outside that range are not read."""
    h, s = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + (h * group + rows[:, None]) * DIM + dims[None, :], mask=(rows < group)[:, None], other=0.0)
    lo, hi = tl.load(lo_ptr), tl.load(hi_ptr)
    if last > 0:
        lo = tl.maximum(lo, hi - last)
    run_max = tl.full((ROWS,), float("-inf"), tl.float32)
    run_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for start in range(s * PER_SHARE, (s + 1) * PER_SHARE, KEYS):
        if start + KEYS > lo and start < hi:  # a tile with a valid key: its max is finite
            tokens = start + tl.arange(0, KEYS)
            valid = (tokens >= lo) & (tokens < hi)
            at = h * stride_head + tokens[:, None] * stride_token + dims[None, :]
            keys = tl.load(k_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
            values = tl.load(v_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
            logits = tl.dot(q, tl.trans(keys), input_precision="ieee")
            logits = tl.where(valid[None, :], logits * scale, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(logits, 1))
            correction = tl.exp(run_max - new_max)
            p = tl.exp(logits - new_max[:, None])
            run_sum = run_sum * correction + tl.sum(p, 1)
            acc = acc * correction[:, None] + tl.dot(p, values, input_precision="ieee")
            run_max = new_max
    held = run_sum > 0
    out = tl.where(held[:, None], acc / tl.where(held, run_sum, 1.0)[:, None], 0.0)
    lse = tl.where(held, run_max + tl.log(tl.where(held, run_sum, 1.0)), float("-inf"))
    at = (h * total_shares + first_share + s) * ROWS + rows
    tl.store(out_ptr + at[:, None] * DIM + dims[None, :], out)
    tl.store(lse_ptr + at, lse)


@triton.jit
def _merge_shares(out_ptr, lse_ptr, o_ptr, o_lse_ptr, group,
                  SHARES: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr):
    """Kv head h's shares -> its query rows' out [group, DIM] and lse [group], merged by
    log-sum-exp; 0 and -inf where all are empty."""
    h = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    real = rows < group
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    for share in range(SHARES):
        top = tl.maximum(top, tl.load(lse_ptr + (h * SHARES + share) * ROWS + rows))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for share in range(SHARES):
        w = tl.exp(tl.load(lse_ptr + (h * SHARES + share) * ROWS + rows) - top)
        part = tl.load(out_ptr + ((h * SHARES + share) * ROWS + rows[:, None]) * DIM + dims[None, :])
        total += w
        acc += w[:, None] * part
    held = total > 0
    o = tl.where(held[:, None], acc / tl.where(held, total, 1.0)[:, None], 0.0)
    merged = tl.where(held, top + tl.log(tl.where(held, total, 1.0)), float("-inf"))
    tl.store(o_ptr + (h * group + rows[:, None]) * DIM + dims[None, :], o, mask=real[:, None])
    tl.store(o_lse_ptr + h * group + rows, merged, mask=real)


def kernel_applies(kv_type: str, block_size: int, head_dim: int) -> bool:
    """Formats and shapes the kernel takes: pages stored as values or q8_0 (q4_0 stays on torch),
    power-of-two block and head sizes of at least 16 (tl.dot's smallest tile)."""
    def power_of_two(n):
        return n >= 16 and n & (n - 1) == 0
    return kv_type in ("bf16", "fp16", "fp32", "q8_0") and power_of_two(block_size) and power_of_two(head_dim)


def selected_blocks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scales: torch.Tensor | None,
                              v_scales: torch.Tensor | None, hit_index: torch.Tensor, hit_valid: torch.Tensor,
                              scale: float, window: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, D] float32; k, v: one layer's pages [rows, B, R] (q8_0: int8 with k_scales, v_scales
    [rows, B, D/32] int16 words of float16); hit_index [KV, S] rows of each kv head's hit blocks,
    hit_valid [KV] tokens that count (whole blocks, first ones first) -> out [H, D], lse [H]
    float32 (natural log; -inf and 0 for a head that holds nothing). window: (keys, values [KV,
    N, D] on q's device, lo, hi: 0-dim int64 device tensors), the keys lo..hi-1 of a buffer
    attended as well, in the same softmax. Fixed shapes, no sync."""
    expect("q", q, ndim=2, dtype=torch.float32)
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
    group = num_heads // num_kv
    rows = max(16, triton.next_power_of_2(group))
    shares = min(SHARES, max(max_selected, 1))
    per_share = -(-max_selected // shares)
    total = shares + (WINDOW_SHARES if window is not None else 0)
    out = torch.empty((num_kv, total, rows, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_kv, total, rows), dtype=torch.float32, device=q.device)
    q = q.contiguous()
    quant = k_scales is not None
    ks, vs = (k_scales, v_scales) if quant else (hit_index, hit_index)  # placeholders, never read
    _selected_blocks_attention[(num_kv, shares)](
        q, k, v, ks, vs, hit_index, hit_valid, out, lse,
        group, max_selected, scale, total, k.stride(0), k.stride(1),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        BLOCK=k.shape[1], DIM=dim, ROWS=rows, KEYS=min(KEYS, k.shape[1]), PER_SHARE=per_share, QUANT=quant)
    if window is not None:
        _launch_window(q, *window, 0, out, lse, group, scale, total, shares)
    merged = torch.empty((num_heads, dim), dtype=torch.float32, device=q.device)
    merged_lse = torch.empty(num_heads, dtype=torch.float32, device=q.device)
    _merge_shares[(num_kv,)](out, lse, merged, merged_lse, group, SHARES=total, ROWS=rows, DIM=dim)
    return merged, merged_lse


def window_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     scale: float, last: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, D] over the keys lo..hi-1 of a window buffer (keys, values [KV, N, D]; lo, hi: 0-dim
    int64 device tensors), or over the last `last` of them (> 0: a sliding-window layer) -> out
    [H, D], lse [H] float32, in float32 arithmetic. Two launches, fixed shapes, no sync."""
    expect("q", q, ndim=2, dtype=torch.float32)
    num_heads, dim = q.shape
    num_kv = keys.shape[0]
    if num_heads % num_kv:
        raise ValueError(f"q's {num_heads} heads must be whole groups of the window's {num_kv} kv heads")
    group = num_heads // num_kv
    rows = max(16, triton.next_power_of_2(group))
    out = torch.empty((num_kv, WINDOW_SHARES, rows, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_kv, WINDOW_SHARES, rows), dtype=torch.float32, device=q.device)
    _launch_window(q.contiguous(), keys, values, lo, hi, last, out, lse, group, scale, WINDOW_SHARES, 0)
    merged = torch.empty((num_heads, dim), dtype=torch.float32, device=q.device)
    merged_lse = torch.empty(num_heads, dtype=torch.float32, device=q.device)
    _merge_shares[(num_kv,)](out, lse, merged, merged_lse, group, SHARES=WINDOW_SHARES, ROWS=rows, DIM=dim)
    return merged, merged_lse


def _launch_window(q, keys, values, lo, hi, last, out, lse, group, scale, total, first):
    """The window's shares into slots first.. of out and lse (total slots a kv head)."""
    num_kv, dim = keys.shape[0], q.shape[1]
    expect("window keys", keys, shape=(num_kv, None, dim), device=q.device)
    expect("window values", values, shape=tuple(keys.shape), dtype=keys.dtype, device=q.device)
    if keys.stride(2) != 1 or values.stride() != keys.stride():
        raise ValueError("the window's keys and values must share one layout with contiguous rows")
    per_share = -(-keys.shape[1] // (WINDOW_SHARES * KEYS)) * KEYS
    _window_shares[(num_kv, WINDOW_SHARES)](
        q, keys, values, lo, hi, last, out, lse, group, scale, total, first, keys.stride(0), keys.stride(1),
        DIM=dim, ROWS=out.shape[2], KEYS=KEYS, PER_SHARE=per_share)
