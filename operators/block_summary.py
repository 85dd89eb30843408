"""Per-block key summaries for decode-time selection, computed where the keys are (GPU in prefill).

For each (kv head, block): the mean key, the channel-wise max and min (Quest bounds), and a
per-token importance used by DYNAMIC anchors. Partial blocks summarise only their valid tokens.
"""

from __future__ import annotations

import torch


def block_summaries(k: torch.Tensor, num_valid: int):
    """k: [KV, num_blocks, block_size, D] holding num_valid tokens (the rest is padding).

    Returns mean, kmax, kmin: [KV, num_blocks, D] in float32.
    """
    num_kv, num_blocks, block_size, dim = k.shape
    assert 0 < num_valid <= num_blocks * block_size
    valid = (torch.arange(num_blocks * block_size, device=k.device) < num_valid).view(
        1, num_blocks, block_size, 1)
    k32 = k.float()
    count = valid.sum(2).clamp(min=1)  # [1, num_blocks, 1]
    mean = (k32 * valid).sum(2) / count
    kmax = k32.masked_fill(~valid, float("-inf")).amax(2)
    kmin = k32.masked_fill(~valid, float("inf")).amin(2)
    return mean, kmax, kmin


def token_importance(q_last: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention that the last queries of a chunk give each key of the chunk, max over queries
    and over the query heads of each kv head.

    q_last: [Tq, H, D] (the chunk's last Tq queries); k: [KV, T, D] (the chunk's keys, causal:
    query i sits at position T - Tq + i). Returns [KV, T] float32.
    """
    num_q, num_heads, _ = q_last.shape
    num_kv, num_k, _ = k.shape
    group = num_heads // num_kv
    q = q_last.float().view(num_q, num_kv, group, -1).permute(1, 2, 0, 3)  # [KV, G, Tq, D]
    scores = torch.einsum("kgqd,ktd->kgqt", q, k.float()) * scale
    pos_q = torch.arange(num_k - num_q, num_k, device=k.device)[:, None]
    scores = scores.masked_fill(torch.arange(num_k, device=k.device)[None, :] > pos_q, float("-inf"))
    return scores.softmax(-1).amax(dim=(1, 2))
