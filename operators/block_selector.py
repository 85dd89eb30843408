"""FlashPrefill-style block selection: no training, bounded memory.

Per head, each query block's pooled query scores every history block's pooled key; block j
is kept when exp(score_j - best) >= alpha, i.e. its estimated attention is at least alpha
times the best block's. Sink blocks and the blocks next to the chunk are always kept.
Scores are computed tile by tile over history blocks in two passes (max, then threshold),
so memory is [H, query blocks, tile] floats, never [H, chunk, history].

The `topk` variant keeps the same number of blocks for every execution group: each block's
score is its best margin to the row's best over the group's pooled query blocks (or, with
topk_rank "mass", its estimated attention share: the rows' softmax, averaged), and each group
keeps its num_keep best. Equal page counts let one FlashInfer plan serve every full chunk
of every layer, and no host sync is needed to learn the counts.

A block mean dilutes what a few queries ask for: a question at the end of a prompt is a
handful of tokens in a 128-token query block, and the key that answers it is one token among
128 in its block. With `tail_queries`, the prompt's last queries also score every history
token one by one; a block is kept when its best token is within alpha of that query's best
token outside the sinks and the window (those are kept anyway, and a sink token often takes
most of a query's attention, which would set the bar too high). The chunk keeps what any of
them keeps (the Q-block union takes every query block's blocks anyway).
"""

from __future__ import annotations

import math

import torch

TILE_BLOCKS = 4096
TAIL_SCORE_BYTES = 64 << 20  # one tile of the tail queries' token scores


def pool_query_blocks(q: torch.Tensor, block_size: int) -> torch.Tensor:
    """q: [T, H, D] -> [H, ceil(T / block_size), D] float32 means (the last block may be partial)."""
    num_q, num_heads, dim = q.shape
    full = num_q // block_size
    parts = []
    if full:
        parts.append(q[:full * block_size].float().view(full, block_size, num_heads, dim).sum(1) / block_size)
    if num_q > full * block_size:
        parts.append(q[full * block_size:].float().sum(0, keepdim=True) / (num_q - full * block_size))
    pooled = parts[0] if len(parts) == 1 else torch.cat(parts)  # [nqb, H, D]
    return pooled.transpose(0, 1).contiguous()


def always_kept(num_hist: int, sink_blocks: int, window_blocks: int, device) -> torch.Tensor:
    """[num_hist] bool: the first sink_blocks and the last window_blocks history blocks."""
    j = torch.arange(num_hist, device=device)
    return (j < sink_blocks) | (j >= num_hist - window_blocks)


def set_always_kept(per_block: torch.Tensor, sink_blocks: int, window_blocks: int, value) -> torch.Tensor:
    """per_block: [..., num_hist]; the sink and window blocks' entries set to value, in place
    (two slices: fewer launches than always_kept's mask)."""
    per_block[..., :sink_blocks] = value
    if window_blocks:
        per_block[..., max(0, per_block.shape[-1] - window_blocks):] = value
    return per_block


def _within_margin(queries: torch.Tensor, pooled_keys: torch.Tensor, scale: float, margin: float,
                   tile_blocks: int) -> torch.Tensor:
    """queries: [KV, rows, D] -> [KV, rows, num_hist] bool: each block whose score is within
    margin of that row's best."""
    num_kv, num_hist, _ = pooled_keys.shape

    def scores(j0, j1):  # [KV, rows, tile] float32
        return torch.bmm(queries, pooled_keys[:, j0:j1].float().transpose(1, 2)) * scale

    if num_hist <= tile_blocks:  # one tile: score once (fewer launches matter at 128K)
        s = scores(0, num_hist)
        return s >= s.amax(-1, keepdim=True) + margin
    best = torch.full(queries.shape[:2], float("-inf"), device=queries.device)
    for j0 in range(0, num_hist, tile_blocks):
        best = torch.maximum(best, scores(j0, min(j0 + tile_blocks, num_hist)).amax(-1))
    keep = torch.empty((num_kv, queries.shape[1], num_hist), dtype=torch.bool, device=queries.device)
    for j0 in range(0, num_hist, tile_blocks):
        j1 = min(j0 + tile_blocks, num_hist)
        keep[:, :, j0:j1] = scores(j0, j1) >= best[..., None] + margin
    return keep


