"""Score blocks against the decode query by their anchors and pick the top k, in position order.

Anchors are kept as bfloat16 words ([KV, NB, A, D] uint16, cpu_ops/bf16.py): scoring reads
every anchor of every candidate block each step, so it is bound by memory, and half the bytes
is half the time. The score of block j for kv head h sums over the head's G query heads; for
one linear anchor (MAX, MEAN, one DYNAMIC or FIX key) that sum is (sum_g q_g) . a, one dot
product instead of G. SHARED sums the scores over kv heads too and selects once for all;
SEPARATE selects per kv head.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.bf16 import bf16_value
from cpu_ops.checks import expect

QUEST = 1  # score kind: 0 = max over anchors of q . a, 1 = Quest bound (anchors are min, max)

SCORE_CHUNK = 256  # blocks per parallel work item: one item per block costs more to schedule than to run


@nb.njit(parallel=True, cache=True, fastmath=True)
def score_blocks(q, anchors, ids, kind, shared, out):
    """q: [H, D] f32; anchors: [KV, NB, A, D] bf16 words; ids: int32 [n] blocks to score ->
    out[r, j], the score of block ids[j] (r = kv head, or row 0 summed over heads if shared).

    A work item is (kv head, run of SCORE_CHUNK ids): it reads one head's anchors in order,
    one memory stream, as the hardware prefetcher likes."""
    num_heads, dim = q.shape
    num_kv, _, num_anchors, _ = anchors.shape
    group = num_heads // num_kv
    n = ids.shape[0]
    linear = kind != QUEST and num_anchors == 1
    q_sum = np.zeros((num_kv, dim), np.float32)  # per kv head, the sum of its query heads
    for h in range(num_kv):
        for g in range(group):
            for c in range(dim):
                q_sum[h, c] += q[h * group + g, c]
    per_head = np.empty((num_kv, n), np.float32) if shared else out
    chunks = (n + SCORE_CHUNK - 1) // SCORE_CHUNK
    for w in nb.prange(num_kv * chunks):
        h, first = w // chunks, (w % chunks) * SCORE_CHUNK
        qs = q_sum[h]
        for j in range(first, min(first + SCORE_CHUNK, n)):
            b = ids[j]
            total = np.float32(0.0)
            if linear:
                an = anchors[h, b, 0]
                for c in range(dim):
                    total += qs[c] * bf16_value(an[c])
            elif kind == QUEST:
                lo, hi = anchors[h, b, 0], anchors[h, b, 1]
                for g in range(group):
                    qh = q[h * group + g]
                    s = np.float32(0.0)
                    for c in range(dim):
                        s += max(qh[c] * bf16_value(lo[c]), qh[c] * bf16_value(hi[c]))
                    total += s
            else:
                for g in range(group):
                    qh = q[h * group + g]
                    best = np.float32(-np.inf)
                    for a in range(num_anchors):
                        an = anchors[h, b, a]
                        s = np.float32(0.0)
                        for c in range(dim):
                            s += qh[c] * bf16_value(an[c])
                        best = max(best, s)
                    total += best
            per_head[h, j] = total
    if shared:
        for j in range(n):
            total = np.float32(0.0)
            for h in range(num_kv):
                total += per_head[h, j]
            out[0, j] = total


def block_scores(q: np.ndarray, anchors: np.ndarray, ids: np.ndarray, kind: int, shared: bool) -> np.ndarray:
    """Checked launcher of score_blocks -> scores float32 [1 if shared else KV, len(ids)]."""
    expect("anchors", anchors, ndim=4, dtype=np.uint16)
    num_kv, num_blocks, _, dim = anchors.shape
    expect("q", q, ndim=2, dtype=np.float32)
    expect("ids", ids, ndim=1, dtype=np.int32)
    if q.shape[1] != dim or q.shape[0] % num_kv:
        raise ValueError(f"q {q.shape} must hold whole groups of anchors' {num_kv} kv heads, head_dim {dim}")
    if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"ids must lie in 0..{num_blocks - 1}, got {ids.min()}..{ids.max()}")
    out = np.empty((1 if shared else num_kv, len(ids)), np.float32)
    score_blocks(np.ascontiguousarray(q), anchors, ids, kind, shared, out)
    return out


@nb.njit(inline="always", cache=True)
def _weaker(score_a, index_a, score_b, index_b):
    """Ranking: the higher score wins; of equal scores the earlier block."""
    return score_a < score_b or (score_a == score_b and index_a > index_b)


@nb.njit(cache=True)
def _top_k_in_order(scores, k, out):
    """Write into out the indices of the k largest scores (-inf and NaN never win), ascending;
    return how many. One pass with a min-heap of the k best so far: an element that does not
    beat the weakest kept one costs one comparison, so the pass runs at memory speed."""
    if k <= 0:
        return 0
    heap_s = np.empty(k, np.float32)
    heap_i = np.empty(k, np.int64)
    size = 0
    for i in range(scores.shape[0]):
        s = scores[i]
        if not s > -np.inf:
            continue
        if size < k:  # push, sift up
            j = size
            size += 1
            while j > 0:
                parent = (j - 1) >> 1
                if not _weaker(s, i, heap_s[parent], heap_i[parent]):
                    break
                heap_s[j], heap_i[j] = heap_s[parent], heap_i[parent]
                j = parent
        elif s > heap_s[0]:  # beats the weakest kept (a tie loses: it comes later); sift down
            j = 0
            while True:
                child = 2 * j + 1
                if child >= size:
                    break
                if child + 1 < size and _weaker(heap_s[child + 1], heap_i[child + 1], heap_s[child], heap_i[child]):
                    child += 1
                if not _weaker(heap_s[child], heap_i[child], s, i):
                    break
                heap_s[j], heap_i[j] = heap_s[child], heap_i[child]
                j = child
        else:
            continue
        heap_s[j], heap_i[j] = s, i
    kept = np.sort(heap_i[:size])
    for j in range(size):
        out[j] = kept[j]
    return size


@nb.njit(cache=True)
def select_blocks(scores, ids, k, out_blocks, out_counts):
    """scores: [R, n] for blocks ids (ascending), R = 1 (shared) or KV -> out_blocks [KV, >= k],
    the k best block ids of each kv head in position order, and out_counts [KV]. Scores of
    -inf never win a place."""
    num_kv = out_blocks.shape[0]
    picks = np.empty(max(min(k, scores.shape[1]), 1), np.int64)
    for r in range(scores.shape[0]):
        count = _top_k_in_order(scores[r], min(k, scores.shape[1]), picks)
        for h in range(num_kv) if scores.shape[0] == 1 else range(r, r + 1):  # one shared row: every head
            for i in range(count):
                out_blocks[h, i] = ids[picks[i]]
            out_counts[h] = count


def select_blocks_reference(scores, ids, k):
    """Plain numpy: a list per kv head of the kept block ids, ascending."""
    out = []
    for row in scores:
        ranked = sorted((j for j in range(len(ids)) if row[j] > -np.inf), key=lambda j: (-row[j], j))[:k]
        out.append(sorted(int(ids[j]) for j in ranked))
    return out
