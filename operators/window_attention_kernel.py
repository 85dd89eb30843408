"""A decode query over the device window (sinks and local window) in three Triton kernels, for
GPUs: the CUDA-graph path's masked_window_attention (operators/window_attention.py) is about
seventeen kernels a global layer (the mask's four, two batched products with their casts, the
scale, the fill, logsumexp's five, the probabilities' three), 540 nodes of a token's graph at 8B
shapes.

It rounds where the torch version rounds, so the two agree to the order of float32 sums:
- each logit q . k is summed in float32 and rounded to bfloat16 (the product's output type), then
  scaled in float32; keys outside lo..hi-1 are -inf;
- lse is the log-sum-exp of those logits over the whole window, in float32;
- each probability exp(logit - lse) is rounded to bfloat16, the products p . v summed in float32
  and the result rounded to bfloat16 once more.
The probabilities need the final lse before they are rounded, so the work is split: (1) logits
and each key range's max and sum of exponentials, a program per kv head and range; (2) lse
from all ranges, then each range's share of p . v, a program per kv head and range; (3) the
shares summed and rounded, a program per query row. Each kernel is one launch for a batch of
conversations, each member's window buffers found by their offsets from the first member's
(member_offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.member_tables import device_table, gaps
from operators.narrow import narrow

KEYS = 64  # keys per tile: [KEYS, head_dim] of K or V in registers
TILES = 4  # tiles per program: a program takes KEYS * TILES keys of one kv head
ALIGN = 16  # members' buffers lie whole multiples of 16 elements apart, counted in these units: a
            # pointer moved by a loaded count of them keeps its alignment, and the loads their
            # vector width (moved by a count of elements, every load was one element wide: the
            # batch's window parts took 7 ms a step at 8B shapes, 128K, batch 8, on the H200)


@triton.jit
def _logits(q_ptr, k_ptr, members_ptr, lo_ptr, hi_ptr, logits_ptr, max_ptr, sum_ptr, n, group, last, scale,
            stride_head, stride_key, ROWS: tl.constexpr, DIM: tl.constexpr, KEYS: tl.constexpr, TILES: tl.constexpr):
    """Member b's kv head h, keys KEYS * TILES * r ..: its group's logits [B, H, n] float32 and the
    range's max and sum of exp(logit - max) at [b, h, r, row in group]. A program reads its keys
    once for the whole group (a program per query row read each key `group` times: 72 us a layer
    at batch 8, 128K, 8B shapes, on the H200). Each logit is a float32 sum of exact products
    (bfloat16 values are exact in TF32)."""
    h, r, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv, parts = tl.num_programs(0), tl.num_programs(1)
    k_ptr += tl.load(members_ptr + 2 * b) * 16  # member b's keys, from member 0's (ALIGN units)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    real = rows < group
    head_rows = (b * num_kv + h) * group + rows  # this group's query rows among the batch's
    q = tl.load(q_ptr + head_rows[:, None] * DIM + dims[None, :], mask=real[:, None], other=0.0).to(tl.float32)
    lo, hi = tl.load(lo_ptr + b), tl.load(hi_ptr + b)
    if last > 0:  # a sliding layer: its last keys only
        lo = tl.maximum(lo, hi - last)
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    for t in range(TILES):
        keys = (r * TILES + t) * KEYS + tl.arange(0, KEYS)
        inside = keys < n
        k = tl.load(k_ptr + h * stride_head + keys[:, None] * stride_key + dims[None, :], mask=inside[:, None],
                    other=0.0).to(tl.float32)
        s = narrow(tl.dot(q, tl.trans(k), input_precision="tf32"), tl.bfloat16) * scale  # [ROWS, KEYS]
        s = tl.where(((keys >= lo) & (keys < hi))[None, :], s, float("-inf"))
        tl.store(logits_ptr + head_rows[:, None] * n + keys[None, :], s, mask=real[:, None] & inside[None, :])
        new_top = tl.maximum(top, tl.max(s, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
        top = new_top
    at = ((b * num_kv + h) * parts + r) * ROWS + rows
    tl.store(max_ptr + at, top, mask=real)
    tl.store(sum_ptr + at, total, mask=real)


@triton.jit
def _values(v_ptr, members_ptr, logits_ptr, max_ptr, sum_ptr, share_ptr, lse_ptr, n, group, stride_head, stride_key,
            parts, ROWS: tl.constexpr, DIM: tl.constexpr, KEYS: tl.constexpr, TILES: tl.constexpr,
            PARTS: tl.constexpr):
    """Member b's kv head h, range r: lse over every range, then this range's sum of p . v (p
    rounded to the window's type) -> share [B, KV, PARTS, ROWS, DIM] float32; range 0 also stores lse."""
    h, r, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv = tl.num_programs(0)
    v_ptr += tl.load(members_ptr + 2 * b + 1) * 16  # member b's values, from member 0's (ALIGN units)
    head = b * num_kv + h  # this member's kv head among the batch's
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    real = rows < group
    ranges = tl.arange(0, PARTS)  # parts, rounded up to a power of two
    at = (head * parts + ranges[None, :]) * ROWS + rows[:, None]  # [ROWS, PARTS]; rows past group never written
    held = real[:, None] & (ranges < parts)[None, :]
    tops = tl.load(max_ptr + at, mask=held, other=float("-inf"))
    top = tl.max(tops, 1)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.load(sum_ptr + at, mask=held, other=0.0) * tl.exp(tops - shift[:, None]), 1)
    lse = tl.where(real, shift + tl.log(tl.where(real, total, 1.0)), 0.0)  # padded rows: p = 0
    if r == 0:
        tl.store(lse_ptr + head * group + rows, lse, mask=real)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for t in range(TILES):
        keys = (r * TILES + t) * KEYS + tl.arange(0, KEYS)
        inside = keys < n
        s = tl.load(logits_ptr + (head * group + rows[:, None]) * n + keys[None, :],
                    mask=real[:, None] & inside[None, :], other=float("-inf"))
        p = narrow(tl.exp(s - lse[:, None]), tl.bfloat16)
        v = tl.load(v_ptr + h * stride_head + keys[:, None] * stride_key + dims[None, :], mask=inside[:, None],
                    other=0.0).to(tl.float32)
        acc += tl.dot(p, v, input_precision="tf32")  # bfloat16 values are exact in TF32: exact products
    tl.store(share_ptr + ((head * parts + r) * ROWS + rows[:, None]) * DIM + dims[None, :], acc)


