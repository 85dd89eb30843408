"""Representative tokens (anchors) of each (kv head, block) that decode scores blocks with.

anchor_type  anchors per block                          block score for query q
MAX          1: channel-wise max of the block's keys    q . max
MEAN         1: mean key                                 q . mean
QUEST        2: channel-wise min and max                 sum_c max(q_c min_c, q_c max_c)  (>= q . k)
DYNAMIC      anchor_num keys of highest prefill importance   max over anchors of q . a
FIX          anchor_num keys at evenly spaced positions      max over anchors of q . a
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.bf16 import to_bf16

ANCHOR_TYPES = ("MAX", "MEAN", "QUEST", "DYNAMIC", "FIX")


def anchors_per_block(anchor_type: str, anchor_num: int) -> int:
    return {"MAX": 1, "MEAN": 1, "QUEST": 2}.get(anchor_type, anchor_num)


def stored_anchors(anchors: np.ndarray, anchor_type: str) -> np.ndarray:
    """float32 anchors [..., A, D] -> the bfloat16 words decode scores with. QUEST's min and max
    round outwards (down, up), so its score stays an upper bound of q . k; the rest round to
    nearest."""
    if anchor_type == "QUEST":
        return np.stack([to_bf16(anchors[..., 0, :], "down"), to_bf16(anchors[..., 1, :], "up")], -2)
    return to_bf16(anchors)


def fixed_positions(block_size: int, anchor_num: int) -> np.ndarray:
    """FIX anchors: anchor_num token offsets spread evenly over the block, centred."""
    step = block_size / anchor_num
    return (np.arange(anchor_num) * step + step / 2).astype(np.int64)


def build_anchors_reference(keys: np.ndarray, num_tokens: int, anchor_type: str, anchor_num: int,
                            importance: np.ndarray | None = None) -> np.ndarray:
    """keys: float32 [KV, NB, B, D]; importance [KV, NB, B] -> anchors float32 [KV, NB, A, D].

    Only the first num_tokens tokens are real; a partial last block uses its valid tokens
    (FIX positions past the end fall back to the last valid token)."""
    num_kv, num_blocks, block_size, dim = keys.shape
    out = np.zeros((num_kv, num_blocks, anchors_per_block(anchor_type, anchor_num), dim), np.float32)
    for b in range(num_blocks):
        valid = min(block_size, num_tokens - b * block_size)
        if valid <= 0:
            continue
        k = keys[:, b, :valid]
        if anchor_type == "MAX":
            out[:, b, 0] = k.max(1)
        elif anchor_type == "MEAN":
            out[:, b, 0] = k.mean(1)
        elif anchor_type == "QUEST":
            out[:, b, 0], out[:, b, 1] = k.min(1), k.max(1)
        elif anchor_type == "FIX":
            pos = np.minimum(fixed_positions(block_size, anchor_num), valid - 1)
            out[:, b] = k[:, pos]
        else:
            for h in range(num_kv):
                order = np.argsort(-importance[h, b, :valid], kind="stable")
                picks = order[np.arange(anchor_num) % valid]
                out[h, b] = k[h, picks]
    return out


@nb.njit(parallel=True, cache=True)
def _build_dynamic(keys, importance, num_tokens, anchor_num, out):
    num_kv, num_blocks, block_size, dim = keys.shape
    for w in nb.prange(num_kv * num_blocks):
        h, b = w // num_blocks, w % num_blocks
        valid = min(block_size, num_tokens - b * block_size)
        if valid <= 0:
            continue
        order = np.argsort(-importance[h, b, :valid], kind="mergesort")
        for a in range(anchor_num):
            out[h, b, a] = keys[h, b, order[a % valid]]


def build_anchors(keys: np.ndarray, num_tokens: int, anchor_type: str, anchor_num: int,
                  importance: np.ndarray | None = None) -> np.ndarray:
    """Same contract as build_anchors_reference; DYNAMIC runs in parallel with Numba."""
    if anchor_type != "DYNAMIC":
        return build_anchors_reference(keys, num_tokens, anchor_type, anchor_num)
    num_kv, num_blocks, _, dim = keys.shape
    out = np.zeros((num_kv, num_blocks, anchor_num, dim), np.float32)
    _build_dynamic(np.ascontiguousarray(keys, np.float32), np.ascontiguousarray(importance, np.float32),
                   num_tokens, anchor_num, out)
    return out
