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

Both take a batch of conversations in one launch (ktlong/decode/device_selection.select_batch):
each member's tables (its anchors, of its own length, its mask, its step's parameters, its
rows) are found by their offsets from the first member's, so that a step's selections are three
launches a layer (with the top-k's), not three for each conversation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.member_tables import MemberTables, member_table

TILE = 8192  # anchor values a program holds: [heads, blocks, W] (8 kv heads of 128: 8 blocks a program)
MAX_BLOCKS = 32  # blocks a program scores at most


def blocks_per_program(heads: int, width: int) -> int:
    """Blocks a program scores: as many as TILE anchor values of every kv head (heads, a power
    of two), a power of two from 1 to MAX_BLOCKS."""
    fit = max(1, TILE // (heads * width))
    return min(MAX_BLOCKS, 1 << (fit.bit_length() - 1))


@triton.jit
def _masked_scores(q_ptr, anchors_ptr, bias_ptr, params_ptr, members_ptr, out_ptr, width_out, selected, group,
                   NUM_KV: tl.constexpr, HEADS: tl.constexpr, W: tl.constexpr, DIM: tl.constexpr,
                   QUEST: tl.constexpr, SHARED: tl.constexpr, BLOCKS: tl.constexpr, UNIT: tl.constexpr):
    """Member b's blocks BLOCKS * pid .. of every kv head -> out [B, 1 or KV, width_out]: score +
    bias where its context holds more blocks than are selected, -inf outside [first, last) and
    past its own blocks. Each kv head's vector is block_scores.query_vectors' (its query rows of
    q [B, H, DIM] summed in float32, one after another; QUEST: the negative parts', then the
    positive parts'). Every kv head at once (HEADS: NUM_KV rounded up to a power of two): a load
    of each query row of the group across the heads, one of the anchors (a loop over the heads
    waited on each of its loads in turn: 21 us a layer at batch 8, 128K, 8B shapes, on the H200).
    Member b's anchors, bias and params lie at members[b] from member 0's (anchors in units of
    UNIT elements), its block count last."""
    pid, b = tl.program_id(0), tl.program_id(1)
    row = members_ptr + b * 4
    anchors_ptr += tl.load(row) * UNIT
    bias_ptr += tl.load(row + 1)
    params_ptr += tl.load(row + 2)
    num_blocks = tl.load(row + 3)
    q_ptr += b * NUM_KV * group * DIM
    out_ptr += b * (1 if SHARED else NUM_KV) * width_out
    heads = tl.arange(0, HEADS)
    live = heads < NUM_KV
    blocks = pid * BLOCKS + tl.arange(0, BLOCKS)
    cols = tl.arange(0, W)
    real = blocks < num_blocks
    first, last = tl.load(params_ptr), tl.load(params_ptr + 1)
    crowded = (last - first) > selected
    inside = (blocks >= first) & (blocks < last) & real
    vec = tl.zeros((HEADS, W), tl.float32)
    for g in range(group):
        x = tl.load(q_ptr + (heads[:, None] * group + g) * DIM + cols[None, :] % DIM, mask=live[:, None],
                    other=0.0).to(tl.float32)
        if QUEST:  # paired with (min, max): the negative part, then the positive
            x = tl.where(cols[None, :] < DIM, tl.minimum(x, 0.0), tl.maximum(x, 0.0))
        vec += x
    a = tl.load(anchors_ptr + ((heads[:, None, None] * num_blocks + blocks[None, :, None]) * W + cols[None, None, :]),
                mask=live[:, None, None] & real[None, :, None], other=0.0)
    score = tl.sum(a.to(tl.float32) * vec[:, None, :], 2)  # [HEADS, BLOCKS]
    if SHARED:
        bias = tl.load(bias_ptr + blocks, mask=real, other=0.0)
        total = tl.where(inside, tl.sum(score, 0) + tl.where(crowded, bias, 0.0), float("-inf"))
        tl.store(out_ptr + blocks, total, mask=blocks < width_out)
    else:
        held = live[:, None] & real[None, :]
        bias = tl.load(bias_ptr + heads[:, None] * num_blocks + blocks[None, :], mask=held, other=0.0)
        score = tl.where(inside[None, :], score + tl.where(crowded, bias, 0.0), float("-inf"))
        tl.store(out_ptr + heads[:, None] * width_out + blocks[None, :], score,
                 mask=live[:, None] & (blocks < width_out)[None, :])


def masked_block_scores(q: torch.Tensor, anchors: list[torch.Tensor], bias: list[torch.Tensor],
                        params: list[torch.Tensor], selected: int, shared: bool, quest: bool,
                        tables: MemberTables | None = None) -> torch.Tensor:
    """A batch's q [B, H, D]; member b's anchors [KV, NB_b, W] bfloat16 (contiguous; W = D, or 2 D
    for QUEST's (min, max)), bias [1 or KV, NB_b] float32 (0, or -inf for a block preselection
    left out), params: device int64 [first, last, ...] -> scores float32 [B, 1 if shared else KV,
    max NB_b], -inf past a member's own blocks. One launch for the batch; fixed shapes, no sync.
    tables: the batch's store of its tables (member_tables.MemberTables), needed to capture a CUDA graph."""
    expect("q", q, ndim=3)
    batch, num_heads, dim = q.shape
    if not len(anchors) == len(bias) == len(params) == batch:
        raise ValueError(f"q holds {batch} members' queries; anchors, bias and params must be given for each")
    num_kv, width = anchors[0].shape[0], anchors[0].shape[2]
    rows = 1 if shared else num_kv
    for a, m, p in zip(anchors, bias, params):
        expect("anchors", a, shape=(num_kv, None, width), dtype=torch.bfloat16, device=q.device)
        expect("bias", m, shape=(rows, a.shape[1]), dtype=torch.float32, device=q.device)
        expect("params", p, ndim=1, dtype=torch.int64, device=q.device)
        if not (a.is_contiguous() and m.is_contiguous()):
            raise ValueError("anchors and bias must be contiguous")
    if width != dim * (2 if quest else 1) or num_heads % num_kv:
        raise ValueError(f"anchors {tuple(anchors[0].shape)} do not fit q {tuple(q.shape)}"
                         f"{' (QUEST)' if quest else ''}")
    # offsets in 16 elements where every member's anchors lie so (as the bases they count from do)
    unit = 16 if all(a.data_ptr() % (16 * a.element_size()) == 0 for a in anchors) else 1
    counts = [a.shape[1] for a in anchors]
    most = max(counts)
    (anchors_at, bias_at, params_at), members = member_table(
        tables, "scores", [(anchors, unit, "anchors"), (bias, 1, "bias"), (params, 1, "params")], [counts], q.device,
        (unit, most, tuple(anchors[0].shape[::2]), rows, selected, shared, quest))
    out = torch.empty((batch, rows, most), dtype=torch.float32, device=q.device)
    heads = triton.next_power_of_2(num_kv)
    blocks = blocks_per_program(heads, width)
    _masked_scores[(triton.cdiv(most, blocks), batch)](q.contiguous(), anchors_at, bias_at, params_at, members, out,
                                                      most, selected, num_heads // num_kv, NUM_KV=num_kv, HEADS=heads,
                                                      W=width, DIM=dim, QUEST=quest, SHARED=shared, BLOCKS=blocks,
                                                      UNIT=unit)
    return out


@triton.jit
def _selection_rows(top_ptr, picked_ptr, params_ptr, index_ptr, valid_ptr, members_ptr, places_out, block_size,
                    ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Member b's kv head h: on a step that selects (its params[2]), its page rows
    h * table_blocks + picked and the tokens that count (the finite scores among its first
    `places` of the top, times block_size); otherwise its rows stay. Member b's params, index and
    valid lie at members[b] from member 0's, then its places and table_blocks."""
    h, b = tl.program_id(0), tl.program_id(1)
    row = members_ptr + b * 5
    params_ptr += tl.load(row)
    index_ptr += tl.load(row + 1)
    valid_ptr += tl.load(row + 2)
    places, table_blocks = tl.load(row + 3), tl.load(row + 4)
    if tl.load(params_ptr + 2) != 0:
        r = b * ROWS + (0 if ROWS == 1 else h)
        at = tl.arange(0, WIDTH)
        inside = at < places
        top = tl.load(top_ptr + r * places_out + at, mask=inside, other=float("-inf"))
        picked = tl.load(picked_ptr + r * places_out + at, mask=inside, other=0)
        tl.store(index_ptr + h * places + at, h * table_blocks + picked, mask=inside)
        tl.store(valid_ptr + h, tl.sum((top > float("-inf")).to(tl.int64), 0) * block_size)


def selection_rows(top: torch.Tensor, picked: torch.Tensor, params: list[torch.Tensor], index: list[torch.Tensor],
                   valid: list[torch.Tensor], table_blocks: list[int], block_size: int,
                   tables: MemberTables | None = None):
    """A batch's top-k (top, picked) [B, 1 or KV, P] (best first) -> member b's index [KV, P_b]
    (page rows of its head-major DRAM table of table_blocks[b] blocks a head, its first P_b <= P
    places) and valid [KV] (tokens that count), written in place when its params[2] (the step
    selects afresh) is set, kept otherwise. One launch for the batch; fixed shapes, no sync."""
    expect("top", top, ndim=3, dtype=torch.float32)
    batch, rows, places = top.shape
    expect("picked", picked, shape=tuple(top.shape), dtype=torch.int64, device=top.device)
    if not len(params) == len(index) == len(valid) == len(table_blocks) == batch:
        raise ValueError(f"top holds {batch} members' selections; params, index, valid and table_blocks for each")
    num_kv = index[0].shape[0]
    for p, i, v in zip(params, index, valid):
        expect("params", p, ndim=1, dtype=torch.int64, device=top.device)
        expect("index", i, shape=(num_kv, None), dtype=torch.int64, device=top.device)
        expect("valid", v, shape=(num_kv,), dtype=torch.int64, device=top.device)
        if i.shape[1] > places or not i.is_contiguous():
            raise ValueError(f"each index must be contiguous and at most {places} wide, as the top "
                             f"(got {tuple(i.shape)})")
    if rows not in (1, num_kv):
        raise ValueError(f"top {tuple(top.shape)} must hold one row or one per kv head of each index")
    (params_at, index_at, valid_at), members = member_table(
        tables, "rows", [(params, 1, "params"), (index, 1, "index"), (valid, 1, "valid")],
        [[i.shape[1] for i in index], table_blocks], top.device, (rows, places, block_size, num_kv))
    _selection_rows[(num_kv, batch)](top.contiguous(), picked.contiguous(), params_at, index_at, valid_at, members,
                                     places, block_size, ROWS=rows, WIDTH=triton.next_power_of_2(places))


def kernel_applies(anchors_per_block: int, quest: bool, head_dim: int) -> bool:
    """Linear scores only (one anchor, or QUEST's pair), over a power-of-two row."""
    width = head_dim * (2 if quest else 1)
    return (quest or anchors_per_block == 1) and width >= 16 and width & (width - 1) == 0
