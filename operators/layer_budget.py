"""Per-layer block budgets for topk (`layer_budget: attention`): each layer keeps keep_blocks
history blocks, and more where its attention spreads wider than the other layers'.

At a layer's first chunk that selects, a sample of the chunk's queries (every SAMPLE_STRIDE-th)
attends exactly to the history; the layer's need is the number of blocks, in the order topk
ranks them, that hold `mass` of that attention (the mean over its execution groups). The
layer's count is keep_blocks times its need over the mean need of the layers measured so far
(itself included), from keep_blocks to twice that in steps of BUDGET_STEP, and serves all its
later chunks (one FlashInfer plan per layer). Attention that is flat in every layer (random
weights) gives every layer keep_blocks; a layer that spreads its attention wider than the
others gets more. Offline, on the exact attention of 6 multikey prompts at 127K
(docs/measurements/2026-12-03-ruler-grid.md), budgets between half and twice keep_blocks lifted
the worst layer's kept share from 0.55 to 0.66 at a mean of 137 blocks where 128 were fixed, but
on the real model they lost multikey at 127K (4 of 16 against the fixed count's 11): the layers
that concentrate their attention are those that find the key, and fewer blocks there lose it.
So no layer keeps fewer than keep_blocks.
"""

from __future__ import annotations

import torch

SAMPLE_STRIDE = 32  # every 32nd query of the chunk measures the layer's attention
BUDGET_STEP = 16  # counts are multiples of this: few distinct plans
TILE_TOKENS = 8192  # history keys scored at once: [sampled rows, TILE_TOKENS] floats


def sampled_share(q: torch.Tensor, keys: torch.Tensor, num_hist: int, block_size: int, scale: float,
                  group_size: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Each history block's share of the exact attention of q's rows, averaged over the rows and
    the heads of each execution group. q: [S, H, D]; keys: [KV, N, D], the history's
    num_hist * block_size keys first; positions: [S] each row's position, which sees the keys up
    to it (causal: the chunk's own keys after the history count in its softmax), or None: every
    row sees all N keys -> [H / group_size, num_hist] float32. Two passes over tiles of the keys
    (row log-sum-exp, then per-block sums), so memory stays [S * heads per kv head, TILE_TOKENS]
    whatever their number."""
    num_rows, num_heads, dim = q.shape
    num_kv, num_tokens = keys.shape[0], keys.shape[1]
    per_kv = num_heads // num_kv
    tile = max(block_size, TILE_TOKENS // block_size * block_size)
    tiles = lambda end: [(a, min(a + tile, end)) for a in range(0, end, tile)]
    seen = None if positions is None else positions.repeat(per_kv)[:, None]  # rows are head-major
    share = torch.empty((num_heads, num_hist), dtype=torch.float32, device=q.device)
    for h in range(num_kv):
        rows = q[:, h * per_kv:(h + 1) * per_kv].transpose(0, 1).reshape(-1, dim).float()  # [per_kv * S, D]

        def scores(a, b):
            s = rows @ keys[h, a:b].float().T * scale
            return s if seen is None else s.masked_fill_(torch.arange(a, b, device=q.device) > seen, float("-inf"))

        lse = torch.stack([torch.logsumexp(scores(a, b), dim=1) for a, b in tiles(num_tokens)], dim=1).logsumexp(1)
        per_block = torch.cat([(scores(a, b) - lse[:, None]).exp().view(rows.shape[0], -1, block_size).sum(-1)
                               for a, b in tiles(num_hist * block_size)], dim=1)  # [per_kv * S, num_hist]
        share[h * per_kv:(h + 1) * per_kv] = per_block.view(per_kv, num_rows, num_hist).mean(1)
    return share.view(num_heads // group_size, group_size, num_hist).mean(1)


def blocks_to_hold(share: torch.Tensor, rank: torch.Tensor, mass: float) -> torch.Tensor:
    """share, rank: [G, num_hist] -> [G] int64: how many blocks, taken in rank order (best first),
    hold `mass` of each group's share."""
    order = rank.argsort(dim=1, descending=True, stable=True)
    held = share.gather(1, order).cumsum(1) / share.sum(1, keepdim=True).clamp_min(1e-30)
    return ((held < mass).sum(1) + 1).clamp_max(share.shape[1])


class LayerBudgets:
    """The counts of one prompt's layers, decided at each layer's first selecting chunk."""

    def __init__(self, keep_blocks: int, least: int):
        self.keep_blocks, self.least = keep_blocks, least  # least: the sinks and the window
        self.needs: list[float] = []
        self.counts: dict[int, int] = {}

    def reset(self):
        self.needs.clear()
        self.counts.clear()

    def decide(self, layer: int, need: float) -> int:
        """The layer's count from its need (blocks for the mass, mean over its groups)."""
        self.needs.append(need)
        mean = sum(self.needs) / len(self.needs)
        count = BUDGET_STEP * round(self.keep_blocks * need / max(mean, 1e-9) / BUDGET_STEP)
        count = min(max(count, self.keep_blocks, self.least), 2 * self.keep_blocks)
        self.counts[layer] = count
        return count
