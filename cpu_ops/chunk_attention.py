"""Causal attention of a prefill chunk over a bfloat16 KV cache, on the CPU, without torch.

The chunk's queries q [T, H, D] sit at positions end-T..end-1; the layer's cache holds the keys
and values of positions 0..end-1 as bfloat16 words [KV, tokens, D]. Per kv head, its keys and
values are widened to float32 once; then per block of queries, the rows of the kv head's group
of query heads form one matrix: the scores come from numpy's matmul (BLAS), the causal softmax
from one Numba pass over them (cpu_ops/exp.py's exp, which LLVM vectorises), and the output from one more matmul, divided by the
rows' sums. A block's score matrix stays under SCORE_BUDGET floats.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.bf16 import bits_as_float32
from cpu_ops.exp import exp_nonpositive
from cpu_ops.workers import Workers

SCORE_BUDGET = 1 << 21  # floats in one block's score matrix (8 MiB a worker)


@nb.njit(cache=True, fastmath=True, nogil=True)
def widen_bf16(words, end, out):
    """words [tokens, D] uint16 (bfloat16) -> out[:end] [end, D] float32."""
    for t in range(end):
        for d in range(words.shape[1]):
            out[t, d] = bits_as_float32(np.uint32(words[t, d]) << 16)


@nb.njit(cache=True, fastmath=True, nogil=True)
def causal_softmax(scores, first, block, sums):
    """scores [R, C]: row r is query r % block of a block whose first query sees columns up to
    `first` (inclusive); each row's visible scores become exp(s - max), the rest 0, and sums[r]
    their sum."""
    rows, cols = scores.shape
    for r in range(rows):
        row = scores[r]
        visible = min(first + r % block + 1, cols)
        top = row[0]
        for c in range(1, visible):
            top = max(top, row[c])
        total = np.float32(0.0)
        for c in range(visible):
            e = exp_nonpositive(row[c] - top)
            row[c] = e
            total += e
        for c in range(visible, cols):
            row[c] = 0.0
        sums[r] = total


def chunk_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, end: int, scale: float,
                    workers: Workers = Workers(1)) -> np.ndarray:
    """q [T, H, D] float32 at positions end-T..end-1; keys, values [KV, tokens, D] uint16
    (bfloat16 words, tokens >= end) -> [T, H, D] float32: each query attends to the keys at and
    before its position (dense_attention's semantics over the first `end` cached tokens).
    workers: threads that share out the kv heads and the blocks of queries."""
    num_q, num_heads, dim = q.shape
    num_kv = keys.shape[0]
    group, history = num_heads // num_kv, end - num_q
    blocks = -(-num_q // max(1, SCORE_BUDGET // (group * end)))
    block = -(-num_q // blocks)  # equal blocks: no sliver of a few queries left at the end
    scaled = (q * np.float32(scale)).transpose(1, 0, 2)  # [H, T, D]
    out = np.empty((num_heads, num_q, dim), np.float32)
    k32, v32 = np.empty((num_kv, end, dim), np.float32), np.empty((num_kv, end, dim), np.float32)

    def widen(j):
        widen_bf16(keys[j], end, k32[j])
        widen_bf16(values[j], end, v32[j])

    def attend(item):
        j, first = item
        heads = slice(j * group, (j + 1) * group)
        n = min(block, num_q - first)
        width = history + first + n  # the block's last query sees this many keys
        rows = np.ascontiguousarray(scaled[heads, first:first + n]).reshape(group * n, dim)
        scores = rows @ k32[j, :width].T
        sums = np.empty(group * n, np.float32)
        causal_softmax(scores, history + first, n, sums)
        o = scores @ v32[j, :width]
        o /= sums[:, None]
        out[heads, first:first + n] = o.reshape(group, n, dim)

    workers.map(widen, range(num_kv))
    workers.map(attend, [(j, first) for j in range(num_kv) for first in range(0, num_q, block)])
    return out.transpose(1, 0, 2)
