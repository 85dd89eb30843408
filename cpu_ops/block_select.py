"""Score blocks against the decode query by their anchors and pick the top k, in position order.

Per kv head the score of block j sums over the kv head's G query heads (SEPARATE selects per
kv head); SHARED sums the scores over kv heads and selects once for all. The first
`sink_blocks` blocks and the blocks holding the last `local_tokens` tokens are always kept
and do not compete for the k places.
"""

from __future__ import annotations

import numba as nb
import numpy as np

QUEST = 1  # score kind: 0 = max over anchors of q . a, 1 = Quest bound (anchors are min, max)


SCORE_CHUNK = 256  # blocks per parallel work item: one item per block costs more to schedule than to run


@nb.njit(parallel=True, cache=True, fastmath=True)
def score_blocks(q, anchors, num_blocks, kind, out):
    """q: [H, D] f32; anchors: [KV, NB, A, D] f32 -> out [KV, num_blocks] f32 (first num_blocks)."""
    num_heads, dim = q.shape
    num_kv, _, num_anchors, _ = anchors.shape
    group = num_heads // num_kv
    chunks = (num_blocks + SCORE_CHUNK - 1) // SCORE_CHUNK
    for w in nb.prange(num_kv * chunks):
        h, first = w // chunks, (w % chunks) * SCORE_CHUNK
        for b in range(first, min(first + SCORE_CHUNK, num_blocks)):
            total = np.float32(0.0)
            for g in range(group):
                qh = q[h * group + g]
                if kind == QUEST:
                    lo, hi = anchors[h, b, 0], anchors[h, b, 1]
                    s = np.float32(0.0)
                    for c in range(dim):
                        s += max(qh[c] * lo[c], qh[c] * hi[c])
                    total += s
                else:
                    best = np.float32(-np.inf)
                    for a in range(num_anchors):
                        an = anchors[h, b, a]
                        s = np.float32(0.0)
                        for c in range(dim):
                            s += qh[c] * an[c]
                        best = max(best, s)
                    total += best
            out[h, b] = total


@nb.njit(cache=True)
def _top_k_in_order(scores, lo, hi, k, out, start):
    """Write into out[start:] the indices lo..hi-1 of the k largest scores, ascending; return count."""
    n = hi - lo
    if n <= 0 or k <= 0:
        return 0
    if k >= n:
        for i in range(n):
            out[start + i] = lo + i
        return n
    threshold = np.partition(scores[lo:hi].copy(), n - k)[n - k]
    above = 0
    for i in range(lo, hi):
        if scores[i] > threshold:
            above += 1
    ties_left = k - above  # equal scores: the earliest ones win
    count = 0
    for i in range(lo, hi):
        s = scores[i]
        if s > threshold or (s == threshold and ties_left > 0):
            if s == threshold:
                ties_left -= 1
            out[start + count] = i
            count += 1
    return count


@nb.njit(cache=True)
def select_blocks(scores, num_tokens, block_size, top_k, sink_blocks, local_tokens, shared, include_local,
                  out_blocks, out_counts):
    """scores: [KV, NB] -> out_blocks [KV, max] block ids in position order, out_counts [KV]."""
    num_kv = scores.shape[0]
    num_blocks = (num_tokens + block_size - 1) // block_size
    local_first = max((num_tokens - local_tokens) // block_size, 0) if local_tokens > 0 else num_blocks
    sinks = min(sink_blocks, local_first)
    summed = np.zeros(num_blocks, np.float32)
    if shared:
        for h in range(num_kv):
            for b in range(num_blocks):
                summed[b] += scores[h, b]
    for h in range(num_kv):
        row = summed if shared else scores[h, :num_blocks]
        n = 0
        for b in range(sinks):
            out_blocks[h, n] = b
            n += 1
        n += _top_k_in_order(row, sinks, local_first, top_k, out_blocks[h], n)
        if include_local:
            for b in range(local_first, num_blocks):
                out_blocks[h, n] = b
                n += 1
        out_counts[h] = n


def select_blocks_reference(scores, num_tokens, block_size, top_k, sink_blocks, local_tokens, shared,
                            include_local):
    """Plain numpy: a list per kv head of kept block ids, ascending."""
    num_blocks = -(-num_tokens // block_size)
    local_first = max((num_tokens - local_tokens) // block_size, 0) if local_tokens > 0 else num_blocks
    sinks = min(sink_blocks, local_first)
    rows = [scores[:, :num_blocks].sum(0)] * scores.shape[0] if shared else list(scores[:, :num_blocks])
    out = []
    for row in rows:
        candidates = list(range(sinks, local_first))
        ranked = sorted(candidates, key=lambda b: (-row[b], b))[:top_k]
        local = list(range(local_first, num_blocks)) if include_local else []
        out.append(sorted(list(range(sinks)) + ranked) + local)
    return out
