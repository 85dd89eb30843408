"""A contiguous head-major KV cache for plain dense generation (short contexts, references)."""

from __future__ import annotations

import torch


class DenseKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: torch.device, dtype: torch.dtype):
        # k, v: [num_layers, num_kv_heads, max_len, head_dim]
        shape = (num_layers, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v: [T, KV, D] at positions start..start+T; return keys and values so far,
        head-major [KV, start+T, D]."""
        end = start + k.shape[0]
        assert end <= self.max_len, f"KV cache holds {self.max_len} tokens, asked for {end}"
        self.k[layer, :, start:end] = k.transpose(0, 1)
        self.v[layer, :, start:end] = v.transpose(0, 1)
        return self.k[layer, :, :end], self.v[layer, :, :end]
