"""The head-major KV cache: one layer of pages on the compute device, every layer in DRAM.

Per layer, K and V are [num_kv_heads, num_blocks, block_size, head_dim] on both sides, so a
(kv head, block) pair is one contiguous page and a chunk of one head is one contiguous range.
DRAM holds per-block side tables next to the blocks: mean, max and min keys (Quest) and the
per-token prefill importance that DYNAMIC anchors use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def layer_bytes(self) -> int:
        """K and V of one layer."""
        return 2 * self.num_kv_heads * self.capacity * self.head_dim * self.dtype.itemsize

    def side_table_bytes(self) -> int:
        """Side tables of one layer: mean, max, min keys (float32) and token importance (float32)."""
        per_block = 3 * self.head_dim * 4 + self.block_size * 4
        return self.num_kv_heads * self.num_blocks * per_block


def kv_layout(num_layers, num_kv_heads, head_dim, block_size, max_seq_len, kv_type) -> KVLayout:
    if kv_type not in KV_DTYPES:
        from ktlong.errors import ConfigError

        raise ConfigError(f"kv_type '{kv_type}' is stored by the decode operator, not by prefill yet; "
                          "use --set kv_type=bf16 or fp16.")
    num_blocks = -(-max_seq_len // block_size)
    return KVLayout(num_layers, num_kv_heads, head_dim, block_size, num_blocks, KV_DTYPES[kv_type])


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


class HostKVCache:
    """Every layer's K/V and side tables in DRAM (pinned when a GPU will copy into it)."""

    def __init__(self, layout: KVLayout, pin: bool):
        L, H, N, B, D = (layout.num_layers, layout.num_kv_heads, layout.num_blocks,
                         layout.block_size, layout.head_dim)

        def alloc(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.layout = layout
        self.k = [alloc((H, N, B, D), layout.dtype) for _ in range(L)]
        self.v = [alloc((H, N, B, D), layout.dtype) for _ in range(L)]
        self.key_mean = alloc((L, H, N, D), torch.float32)
        self.key_max = alloc((L, H, N, D), torch.float32)
        self.key_min = alloc((L, H, N, D), torch.float32)
        self.importance = alloc((L, H, N, B), torch.float32)
        self.num_tokens = 0