@triton.jit
def _sum_shares(share_ptr, out_ptr, group, parts, ROWS: tl.constexpr, DIM: tl.constexpr, PARTS: tl.constexpr):
    """Member b's kv head h's query row g: its shares summed, rounded to bfloat16 -> out [B, H, DIM]
    float32. Every share in one load (a loop over them waited on each load in turn: 18 us a layer
    at batch 8, 128K, 8B shapes, on the H200)."""
    head, g = tl.program_id(0), tl.program_id(1)  # member b's kv head h among the batch's; a row of its group
    ranges = tl.arange(0, PARTS)  # parts, rounded up to a power of two
    dims = tl.arange(0, DIM)
    shares = tl.load(share_ptr + ((head * parts + ranges[:, None]) * ROWS + g) * DIM + dims[None, :],
                     mask=(ranges < parts)[:, None], other=0.0)
    tl.store(out_ptr + (head * group + g) * DIM + dims, narrow(tl.sum(shares, 0), tl.bfloat16))


def kernel_applies(dtype: torch.dtype, head_dim: int) -> bool:
    """Windows in bfloat16 (float16 ones keep the torch ops) with a power-of-two head_dim of at
    least 16 (tl.dot's tile)."""
    return dtype == torch.bfloat16 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def member_offsets(keys: list[torch.Tensor], values: list[torch.Tensor], at: tuple | None = None) -> torch.Tensor:
    """[B, 2] int64 on the members' device: where each member's keys and values lie, in units of
    ALIGN elements from member 0's, or from the tensors `at` (keys', values'; window_attention's
    `at`) when given (window_attention's `members`; made outside any graph capture)."""
    for name, t in (("keys", keys), ("values", values)):
        for x in t:
            expect(name, x, shape=tuple(keys[0].shape), dtype=keys[0].dtype, device=keys[0].device)
            if x.stride() != keys[0].stride():
                raise ValueError("every member's keys and values must share strides")
    base = (None, None) if at is None else (at[0].data_ptr(), at[1].data_ptr())
    return device_table([gaps(keys, ALIGN, "the window's keys", base[0]),
                         gaps(values, ALIGN, "the window's values", base[1])], keys[0].device)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, members: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor, scale: float, last: int = 0, out: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None, at: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's queries q [B, H, D], member b's over its window buffer (bfloat16 [KV, N, D] like
    member 0's k and v, at members[b] ALIGN units from them: member_offsets), of which keys
    lo[b]..hi[b]-1 count ([B] int64 device tensors; with last > 0 only the last `last` of them)
    -> out [B, H, D], lse [B, H] float32, as masked_window_attention gives each member's, into
    `out` and `lse` when given (contiguous float32). at: the tensors the offsets count from (k's,
    v's: a batch's bases, member_tables.Bases), in place of k and v. One launch of each kernel
    for the batch; fixed shapes, no sync."""
    expect("k", k, ndim=3, dtype=torch.bfloat16)
    num_kv, n, dim = k.shape
    expect("v", v, shape=tuple(k.shape), dtype=k.dtype, device=k.device)
    expect("q", q, ndim=3, device=k.device)
    batch, num_heads = q.shape[:2]
    expect("q", q, shape=(batch, num_heads, dim))
    expect("members", members, shape=(batch, 2), dtype=torch.int64, device=k.device)
    expect("lo", lo, shape=(batch,), dtype=torch.int64, device=k.device)
    expect("hi", hi, shape=(batch,), dtype=torch.int64, device=k.device)
    if k.stride(2) != 1 or v.stride() != k.stride():
        raise ValueError("k and v must share strides, with contiguous rows")
    if num_heads % num_kv:
        raise ValueError(f"q's {num_heads} heads must be whole groups of k's {num_kv} kv heads")
    group = num_heads // num_kv
    rows = max(16, triton.next_power_of_2(group))
    parts = triton.cdiv(max(n, 1), KEYS * TILES)
    device = q.device
    logits = torch.empty((batch, num_heads, n), dtype=torch.float32, device=device)
    tops = torch.empty((batch, num_kv, parts, rows), dtype=torch.float32, device=device)
    sums = torch.empty((batch, num_kv, parts, rows), dtype=torch.float32, device=device)
    share = torch.empty((batch, num_kv, parts, rows, dim), dtype=torch.float32, device=device)
    out = torch.empty((batch, num_heads, dim), dtype=torch.float32, device=device) if out is None else out
    lse = torch.empty((batch, num_heads), dtype=torch.float32, device=device) if lse is None else lse
    expect("out", out, shape=(batch, num_heads, dim), dtype=torch.float32, device=device)
    expect("lse", lse, shape=(batch, num_heads), dtype=torch.float32, device=device)
    if not (out.is_contiguous() and lse.is_contiguous()):
        raise ValueError("out and lse must be contiguous")
    q = q.to(k.dtype).contiguous()
    k_at, v_at = at or (k, v)
    _logits[(num_kv, parts, batch)](q, k_at, members, lo, hi, logits, tops, sums, n, group, last, scale, k.stride(0),
                                       k.stride(1), ROWS=rows, DIM=dim, KEYS=KEYS, TILES=TILES)
    _values[(num_kv, parts, batch)](v_at, members, logits, tops, sums, share, lse, n, group, k.stride(0), k.stride(1),
                                    parts, ROWS=rows, DIM=dim, KEYS=KEYS, TILES=TILES,
                                    PARTS=triton.next_power_of_2(parts))
    _sum_shares[(batch * num_kv, group)](share, out, group, parts, ROWS=rows, DIM=dim,
                                         PARTS=triton.next_power_of_2(parts))
    return out, lse
