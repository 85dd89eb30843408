"""A contiguous head-major KV cache for plain dense generation (short contexts, references).

The cache stores K and V in its own dtype, which may be narrower than the model's: on the CPU a
decode step reads the whole cache, so bfloat16 halves what it waits for. A decode step on the CPU
over a bfloat16 cache attends with the Numba operator of cpu_ops/sparse_attention.py, which reads
the words where they lie, every block of the cache selected; everything else widens the keys and
values it reads to the query's dtype and runs the plain torch attention.
"""

from __future__ import annotations

import numpy as np
import torch

from cpu_ops.kv_storage import StoredKV
from cpu_ops.sparse_attention import NO_SCALES, sparse_attention
from ktlong.kv.word_cache import BLOCK, WordCache, padded_length
from operators.dense_attention import dense_attention


class DenseKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: torch.device, dtype: torch.dtype):
        # k, v: [num_layers, num_kv_heads, max_len rounded up to a block, head_dim]
        shape = (num_layers, num_kv_heads, padded_length(max_len), head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.words = None  # on the CPU in bfloat16: the same bytes as a WordCache, for the Numba operators
        if self.k.device.type == "cpu" and dtype == torch.bfloat16:
            self.words = WordCache(*([t[i].view(torch.int16).numpy().view(np.uint16) for i in range(num_layers)]
                                     for t in (self.k, self.v)), max_len)

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v: [T, KV, D] at positions start..start+T (rounded to the cache's dtype);
        return keys and values so far, head-major [KV, start+T, D], in the cache's dtype."""
        end = start + k.shape[0]
        assert end <= self.max_len, f"KV cache holds {self.max_len} tokens, asked for {end}"
        self.k[layer, :, start:end] = k.transpose(0, 1)
        self.v[layer, :, start:end] = v.transpose(0, 1)
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def attention(self, layer: int, q: torch.Tensor, end: int, scale: float, window: int = 0) -> torch.Tensor:
        """Causal attention of q [T, H, D], the queries at positions end-T..end-1, over the
        layer's first `end` cached tokens (dense_attention's semantics) -> [T, H, D] in q's dtype."""
        if self.words is not None and q.shape[0] == 1 and not (window and end > window):
            keys, values = (StoredKV("bf16", w[layer], NO_SCALES) for w in self.words.words)
            out, _ = sparse_attention(q[0].float().numpy(), keys, values, self.words.every_block,
                                      self.words.block_counts(end), end, BLOCK, scale)
            return torch.from_numpy(out).to(q.dtype)[None]
        first = end - window if window and q.shape[0] == 1 and end > window else 0  # one query sees its window only
        keys, values = self.k[layer, :, first:end], self.v[layer, :, first:end]
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return dense_attention(q, keys, values, scale, window)
