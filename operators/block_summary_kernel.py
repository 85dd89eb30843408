"""A prefill chunk's block summaries in two Triton kernels, for GPUs.

operators/block_summary.py takes the mean, max and min of each block's keys, the attention
that the chunk's last queries give each key (token_importance) and each block's DYNAMIC anchor
(anchor_keys) in about forty torch operations a chunk and layer. On a small model prefill is
bound by the host's launches, and these were a third of them. Here:

1. `_row_stats`: for each of the last queries of each head, the maximum and the sum of the
   exponentials of its causal scores over the chunk's keys (a softmax's normaliser);
2. `_summarize`: per (kv head, block), the mean (written where the caller wants it: the block
   selector's pooled keys), the max and the min of its valid keys, and with queries, the key of
   highest importance (its attention from those queries, the highest over the queries and over
   the heads of the kv head; ties go to the earlier token), which is the block's one DYNAMIC anchor.

The sums are float32 in another order than torch's, so an importance may differ from
token_importance's in the last bits, and a near tie may pick the other token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect

ROWS = 64  # query rows a step of _summarize (the prefill's importance queries: 64)
STAT_ROWS = 16  # query rows a program of _row_stats (more programs, each over every key)
KEYS = 64  # keys a step of _row_stats


@triton.jit
def _scores(q, k, scale, IEEE: tl.constexpr):
    """scale * q @ k^T in float32: IEEE: widened to float32 and multiplied in IEEE precision (no
    TF32), as torch's float32 matmul; else 16-bit inputs on the tensor cores (their products are
    exact in float32, the sums float32)."""
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * scale


@triton.jit(do_not_specialize=["num_k", "num_q"])  # one build for every chunk's lengths
def _row_stats(q_ptr, k_ptr, m_ptr, l_ptr, num_k, num_q, scale, s_q_t, s_q_h, s_k_h,
               HEADS_PER_KV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
               IEEE: tl.constexpr):
    """Program (head h, row tile): m, l of the rows' scores over keys 0 .. their own position
    (query i of num_q sits at key position num_k - num_q + i)."""
    h, tile = tl.program_id(0), tl.program_id(1)
    rows = tile * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    inside = rows < num_q
    q = tl.load(q_ptr + rows[:, None] * s_q_t + h * s_q_h + cols[None, :], mask=inside[:, None], other=0.0)
    kv = h // HEADS_PER_KV
    position = num_k - num_q + rows
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    for j0 in range(0, num_k, KEYS):
        keys = j0 + tl.arange(0, KEYS)
        k = tl.load(k_ptr + kv * s_k_h + keys[:, None] * D + cols[None, :], mask=keys[:, None] < num_k, other=0.0)
        s = _scores(q, k, scale, IEEE)
        s = tl.where(keys[None, :] <= position[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past num_q see nothing
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m = m_new
    tl.store(m_ptr + h * num_q + rows, m, mask=inside)
    tl.store(l_ptr + h * num_q + rows, l, mask=inside)


@triton.jit(do_not_specialize=["num_k", "num_q", "num_blocks"])  # one build for every chunk's lengths
def _summarize(k_ptr, q_ptr, m_ptr, l_ptr, mean_ptr, max_ptr, min_ptr, anchor_ptr, num_k, num_q, scale,
               s_k_h, s_q_t, s_q_h, s_mean_h, s_mean_b, num_blocks,
               HEADS_PER_KV: tl.constexpr, B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
               ANCHOR: tl.constexpr, IEEE: tl.constexpr):
    """Program (kv head, block): the block's mean, max, min and (ANCHOR) its DYNAMIC anchor."""
    kv, b = tl.program_id(0), tl.program_id(1)
    tokens = b * B + tl.arange(0, B)
    cols = tl.arange(0, D)
    valid = tokens < num_k
    k = tl.load(k_ptr + kv * s_k_h + tokens[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
    k32 = k.to(tl.float32)
    count = tl.minimum(num_k - b * B, B).to(tl.float32)
    out = kv * num_blocks * D + b * D + cols
    tl.store(mean_ptr + kv * s_mean_h + b * s_mean_b + cols, tl.sum(k32, 0) / count)
    tl.store(max_ptr + out, tl.max(tl.where(valid[:, None], k32, float("-inf")), 0))
    tl.store(min_ptr + out, tl.min(tl.where(valid[:, None], k32, float("inf")), 0))
    if ANCHOR:
        importance = tl.zeros((B,), tl.float32)
        for g in range(HEADS_PER_KV):
            h = kv * HEADS_PER_KV + g
            for r0 in range(0, num_q, ROWS):
                rows = r0 + tl.arange(0, ROWS)
                inside = rows < num_q
                q = tl.load(q_ptr + rows[:, None] * s_q_t + h * s_q_h + cols[None, :], mask=inside[:, None], other=0.0)
                m = tl.load(m_ptr + h * num_q + rows, mask=inside, other=0.0)
                l = tl.load(l_ptr + h * num_q + rows, mask=inside, other=1.0)
                s = _scores(q, k, scale, IEEE)
                seen = (tokens[None, :] <= (num_k - num_q + rows)[:, None]) & inside[:, None]
                p = tl.where(seen, tl.exp(s - m[:, None]) / l[:, None], 0.0)
                importance = tl.maximum(importance, tl.max(p, 0))
        best = tl.argmax(tl.where(valid, importance, -1.0), 0, tie_break_left=True)
        anchor = tl.sum(tl.where((tl.arange(0, B) == best)[:, None], k32, 0.0), 0)
        tl.store(anchor_ptr + out, anchor)


def kernel_applies(block_size: int, head_dim: int) -> bool:
    """Whether the kernels take these shapes (tl.arange wants powers of two, tl.dot at least 16)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (block_size, head_dim))


def summarize_blocks(k_blocks: torch.Tensor, num_valid: int, mean_out: torch.Tensor, scale: float,
                     q_last: torch.Tensor | None = None):
    """k_blocks: [KV, nb, B, D] (a head-major page range, blocks back to back) holding num_valid
    tokens; mean_out: [KV, nb, D] float32, written in place. q_last: [Tq, H, D], the chunk's last
    Tq queries, which sit at the last Tq key positions: with them, each block's DYNAMIC anchor.
    Returns kmax, kmin [KV, nb, D] and the anchors [KV, nb, 1, D] (None without q_last), float32:
    block_summary.block_summaries, then anchor_keys(..., "DYNAMIC", 1, token_importance(...))."""
    num_kv, num_blocks, block_size, dim = k_blocks.shape
    assert kernel_applies(block_size, dim) and 0 < num_valid <= num_blocks * block_size
    if k_blocks.stride(3) != 1 or k_blocks.stride(2) != dim or k_blocks.stride(1) != block_size * dim:
        raise ValueError("k_blocks must hold each kv head's blocks back to back, rows contiguous")
    expect("mean_out", mean_out, shape=(num_kv, num_blocks, dim), dtype=torch.float32, device=k_blocks.device)
    if mean_out.stride(2) != 1:
        raise ValueError("mean_out's rows must be contiguous")
    ieee = k_blocks.dtype == torch.float32 or not k_blocks.is_cuda  # Triton's interpreter has no 16-bit dot
    kmax = torch.empty((num_kv, num_blocks, dim), dtype=torch.float32, device=k_blocks.device)
    kmin = torch.empty_like(kmax)
    anchors = m = l = None
    num_q, heads_per_kv, q_strides = 0, 1, (0, 0)
    if q_last is not None:
        expect("q_last", q_last, ndim=3, device=k_blocks.device)
        num_q, num_heads = q_last.shape[:2]
        if q_last.shape[2] != dim or q_last.stride(2) != 1 or num_heads % num_kv or num_q > num_valid:
            raise ValueError(f"q_last {tuple(q_last.shape)} must be the last queries of the keys' heads")
        if q_last.dtype != k_blocks.dtype:
            raise ValueError(f"q_last ({q_last.dtype}) and k_blocks ({k_blocks.dtype}) must share a type")
        heads_per_kv, q_strides = num_heads // num_kv, (q_last.stride(0), q_last.stride(1))
        m = torch.empty((num_heads, num_q), dtype=torch.float32, device=k_blocks.device)
        l = torch.empty_like(m)
        anchors = torch.empty((num_kv, num_blocks, 1, dim), dtype=torch.float32, device=k_blocks.device)
        _row_stats[(num_heads, triton.cdiv(num_q, STAT_ROWS))](
            q_last, k_blocks, m, l, num_valid, num_q, scale, *q_strides, k_blocks.stride(0),
            HEADS_PER_KV=heads_per_kv, D=dim, ROWS=STAT_ROWS, KEYS=KEYS, IEEE=ieee)
    _summarize[(num_kv, num_blocks)](
        k_blocks, q_last if q_last is not None else kmax, m if m is not None else kmax, l if l is not None else kmax,
        mean_out, kmax, kmin, anchors if anchors is not None else kmax, num_valid, num_q, scale,
        k_blocks.stride(0), *q_strides, mean_out.stride(0), mean_out.stride(1), num_blocks,
        HEADS_PER_KV=heads_per_kv, B=block_size, D=dim, ROWS=ROWS, ANCHOR=q_last is not None, IEEE=ieee)
    return kmax, kmin, anchors
