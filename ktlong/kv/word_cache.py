"""A dense KV cache's keys and values as bfloat16 words in numpy: what the CPU's Numba operators
read in place (the decode step's attention, cpu_ops/sparse_attention.py, and a prefill chunk's,
cpu_ops/chunk_attention.py), for a cache that torch allocated (ktlong/kv/dense_cache.py) or one
allocated here, without torch (ktlong/session/cpu_dense.py)."""

from __future__ import annotations

import numpy as np

BLOCK = 128  # tokens per block of the Numba operator's view: the unit its threads share out


class WordCache:
    def __init__(self, keys: list[np.ndarray], values: list[np.ndarray], max_len: int):
        """keys, values: per layer [KV, tokens, D] uint16 arrays (tokens a multiple of BLOCK,
        at least max_len), written in place by the engines."""
        self.keys, self.values, self.max_len = keys, values, max_len
        num_kv, padded, dim = keys[0].shape
        blocked = (num_kv, padded // BLOCK, BLOCK, dim)
        # [k, v] -> per layer [KV, blocks, BLOCK, D] views: the decode operator's layout
        self.words = [[t.reshape(blocked) for t in layers] for layers in (keys, values)]
        self.every_block = np.tile(np.arange(padded // BLOCK, dtype=np.int32), (num_kv, 1))

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int) -> "WordCache":
        shape = (num_layers, num_kv_heads, padded_length(max_len), head_dim)
        k, v = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
        return cls(list(k), list(v), max_len)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values))

    def block_counts(self, end: int) -> np.ndarray:
        """Per kv head, how many of every_block's blocks hold the first `end` tokens."""
        return np.full(self.every_block.shape[0], -(-end // BLOCK), np.int32)


def padded_length(max_len: int) -> int:
    """Tokens a cache of max_len allocates: whole blocks."""
    return -(-max_len // BLOCK) * BLOCK
