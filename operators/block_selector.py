"""FlashPrefill-style block selection: no training, bounded memory.

Per head, each query block's pooled query scores every history block's pooled key; block j
is kept when exp(score_j - best) >= alpha, i.e. its estimated attention is at least alpha
times the best block's. Sink blocks and the blocks next to the chunk are always kept.
Scores are computed tile by tile over history blocks in two passes (max, then threshold),
so memory is [H, query blocks, tile] floats, never [H, chunk, history].
"""

from __future__ import annotations

import math

import torch

TILE_BLOCKS = 4096


def pool_query_blocks(q: torch.Tensor, block_size: int) -> torch.Tensor:
    """q: [T, H, D] -> [H, ceil(T / block_size), D] float32 means (the last block may be partial)."""
    num_q, num_heads, dim = q.shape
    num_qb = -(-num_q // block_size)
    padded = torch.zeros(num_qb * block_size, num_heads, dim, device=q.device, dtype=torch.float32)
    padded[:num_q] = q.float()
    counts = torch.full((num_qb,), float(block_size), device=q.device)
    counts[-1] = num_q - (num_qb - 1) * block_size
    sums = padded.view(num_qb, block_size, num_heads, dim).sum(1)  # [nqb, H, D]
    return (sums / counts[:, None, None]).transpose(0, 1).contiguous()


def always_kept(num_hist: int, sink_blocks: int, window_blocks: int, device) -> torch.Tensor:
    """[num_hist] bool: the first sink_blocks and the last window_blocks history blocks."""
    j = torch.arange(num_hist, device=device)
    return (j < sink_blocks) | (j >= num_hist - window_blocks)


def select_blocks_flashprefill(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, alpha: float,
                               scale: float, sink_blocks: int, window_blocks: int,
                               tile_blocks: int = TILE_BLOCKS) -> torch.Tensor:
    """q: [T, H, D]; pooled_keys: [KV, num_hist, D] -> keep: [H, num_query_blocks, num_hist] bool."""
    num_heads = q.shape[1]
    num_kv, num_hist, _ = pooled_keys.shape
    group = num_heads // num_kv
    qb = pool_query_blocks(q, block_size)  # [H, nqb, D]
    qb = qb.view(num_kv, group * qb.shape[1], -1)  # heads of one kv head side by side

    def scores(j0, j1):  # [KV, G * nqb, tile] float32
        return torch.bmm(qb, pooled_keys[:, j0:j1].float().transpose(1, 2)) * scale

    margin = math.log(alpha) if alpha > 0 else float("-inf")
    if num_hist <= tile_blocks:  # one tile: score once (fewer launches matter at 128K)
        s = scores(0, num_hist)
        keep = s >= s.amax(-1, keepdim=True) + margin
    else:
        best = torch.full(qb.shape[:2], float("-inf"), device=q.device)
        for j0 in range(0, num_hist, tile_blocks):
            best = torch.maximum(best, scores(j0, min(j0 + tile_blocks, num_hist)).amax(-1))
        keep = torch.empty((num_kv, qb.shape[1], num_hist), dtype=torch.bool, device=q.device)
        for j0 in range(0, num_hist, tile_blocks):
            j1 = min(j0 + tile_blocks, num_hist)
            keep[:, :, j0:j1] = scores(j0, j1) >= best[..., None] + margin
    keep |= always_kept(num_hist, sink_blocks, window_blocks, q.device)
    return keep.view(num_heads, -1, num_hist)
