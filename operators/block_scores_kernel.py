"""Decode block scores for device selection in one Triton kernel, for GPUs: each block's anchor
against the query, summed over a shared selection's kv heads, with the selection's mask added
(ktlong/decode/device_selection.py), read straight from the bfloat16 anchors.

operators/block_scores.py widens the anchors to float32 before its matrix product: at 1M tokens
(8,192 blocks of 128) that copy is 33 MB written and read again per layer, a quarter of a
millisecond a layer more than reading the 17 MB of anchors once; then the mask takes three more
kernels. The scores are the same linear forms (one anchor: (sum_g q_g) . a; QUEST: (sum_g q_g+) .
max + (sum_g q_g-) . min), here a [KV, W] float32 vector (block_scores.query_vectors) against
anchors viewed [KV, NB, W].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect

BLOCKS = 32  # blocks a program scores


@triton.jit
def _masked_scores(vec_ptr, anchors_ptr, bias_ptr, params_ptr, out_ptr, num_blocks, selected,
                   NUM_KV: tl.constexpr, W: tl.constexpr, SHARED: tl.constexpr, BLOCKS: tl.constexpr):
    """Blocks BLOCKS * pid .. of every kv head -> out [1 or KV, NB]: score + bias where the
    context holds more blocks than are selected, -inf outside [first, last)."""
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    cols = tl.arange(0, W)
    real = blocks < num_blocks
    first, last = tl.load(params_ptr), tl.load(params_ptr + 1)
    crowded = (last - first) > selected
    inside = (blocks >= first) & (blocks < last)
    total = tl.zeros((BLOCKS,), tl.float32)
    for h in range(NUM_KV):
        vec = tl.load(vec_ptr + h * W + cols)
        a = tl.load(anchors_ptr + (h * num_blocks + blocks[:, None]) * W + cols[None, :], mask=real[:, None], other=0.0)
        score = tl.sum(a.to(tl.float32) * vec[None, :], 1)
        if SHARED:
            total += score
        else:
            bias = tl.load(bias_ptr + h * num_blocks + blocks, mask=real, other=0.0)
            score = tl.where(inside, score + tl.where(crowded, bias, 0.0), float("-inf"))
            tl.store(out_ptr + h * num_blocks + blocks, score, mask=real)
    if SHARED:
        bias = tl.load(bias_ptr + blocks, mask=real, other=0.0)
        total = tl.where(inside, total + tl.where(crowded, bias, 0.0), float("-inf"))
        tl.store(out_ptr + blocks, total, mask=real)


def masked_block_scores(vec: torch.Tensor, anchors: torch.Tensor, bias: torch.Tensor, params: torch.Tensor,
                        selected: int, shared: bool) -> torch.Tensor:
    """vec [KV, W] float32; anchors [KV, NB, W] bfloat16 (contiguous); bias [1 or KV, NB] float32
    (0, or -inf for a block preselection left out); params: device int64 [first, last, ...] ->
    scores float32 [1 if shared else KV, NB]. Fixed shapes, no sync."""
    expect("anchors", anchors, ndim=3, dtype=torch.bfloat16)
    num_kv, num_blocks, width = anchors.shape
    expect("vec", vec, shape=(num_kv, width), dtype=torch.float32, device=anchors.device)
    expect("bias", bias, shape=(1 if shared else num_kv, num_blocks), dtype=torch.float32, device=anchors.device)
    expect("params", params, ndim=1, dtype=torch.int64, device=anchors.device)
    if not anchors.is_contiguous():
        raise ValueError("anchors must be contiguous")
    out = torch.empty((1 if shared else num_kv, num_blocks), dtype=torch.float32, device=vec.device)
    _masked_scores[(triton.cdiv(num_blocks, BLOCKS),)](vec.contiguous(), anchors, bias, params, out, num_blocks,
                                                       selected, NUM_KV=num_kv, W=width, SHARED=shared, BLOCKS=BLOCKS)
    return out


def kernel_applies(anchors_per_block: int, quest: bool, head_dim: int) -> bool:
    """Linear scores only (one anchor, or QUEST's pair), over a power-of-two row."""
    width = head_dim * (2 if quest else 1)
    return (quest or anchors_per_block == 1) and width >= 16 and width & (width - 1) == 0
