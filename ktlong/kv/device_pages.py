"""One layer of K/V pages on the compute device, reused layer after layer by prefill."""

from __future__ import annotations

import torch

from ktlong.kv.layout import KVLayout


class DevicePages:
    """One layer's K/V pages on the compute device, reused layer after layer."""

    def __init__(self, layout: KVLayout, device: torch.device):
        shape = (layout.num_kv_heads, layout.num_blocks, layout.block_size, layout.head_dim)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.layout = layout

    def tokens(self, which: torch.Tensor) -> torch.Tensor:
        # [KV, num_blocks, block_size, D] -> [KV, capacity, D], a view
        return which.view(which.shape[0], -1, which.shape[-1])

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: [T, KV, D] at positions start..start+T."""
        end = start + k.shape[0]
        self.tokens(self.k)[:, start:end] = k.transpose(0, 1)
        self.tokens(self.v)[:, start:end] = v.transpose(0, 1)
