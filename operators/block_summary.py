"""Per-block key summaries for decode-time selection, computed where the keys are (GPU in prefill).

For each (kv head, block): the mean key, the channel-wise max and min (Quest bounds), and the
keys that represent it for DYNAMIC anchors (those the chunk's last queries attend to most) and
FIX anchors (evenly spaced). Partial blocks summarise only their valid tokens. They are taken
from the unquantised keys, before a q8_0 / q4_0 cache rounds them.
"""

from __future__ import annotations

import torch


def block_summaries(k: torch.Tensor, num_valid: int):
    """k: [KV, num_blocks, block_size, D] holding num_valid tokens, every block but the last full
    (the rest is padding).

    Returns mean, kmax, kmin: [KV, num_blocks, D] in float32. The whole blocks are reduced as they
    lie, the last alone where it is partial (masking every block costs several passes more).
    """
    num_kv, num_blocks, block_size, dim = k.shape
    tail = num_valid - (num_blocks - 1) * block_size  # the last block's valid tokens
    assert 0 < tail <= block_size
    k32 = k.float()
    mean, kmax, kmin = k32.mean(2), k32.amax(2), k32.amin(2)
    if tail < block_size:
        last = k32[:, -1, :tail]
        mean[:, -1], kmax[:, -1], kmin[:, -1] = last.mean(1), last.amax(1), last.amin(1)
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


def fixed_offsets(block_size: int, anchor_num: int) -> list[int]:
    """FIX anchors: anchor_num token offsets spread evenly over the block, centred."""
    step = block_size / anchor_num
    return [int(a * step + step / 2) for a in range(anchor_num)]


def anchor_keys(k: torch.Tensor, num_valid: int, anchor_type: str, anchor_num: int,
                importance: torch.Tensor | None = None) -> torch.Tensor:
    """k: [KV, num_blocks, block_size, D] holding num_valid tokens -> [KV, num_blocks, A, D] float32.

    DYNAMIC: the anchor_num keys of highest importance ([KV, >= num_valid] tokens; ties go to
    the earlier token; a block of fewer valid tokens than anchors repeats them in that order).
    FIX: the keys at `fixed_offsets`, or the last valid key past the end of a partial block."""
    num_kv, num_blocks, block_size, dim = k.shape
    valid = (num_valid - torch.arange(num_blocks, device=k.device) * block_size).clamp(1, block_size)  # [NB]
    slots = torch.arange(anchor_num, device=k.device)
    if anchor_type == "FIX":
        offsets = torch.tensor(fixed_offsets(block_size, anchor_num), device=k.device)
        picks = torch.minimum(offsets[None, :], valid[:, None] - 1).expand(num_kv, -1, -1)  # [KV, NB, A]
    elif anchor_type == "DYNAMIC":
        score = torch.full((num_kv, num_blocks * block_size), float("-inf"), device=k.device)
        score[:, :num_valid] = importance[:, :num_valid]
        score = score.view(num_kv, num_blocks, block_size)
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # [KV, NB, B]
        picks = order.gather(-1, (slots[None, :] % valid[:, None]).expand(num_kv, -1, -1))
    else:
        raise ValueError(f"{anchor_type} anchors are not keys of the block")
    return k.float().gather(2, picks[..., None].expand(-1, -1, -1, dim))