def tail_block_keep(tail_q: torch.Tensor, keys: torch.Tensor, block_size: int, scale: float, margin: float,
                    sink_blocks: int, window_blocks: int, tile_tokens: int = 0) -> torch.Tensor:
    """tail_q: [t, H, D] the prompt's last queries; keys: [KV, num_hist * block_size, D] the
    history -> [H, num_hist] bool: the blocks holding a token within margin of some tail query's
    best token among the blocks that are not always kept. Scores are taken in the keys' dtype,
    tile by tile ([H, t, tile] at most TAIL_SCORE_BYTES)."""
    num_t, num_heads, dim = tail_q.shape
    num_kv, num_keys, _ = keys.shape
    num_hist = num_keys // block_size
    rows = tail_q.to(keys.dtype).transpose(0, 1).reshape(num_kv, -1, dim)  # [KV, G * t, D]
    if not tile_tokens:
        tile_tokens = TAIL_SCORE_BYTES // (num_heads * num_t * keys.element_size())
    tile = max(tile_tokens // block_size, 1) * block_size
    block_best = torch.empty((num_kv, rows.shape[1], num_hist), dtype=torch.float32, device=keys.device)
    for t0 in range(0, num_keys, tile):
        t1 = min(t0 + tile, num_keys)
        s = torch.bmm(rows, keys[:, t0:t1].transpose(1, 2))  # [KV, G * t, tile]
        block_best[..., t0 // block_size:t1 // block_size] = s.view(num_kv, rows.shape[1], -1, block_size).amax(-1)
    block_best *= scale
    candidate = ~always_kept(num_hist, sink_blocks, window_blocks, keys.device)
    best = block_best.masked_fill(~candidate, float("-inf")).amax(-1, keepdim=True)
    keep = (block_best >= best + margin) & candidate
    return keep.view(num_heads, num_t, num_hist).any(1)


def select_blocks_flashprefill(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, alpha: float,
                               scale: float, sink_blocks: int, window_blocks: int,
                               tile_blocks: int = TILE_BLOCKS, tail_queries: int = 0,
                               keys: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; pooled_keys: [KV, num_hist, D] -> keep: [H, num_query_blocks, num_hist] bool.
    tail_queries: how many of the chunk's last queries are the prompt's tail, which also score the
    history's tokens (keys: [KV, num_hist * block_size, D]); their keeps join the last query block's."""
    num_heads = q.shape[1]
    num_kv, num_hist, _ = pooled_keys.shape
    group = num_heads // num_kv
    qb = pool_query_blocks(q, block_size)  # [H, nqb, D]
    num_qb = qb.shape[1]
    qb = qb.view(num_kv, group * num_qb, -1)  # heads of one kv head side by side
    margin = math.log(alpha) if alpha > 0 else float("-inf")
    keep = _within_margin(qb, pooled_keys, scale, margin, tile_blocks).view(num_heads, num_qb, num_hist)
    if tail_queries:
        keep[:, -1] |= tail_block_keep(q[-tail_queries:], keys, block_size, scale, margin, sink_blocks, window_blocks)
    keep |= always_kept(num_hist, sink_blocks, window_blocks, q.device)
    return keep


def flashprefill_group_keep(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, alpha: float,
                            scale: float, sink_blocks: int, window_blocks: int, group_size: int,
                            tail_queries: int = 0, keys: torch.Tensor | None = None,
                            tile_blocks: int = TILE_BLOCKS) -> torch.Tensor:
    """select_blocks_flashprefill followed by the Q-block union and the union over each execution
    group (group_size consecutive heads), in a handful of operations for the GPU: the pooled
    query blocks of one kv head are rows of one score matrix, the unions one any() over the rows
    of a group's heads, and the sinks and window two slices (a block kept for every query block
    is kept by the union). q: [T, H, D]; pooled_keys: [KV, num_hist, D] -> [H / group_size, num_hist] bool."""
    num_heads = q.shape[1]
    num_kv, num_hist, dim = pooled_keys.shape
    rows = pool_query_blocks(q, block_size)  # [H, nqb, D]
    margin = math.log(alpha) if alpha > 0 else float("-inf")
    keep = _within_margin(rows.reshape(num_kv, -1, dim), pooled_keys, scale, margin, tile_blocks)  # [KV, rows, nh]
    if tail_queries:
        tail = tail_block_keep(q[-tail_queries:], keys, block_size, scale, margin, sink_blocks, window_blocks)
        keep = torch.cat([keep.view(num_heads, -1, num_hist), tail[:, None]], dim=1)
    keep = keep.view(num_heads // group_size, -1, num_hist).any(1)
    return set_always_kept(keep, sink_blocks, window_blocks, True)


def topk_group_blocks(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, scale: float, num_keep: int,
                      sink_blocks: int, window_blocks: int, group_size: int, rank: str = "margin") -> torch.Tensor:
    """The num_keep history blocks each execution group (group_size consecutive heads) reads:
    the sinks, the window, then the blocks that score best by group_margin (rank "margin") or
    group_mass ("mass") -> [H / group_size, num_keep] int64 block ids, in no particular order."""
    num_hist = pooled_keys.shape[1]
    assert sink_blocks + window_blocks <= num_keep <= num_hist or num_keep == num_hist, (num_keep, num_hist)
    score = RANKS[rank](q, pooled_keys, block_size, scale, sink_blocks, window_blocks, group_size)
    return score.topk(num_keep, dim=1, sorted=False).indices


def _pooled_scores(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """[KV, group * nqb, num_hist] float32: each pooled query block's score of each pooled key
    (the rows of one kv head's query heads side by side, head-major)."""
    num_kv, num_hist, dim = pooled_keys.shape
    rows = pool_query_blocks(q, block_size).reshape(num_kv, -1, dim)
    return torch.bmm(rows, pooled_keys.float().transpose(1, 2)) * scale


def group_margin(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, scale: float, sink_blocks: int,
                 window_blocks: int, group_size: int) -> torch.Tensor:
    """What topk ranks history blocks by, per execution group: how close each block's pooled-key
    score comes to the best score of some pooled query block of one of the group's heads
    (FlashPrefill's margin, ranked instead of cut at alpha); +inf for the sinks and the window.
    q: [T, H, D]; pooled_keys: [KV, num_hist, D] -> [H / group_size, num_hist] float32."""
    scores = _pooled_scores(q, pooled_keys, block_size, scale)
    margin = scores - scores.amax(-1, keepdim=True)  # <= 0; 0 at each row's best block
    per_group = margin.view(q.shape[1] // group_size, -1, pooled_keys.shape[1]).amax(1)  # [G, num_hist]
    return set_always_kept(per_group, sink_blocks, window_blocks, float("inf"))


def group_share(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, scale: float,
                group_size: int) -> torch.Tensor:
    """Each history block's estimated share of the attention, per execution group: the mean over
    the group's pooled query blocks of each one's softmax over the history's pooled keys.
    q: [T, H, D]; pooled_keys: [KV, num_hist, D] -> [H / group_size, num_hist] float32."""
    share = _pooled_scores(q, pooled_keys, block_size, scale).softmax(-1)
    return share.view(q.shape[1] // group_size, -1, pooled_keys.shape[1]).mean(1)


def group_mass(q: torch.Tensor, pooled_keys: torch.Tensor, block_size: int, scale: float, sink_blocks: int,
               window_blocks: int, group_size: int) -> torch.Tensor:
    """What topk ranks history blocks by with topk_rank "mass": group_share, +inf for the sinks
    and the window. Where the margin ranks a block by one row's best case, the mass counts every
    row that reads it, and how much. -> [H / group_size, num_hist] float32."""
    return set_always_kept(group_share(q, pooled_keys, block_size, scale, group_size), sink_blocks, window_blocks,
                           float("inf"))


RANKS = {"margin": group_margin, "mass": group_mass}  # topk_rank: what topk orders the history blocks by
