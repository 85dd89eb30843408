"""Decode block scores on the compute device: the same scores as cpu_ops/block_select.py's
score_blocks, for every block of a layer at once, in a few fixed-shape torch ops (so a CUDA
graph can hold them).

Scoring reads every anchor of every block once per token and layer; on the CPU at 512K
context (LLaMA-3.1-8B, one bfloat16 anchor per block) that is 268 MB per token, about 10 ms.
A GPU reads it in a small fraction of a millisecond, and only the scores (4 bytes per block)
travel to the host, where top-k and the selection rules stay.

Every kind is a matrix product per kv head:
- one linear anchor (MAX, MEAN, one DYNAMIC/FIX key): (sum_g q_g) . a;
- QUEST, anchors (min, max): sum_g sum_c max(q_gc min_c, q_gc max_c)
  = (sum_g q_g+) . max + (sum_g q_g-) . min, with q+ = max(q, 0), q- = min(q, 0);
- several anchors: sum_g max_a q_g . a_a.
"""

from __future__ import annotations

import torch


def query_vectors(q: torch.Tensor, num_kv: int, quest: bool) -> torch.Tensor:
    """q [H, D] -> the float32 [KV, W] each kv head's linear anchors are dotted with: the group's
    sum of q (W = D), or for QUEST its negative and positive parts' sums, paired with (min, max)
    (W = 2D)."""
    qg = q.float().view(num_kv, -1, q.shape[-1])
    if quest:
        return torch.cat([qg.clamp(max=0).sum(1), qg.clamp(min=0).sum(1)], -1)
    return qg.sum(1)


def device_block_scores(q: torch.Tensor, anchors: torch.Tensor, quest: bool, shared: bool) -> torch.Tensor:
    """q: [H, D]; anchors: [KV, NB, A, D] (bfloat16 as stored) -> scores float32 [1 if shared
    else KV, NB]. Computed in float32 from the stored anchors, as the CPU kernel does."""
    num_heads, dim = q.shape
    num_kv, num_blocks, num_anchors, _ = anchors.shape
    group = num_heads // num_kv
    a = anchors.float()
    if quest or num_anchors == 1:  # linear: [KV, NB, W] against [KV, W]
        vec = query_vectors(q, num_kv, quest)
        scores = torch.bmm(a.view(num_kv, num_blocks, vec.shape[-1]), vec[:, :, None])[..., 0]
    else:
        qg = q.float().view(num_kv, group, dim)
        per_anchor = torch.bmm(a.view(num_kv, num_blocks * num_anchors, dim), qg.transpose(1, 2))
        scores = per_anchor.view(num_kv, num_blocks, num_anchors, group).amax(2).sum(-1)
    return scores.sum(0, keepdim=True) if shared else scores
