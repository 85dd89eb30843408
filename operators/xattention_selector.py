"""XAttention-style block selection: antidiagonal stride scoring and a softmax-mass threshold.

Within each stride x stride tile of the attention matrix, the sum along the antidiagonal is
a cheap proxy of the tile's mass. Reordering queries so that row r of a stride group pairs
with key S-1-r turns those sums into one matmul of [T/S, S*D] by [S*D, N/S]. The softmax
over history keys is combined from per-tile (max, sum of exp) statistics, so memory stays
[H, T/S, tile/S]. Per query block, history blocks are kept in order of estimated mass until
`threshold` of it is covered.
"""

from __future__ import annotations

import torch

from operators.block_selector import always_kept

TILE_TOKENS = 1 << 16


def _stride_queries(q: torch.Tensor, stride: int) -> torch.Tensor:
    """q: [T, H, D] -> [H, ceil(T/S), S*D]: row r of each group reversed to pair with key S-1-r."""
    num_q, num_heads, dim = q.shape
    rows = -(-num_q // stride)
    padded = torch.zeros(rows * stride, num_heads, dim, device=q.device, dtype=torch.float32)
    padded[:num_q] = q.float()
    grouped = padded.view(rows, stride, num_heads, dim).flip(1)
    return grouped.permute(2, 0, 1, 3).reshape(num_heads, rows, stride * dim)


def _stride_keys(k: torch.Tensor, stride: int) -> torch.Tensor:
    """k: [KV, N, D] (N a multiple of S) -> [KV, N/S, S*D]."""
    num_kv, n, dim = k.shape
    return k.float().reshape(num_kv, n // stride, stride * dim)


def select_blocks_xattention(q: torch.Tensor, keys: torch.Tensor, block_size: int, stride: int,
                             threshold: float, scale: float, sink_blocks: int, window_blocks: int,
                             tile_tokens: int = TILE_TOKENS) -> torch.Tensor:
    """q: [T, H, D]; keys: [KV, num_hist * block_size, D] history -> keep [H, nqb, num_hist] bool."""
    num_q, num_heads, dim = q.shape
    num_kv, num_keys, _ = keys.shape
    assert block_size % stride == 0 and num_keys % block_size == 0
    num_hist, group = num_keys // block_size, num_heads // num_kv
    num_qb = -(-num_q // block_size)
    qs = _stride_queries(q, stride)  # [H, R, S*D]
    rows = qs.shape[1]
    valid_rows = (torch.arange(rows, device=q.device) * stride < num_q).float()
    qs = qs.view(num_kv, group * rows, -1)
    tile = max(tile_tokens // block_size, 1) * block_size
    factor = scale / stride  # XAttention scales the summed antidiagonal by 1/S

    def scores(t0, t1):  # [KV, G*R, (t1-t0)/S]
        return torch.bmm(qs, _stride_keys(keys[:, t0:t1], stride).transpose(1, 2)) * factor

    row_max = torch.full(qs.shape[:2], float("-inf"), device=q.device)
    row_sum = torch.zeros(qs.shape[:2], device=q.device)
    for t0 in range(0, num_keys, tile):  # pass 1: online (max, sum of exp) per row
        s = scores(t0, min(t0 + tile, num_keys))
        new_max = torch.maximum(row_max, s.amax(-1))
        row_sum = row_sum * torch.exp(row_max - new_max) + torch.exp(s - new_max[..., None]).sum(-1)
        row_max = new_max
    mass = torch.empty(num_kv, group, num_qb, num_hist, device=q.device)
    per_block = block_size // stride
    q_rows_per_block = block_size // stride
    pad_rows = num_qb * q_rows_per_block - rows
    for t0 in range(0, num_keys, tile):  # pass 2: normalised mass per (query block, key block)
        t1 = min(t0 + tile, num_keys)
        p = torch.exp(scores(t0, t1) - row_max[..., None]) / row_sum[..., None]
        p = p.view(num_kv, group, rows, -1) * valid_rows[:, None]
        p = torch.nn.functional.pad(p, (0, 0, 0, pad_rows))
        p = p.view(num_kv, group, num_qb, q_rows_per_block, (t1 - t0) // block_size, per_block)
        mass[..., t0 // block_size:t1 // block_size] = p.sum(dim=(3, 5))
    mass = mass.view(num_heads, num_qb, num_hist)
    if threshold >= 1.0:
        keep = torch.ones_like(mass, dtype=torch.bool)
    else:
        ordered, order = mass.sort(-1, descending=True)
        total = ordered.sum(-1, keepdim=True)
        before = ordered.cumsum(-1) - ordered  # mass covered by strictly better blocks
        keep_sorted = before < threshold * total
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep | always_kept(num_hist, sink_blocks, window_blocks, q.device)
