"""Block scores from the prompt's last queries (SnapKV's observation window), for decode-time
preselection.

After the last prefill chunk of a layer, every key of the layer is still in the device
pages. The last Tq queries attend to all of them, causally; the softmax mass each query puts
on each block, summed over the queries and the query heads of a kv group, scores the block.
Keys go through in slices with a per-slice max, rescaled at the end, so memory stays
O(slice) at any context length.
"""

from __future__ import annotations

import torch


def observation_block_mass(q: torch.Tensor, k_pages: torch.Tensor, num_tokens: int, scale: float,
                           slice_blocks: int = 128) -> torch.Tensor:
    """q: [Tq, H, D], the queries of positions num_tokens-Tq..num_tokens-1; k_pages:
    [KV, NB, B, D] holding at least num_tokens keys -> [KV, ceil(num_tokens / B)] float32, the
    attention mass on each block summed over the queries and the heads of each group."""
    num_q, num_heads, dim = q.shape
    num_kv, _, block, _ = k_pages.shape
    group = num_heads // num_kv
    num_blocks = -(-num_tokens // block)
    # [KV, G*Tq, D]: rows are (head in group, query)
    qg = q.view(num_q, num_kv, group, dim).permute(1, 2, 0, 3).reshape(num_kv, group * num_q, dim)
    qg = qg.to(k_pages.dtype)
    q_pos = (torch.arange(num_q, device=q.device) + num_tokens - num_q).repeat(group)  # [G*Tq]
    maxima, sums = [], []
    for b0 in range(0, num_blocks, slice_blocks):
        b1 = min(num_blocks, b0 + slice_blocks)
        keys = k_pages[:, b0:b1].reshape(num_kv, -1, dim)
        logits = torch.bmm(qg, keys.transpose(1, 2)).float() * scale  # [KV, G*Tq, n]
        masked = b1 * block > num_tokens - num_q + 1  # the slice holds keys after the first query
        if masked:
            k_pos = torch.arange(b0 * block, b1 * block, device=q.device)
            logits.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        m = logits.amax(-1, keepdim=True)
        if masked:
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a slice wholly after a query
        maxima.append(m)
        sums.append(torch.exp(logits - m).view(num_kv, group * num_q, b1 - b0, block).sum(-1))
    top = torch.stack(maxima).amax(0)  # [KV, G*Tq, 1]
    scaled = [s * torch.exp(m - top) for m, s in zip(maxima, sums)]
    total = sum(s.sum(-1, keepdim=True) for s in scaled)
    return (torch.cat(scaled, -1) / total).sum(1)
