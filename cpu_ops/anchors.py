"""Representative tokens (anchors) of each (kv head, block) that decode scores blocks with.

anchor_type  anchors per block                          block score for query q
MAX          1: channel-wise max of the block's keys    q . max
MEAN         1: mean key                                 q . mean
QUEST        2: channel-wise min and max                 sum_c max(q_c min_c, q_c max_c)  (>= q . k)
DYNAMIC      anchor_num keys of highest prefill importance   max over anchors of q . a
FIX          anchor_num keys at evenly spaced positions      max over anchors of q . a
"""

from __future__ import annotations

import numpy as np

from cpu_ops.bf16 import to_bf16

ANCHOR_TYPES = ("MAX", "MEAN", "QUEST", "DYNAMIC", "FIX")


def anchors_per_block(anchor_type: str, anchor_num: int) -> int:
    return {"MAX": 1, "MEAN": 1, "QUEST": 2}.get(anchor_type, anchor_num)


def stored_anchors(anchors: np.ndarray, anchor_type: str, out: np.ndarray | None = None) -> np.ndarray:
    """float32 anchors [..., A, D] -> the bfloat16 words decode scores with (written into out
    if given). QUEST's min and max round outwards (down, up), so its score stays an upper bound
    of q . k; the rest round to nearest."""
    if anchor_type == "QUEST":
        words = np.stack([to_bf16(anchors[..., 0, :], "down"), to_bf16(anchors[..., 1, :], "up")], -2)
        if out is None:
            return words
        out[...] = words
        return out
    return to_bf16(anchors, out=out)
