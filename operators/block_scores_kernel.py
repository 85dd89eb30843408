"""Decode block scores for device selection in one Triton kernel, for GPUs: each block's anchor
against the query, summed over a shared selection's kv heads, with the selection's mask added
(ktlong/decode/device_selection.py), read straight from the bfloat16 anchors.

operators/block_scores.py widens the anchors to float32 before its matrix product: at 1M tokens
(8,192 blocks of 128) that copy is 33 MB written and read again per layer, a quarter of a
millisecond a layer more than reading the 17 MB of anchors once; then the mask takes three more
kernels. The scores are the same linear forms (one anchor: (sum_g q_g) . a; QUEST: (sum_g q_g+) .
max + (sum_g q_g-) . min): each kv head's [W] float32 vector (block_scores.query_vectors'),
summed from q in the kernel, against anchors viewed [KV, NB, W].

`selection_rows` turns torch.topk's result into the rows and token counts the selected blocks'
kernel reads, in one kernel instead of about eight torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect

BLOCKS = 32  # blocks a program scores


@triton.jit
def _masked_scores(q_ptr, anchors_ptr, bias_ptr, params_ptr, out_ptr, num_blocks, selected, group,
                   NUM_KV: tl.constexpr, W: tl.constexpr, DIM: tl.constexpr, QUEST: tl.constexpr,
                   SHARED: tl.constexpr, BLOCKS: tl.constexpr):
    """Blocks BLOCKS * pid .. of every kv head -> out [1 or KV, NB]: score + bias where the
    context holds more blocks than are selected, -inf outside [first, last). Each kv head's
    vector is block_scores.query_vectors' (its query rows of q [H, DIM] summed in float32, one
    after another; QUEST: the negative parts', then the positive parts')."""
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    cols = tl.arange(0, W)
    real = blocks < num_blocks
    first, last = tl.load(params_ptr), tl.load(params_ptr + 1)
    crowded = (last - first) > selected
    inside = (blocks >= first) & (blocks < last)
    total = tl.zeros((BLOCKS,), tl.float32)
    for h in range(NUM_KV):
        vec = tl.zeros((W,), tl.float32)
        for g in range(group):
            x = tl.load(q_ptr + (h * group + g) * DIM + cols % DIM).to(tl.float32)
            if QUEST:  # paired with (min, max): the negative part, then the positive
                x = tl.where(cols < DIM, tl.minimum(x, 0.0), tl.maximum(x, 0.0))
            vec += x
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


def masked_block_scores(q: torch.Tensor, anchors: torch.Tensor, bias: torch.Tensor, params: torch.Tensor,
                        selected: int, shared: bool, quest: bool) -> torch.Tensor:
    """q [H, D]; anchors [KV, NB, W] bfloat16 (contiguous; W = D, or 2 D for QUEST's (min, max));
    bias [1 or KV, NB] float32 (0, or -inf for a block preselection left out); params: device
    int64 [first, last, ...] -> scores float32 [1 if shared else KV, NB]. Fixed shapes, no sync."""
    expect("anchors", anchors, ndim=3, dtype=torch.bfloat16)
    num_kv, num_blocks, width = anchors.shape
    expect("q", q, ndim=2, device=anchors.device)
    num_heads, dim = q.shape
    if width != dim * (2 if quest else 1) or num_heads % num_kv:
        raise ValueError(f"anchors {tuple(anchors.shape)} do not fit q {tuple(q.shape)}{' (QUEST)' if quest else ''}")
    expect("bias", bias, shape=(1 if shared else num_kv, num_blocks), dtype=torch.float32, device=anchors.device)
    expect("params", params, ndim=1, dtype=torch.int64, device=anchors.device)
    if not anchors.is_contiguous():
        raise ValueError("anchors must be contiguous")
    out = torch.empty((1 if shared else num_kv, num_blocks), dtype=torch.float32, device=q.device)
    _masked_scores[(triton.cdiv(num_blocks, BLOCKS),)](q.contiguous(), anchors, bias, params, out, num_blocks,
                                                       selected, num_heads // num_kv, NUM_KV=num_kv, W=width, DIM=dim,
                                                       QUEST=quest, SHARED=shared, BLOCKS=BLOCKS)
    return out


@triton.jit
def _selection_rows(top_ptr, picked_ptr, params_ptr, index_ptr, valid_ptr, num_blocks, block_size,
                    PLACES: tl.constexpr, WIDTH: tl.constexpr, SHARED: tl.constexpr):
    """Kv head h: on a step that selects (params[2]), its page rows h * NB + picked and the tokens
    that count (the finite scores among the top, times block_size); otherwise the rows stay."""
    h = tl.program_id(0)
    if tl.load(params_ptr + 2) != 0:
        r = 0 if SHARED else h
        places = tl.arange(0, WIDTH)
        inside = places < PLACES
        top = tl.load(top_ptr + r * PLACES + places, mask=inside, other=float("-inf"))
        picked = tl.load(picked_ptr + r * PLACES + places, mask=inside, other=0)
        tl.store(index_ptr + h * PLACES + places, h * num_blocks + picked, mask=inside)
        tl.store(valid_ptr + h, tl.sum((top > float("-inf")).to(tl.int64), 0) * block_size)


def selection_rows(top: torch.Tensor, picked: torch.Tensor, params: torch.Tensor, index: torch.Tensor,
                   valid: torch.Tensor, num_blocks: int, block_size: int):
    """torch.topk's (top, picked) [1 or KV, P] -> index [KV, P] (page rows of the head-major DRAM
    table) and valid [KV] (tokens that count), written in place when params[2] (the step selects
    afresh) is set, kept otherwise. Fixed shapes, no sync."""
    num_kv, places = index.shape
    expect("top", top, ndim=2, dtype=torch.float32)
    expect("picked", picked, shape=tuple(top.shape), dtype=torch.int64, device=top.device)
    expect("index", index, shape=(None, top.shape[1]), dtype=torch.int64, device=top.device)
    expect("valid", valid, shape=(num_kv,), dtype=torch.int64, device=top.device)
    if top.shape[0] not in (1, num_kv) or not index.is_contiguous():
        raise ValueError(f"top {tuple(top.shape)} must hold one row or one per kv head of a contiguous index")
    _selection_rows[(num_kv,)](top.contiguous(), picked.contiguous(), params, index, valid, num_blocks, block_size,
                               PLACES=places, WIDTH=triton.next_power_of_2(places), SHARED=top.shape[0] == 1)


def kernel_applies(anchors_per_block: int, quest: bool, head_dim: int) -> bool:
    """Linear scores only (one anchor, or QUEST's pair), over a power-of-two row."""
    width = head_dim * (2 if quest else 1)
    return (quest or anchors_per_block == 1) and width >= 16 and width & (width - 1) == 0
