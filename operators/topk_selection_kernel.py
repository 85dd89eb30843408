"""CompactAttention's topk selection in three Triton kernels and one top-k, for GPUs.

operators/block_selector.py's topk_group_blocks followed by block_union.fixed_page_indices is about
twenty small operations a chunk and layer (pooling, the score product, row maxima, margins, the
group maxima, the sink and window slices, the page arithmetic). On a small model their fixed
cost is a fifth of the attention they save. Here:

1. the query blocks' means, one reduction in torch ([nqb, H, D] float32, read through strides);
2. `_row_best`: each (head, query block) row's best score over a stretch of the history blocks
   (and, to rank by mass, the row's sum of exp(score - best) there);
3. `_group_margin`: each execution group's best margin (score minus its row's best) per history
   block, or with MASS its mean share of the rows' softmax (block_selector.group_mass), with the
   sinks and the window at +inf, so top-k always takes them;
4. torch.topk;
5. `_page_indices`: each group's page list, its kept blocks then the chunk's own blocks.

Scores are float32 products in IEEE precision, as torch's float32 matmul computes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect

BEST_ROWS = 16  # query-block rows a program of _row_best scores (small tiles: more programs, shorter loops)
MARGIN_ROWS = 16  # query-block rows _group_margin scores a step (larger tiles measured slower on an H100)
BLOCKS = 64  # history blocks a program of _row_best scores a step
SPLIT = 512  # history blocks a program of _row_best covers: at 1M tokens (8,192 blocks) 16 programs a row tile
MARGIN_BLOCKS = 64  # history blocks a program of _group_margin scores
SPAN = 256  # page indices a program of _page_indices writes a step (fixed: one build for every length)


@triton.jit(do_not_specialize=["num_qb", "num_hist"])  # one build for every chunk's lengths
def _row_best(pq_ptr, pk_ptr, best_ptr, total_ptr, num_qb, num_hist, scale, s_pq_b, s_pq_h, s_pk_h, s_pk_b,
              HEADS_PER_KV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
              SPLIT: tl.constexpr, MASS: tl.constexpr):
    """Program (head h, row tile, split s): best[s, h, rows] = max over the history blocks
    s * SPLIT .. (s + 1) * SPLIT of scale * pq[rows, h] . pk[kv(h), j]; with MASS, total[s, h,
    rows] = the sum over those blocks of exp(score - best[s, h, rows])."""
    h, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads = tl.num_programs(0)
    rows = tile * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    pq = tl.load(pq_ptr + rows[:, None] * s_pq_b + h * s_pq_h + cols[None, :], mask=rows[:, None] < num_qb, other=0.0)
    kv = h // HEADS_PER_KV
    best = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    for j0 in range(split * SPLIT, tl.minimum((split + 1) * SPLIT, num_hist), BLOCKS):
        blocks = j0 + tl.arange(0, BLOCKS)
        pk = tl.load(pk_ptr + kv * s_pk_h + blocks[:, None] * s_pk_b + cols[None, :],
                     mask=blocks[:, None] < num_hist, other=0.0)
        s = tl.dot(pq, tl.trans(pk), input_precision="ieee") * scale
        s = tl.where(blocks[None, :] < num_hist, s, float("-inf"))
        now = tl.maximum(best, tl.max(s, 1))
        if MASS:  # every stretch holds a block, so now is finite
            total = total * tl.exp(best - now) + tl.sum(tl.exp(s - now[:, None]), 1)
        best = now
    at = (split * num_heads + h) * num_qb + rows
    tl.store(best_ptr + at, best, mask=rows < num_qb)
    if MASS:
        tl.store(total_ptr + at, total, mask=rows < num_qb)


@triton.jit(do_not_specialize=["num_qb", "num_hist", "num_splits", "sink_blocks", "window_blocks"])
def _group_margin(pq_ptr, pk_ptr, best_ptr, total_ptr, out_ptr, num_qb, num_hist, num_splits, num_heads, scale,
                  sink_blocks, window_blocks, s_pq_b, s_pq_h, s_pk_h, s_pk_b, GROUP: tl.constexpr,
                  HEADS_PER_KV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
                  MASS: tl.constexpr):
    """Program (group g, block tile): out[g, blocks] = max over the group's rows of (score - the
    row's best, the maximum of _row_best's splits); with MASS, the mean over the group's rows of
    exp(score - best) / the row's total (its softmax); the sinks and the window +inf."""
    g, tile = tl.program_id(0), tl.program_id(1)
    blocks = tile * BLOCKS + tl.arange(0, BLOCKS)
    cols = tl.arange(0, D)
    real = blocks < num_hist
    kv = (g * GROUP) // HEADS_PER_KV
    pk = tl.load(pk_ptr + kv * s_pk_h + blocks[:, None] * s_pk_b + cols[None, :], mask=real[:, None], other=0.0)
    if MASS:
        margin = tl.zeros((BLOCKS,), tl.float32)
    else:
        margin = tl.full((BLOCKS,), float("-inf"), tl.float32)
    for i in range(GROUP):
        h = g * GROUP + i
        for r0 in range(0, num_qb, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            inside = rows < num_qb
            pq = tl.load(pq_ptr + rows[:, None] * s_pq_b + h * s_pq_h + cols[None, :], mask=inside[:, None], other=0.0)
            best = tl.full((ROWS,), float("-inf"), tl.float32)
            for split in range(num_splits):
                best = tl.maximum(best, tl.load(best_ptr + (split * num_heads + h) * num_qb + rows, mask=inside,
                                                other=0.0))
            s = tl.dot(pq, tl.trans(pk), input_precision="ieee") * scale - best[:, None]
            if MASS:
                total = tl.zeros((ROWS,), tl.float32)
                for split in range(num_splits):  # each split's sum, rescaled to the row's best
                    at = (split * num_heads + h) * num_qb + rows
                    total += tl.load(total_ptr + at, mask=inside, other=0.0) * tl.exp(
                        tl.load(best_ptr + at, mask=inside, other=0.0) - best)
                share = tl.exp(s) / tl.where(inside, total, 1.0)[:, None]
                margin += tl.sum(tl.where(inside[:, None] & real[None, :], share, 0.0), 0)
            else:
                s = tl.where(inside[:, None], s, float("-inf"))
                margin = tl.maximum(margin, tl.max(s, 0))
    if MASS:
        margin = margin / (GROUP * num_qb)
    always = (blocks < sink_blocks) | (blocks >= num_hist - window_blocks)
    margin = tl.where(always, float("inf"), margin)
    tl.store(out_ptr + g * num_hist + blocks, margin, mask=real)


@triton.jit(do_not_specialize=["num_keep", "chunk_first_block", "chunk_blocks"])
def _page_indices(ids_ptr, out_ptr, num_keep, chunk_first_block, chunk_blocks, blocks_per_head,
                  GROUPS_PER_KV: tl.constexpr, SPAN: tl.constexpr):
    """Program g: out[g] = kv(g) * blocks_per_head + [the kept ids..., the chunk's blocks...] (int32)."""
    g = tl.program_id(0)
    base = (g // GROUPS_PER_KV) * blocks_per_head
    per_group = num_keep + chunk_blocks
    for c0 in range(0, per_group, SPAN):
        cols = c0 + tl.arange(0, SPAN)
        kept = cols < num_keep
        ids = tl.load(ids_ptr + g * num_keep + cols, mask=kept, other=0)
        block = tl.where(kept, ids, chunk_first_block + cols - num_keep)
        tl.store(out_ptr + g * per_group + cols, (base + block).to(tl.int32), mask=cols < per_group)


def pooled_query_blocks(q: torch.Tensor, block_size: int) -> torch.Tensor:
    """q [T, H, D] -> [ceil(T / block_size), H, D] float32 means (the last block may be partial)."""
    num_q = q.shape[0]
    full = num_q // block_size
    if full * block_size == num_q:
        return q.view(full, block_size, *q.shape[1:]).mean(1, dtype=torch.float32)
    tail = q[full * block_size:].mean(0, keepdim=True, dtype=torch.float32)
    if not full:
        return tail
    return torch.cat([q[:full * block_size].view(full, block_size, *q.shape[1:]).mean(1, dtype=torch.float32), tail])


def group_margins(q: torch.Tensor, pooled_keys: torch.Tensor, num_hist: int, block_size: int, scale: float,
                  group_size: int, sink_blocks: int, window_blocks: int, rank: str = "margin") -> torch.Tensor:
    """q [T, H, D]; pooled_keys [KV, >= num_hist, D] float32 -> [H / group_size, num_hist] float32:
    each group's best margin per history block (rank "margin": block_selector.group_margin) or its
    mean softmax share ("mass": block_selector.group_mass), the sinks and the window +inf (what
    block_selector.topk_group_blocks ranks)."""
    expect("q", q, ndim=3)
    expect("pooled_keys", pooled_keys, ndim=3, dtype=torch.float32, device=q.device)
    num_heads, dim = q.shape[1], q.shape[2]
    num_kv = pooled_keys.shape[0]
    if pooled_keys.shape[2] != dim or pooled_keys.stride(2) != 1 or pooled_keys.shape[1] < num_hist:
        raise ValueError(f"pooled_keys {tuple(pooled_keys.shape)} must hold {num_hist} blocks of q's head_dim {dim}, "
                         "each row contiguous")
    if dim < 16 or dim & (dim - 1) or num_heads % num_kv or num_heads % group_size:
        raise ValueError(f"q's {num_heads} heads of {dim} must be whole groups of {num_kv} kv heads and of "
                         f"{group_size}, head_dim a power of two of at least 16")
    pq = pooled_query_blocks(q, block_size)  # [nqb, H, D]
    num_qb = pq.shape[0]
    heads_per_kv = num_heads // num_kv
    strides = (pq.stride(0), pq.stride(1), pooled_keys.stride(0), pooled_keys.stride(1))
    num_splits = triton.cdiv(num_hist, SPLIT)
    mass = {"margin": False, "mass": True}[rank]
    best = torch.empty((2 if mass else 1, num_splits, num_heads, num_qb), dtype=torch.float32, device=q.device)
    _row_best[(num_heads, triton.cdiv(num_qb, BEST_ROWS), num_splits)](
        pq, pooled_keys, best[0], best[-1], num_qb, num_hist, scale, *strides,
        HEADS_PER_KV=heads_per_kv, D=dim, ROWS=BEST_ROWS, BLOCKS=BLOCKS, SPLIT=SPLIT, MASS=mass)
    out = torch.empty((num_heads // group_size, num_hist), dtype=torch.float32, device=q.device)
    _group_margin[(out.shape[0], triton.cdiv(num_hist, MARGIN_BLOCKS))](
        pq, pooled_keys, best[0], best[-1], out, num_qb, num_hist, num_splits, num_heads, scale, sink_blocks,
        window_blocks, *strides,
        GROUP=group_size, HEADS_PER_KV=heads_per_kv, D=dim, ROWS=MARGIN_ROWS, BLOCKS=MARGIN_BLOCKS, MASS=mass)
    return out


def topk_page_indices(q: torch.Tensor, pooled_keys: torch.Tensor, num_hist: int, block_size: int, scale: float,
                      num_keep: int, group_size: int, sink_blocks: int, window_blocks: int, num_kv_heads: int,
                      blocks_per_head: int, chunk_tokens: int, out: torch.Tensor | None = None,
                      rank: str = "margin") -> torch.Tensor:
    """The int32 page indices of block_union.fixed_page_lists for the blocks topk_group_blocks
    keeps: each group's num_keep best history blocks by rank (in no particular order), then the
    chunk's blocks. out: an int32 tensor of G * (num_keep + chunk blocks) to write them into."""
    margins = group_margins(q, pooled_keys, num_hist, block_size, scale, group_size, sink_blocks, window_blocks,
                            rank)
    ids = margins.topk(num_keep, dim=1, sorted=False).indices.contiguous()  # [G, num_keep] int64
    num_groups = margins.shape[0]
    chunk_blocks = -(-chunk_tokens // block_size)
    per_group = num_keep + chunk_blocks
    if out is None:
        out = torch.empty(num_groups * per_group, dtype=torch.int32, device=q.device)
    assert out.dtype == torch.int32 and out.numel() == num_groups * per_group and out.is_contiguous()
    _page_indices[(num_groups,)](ids, out, num_keep, num_hist, chunk_blocks, blocks_per_head,
                                 GROUPS_PER_KV=num_groups // num_kv_heads, SPAN=SPAN)
    return out
