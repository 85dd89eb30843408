"""Plain numpy anchors, one block at a time: the reference the prefill's and decode's anchors
are tested against."""

import numpy as np

from cpu_ops.anchors import anchors_per_block


def fixed_positions(block_size: int, anchor_num: int) -> np.ndarray:
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
