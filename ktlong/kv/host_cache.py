"""Every layer's K/V in DRAM, head-major like the device pages, with per-block side tables:
mean, max and min keys (Quest) and the per-token prefill importance that DYNAMIC anchors use."""

from __future__ import annotations

import numpy as np
import torch

from ktlong.kv.layout import KVLayout
from ktlong.kv.pinned import PinnedTensors, advise_huge_pages


class HostKVCache:
    """Every layer's K/V and side tables in DRAM (pinned when a GPU will copy into it).

    k[layer], v[layer]: [KV, blocks, B, D]; block 0 is absolute block first_block[layer]
    (0 for global layers; the start of the kept tail for sliding layers). Side tables are
    per layer, [KV, NB, D] and [KV, NB, B]; empty for sliding layers.
    """

    def __init__(self, layout: KVLayout, pin: bool):
        H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
        self._pinned = PinnedTensors()

        def alloc(shape, dtype):
            t = torch.empty(shape, dtype=dtype)
            advise_huge_pages(t)  # before the first touch, which zero_ is
            t.zero_()
            return self._pinned.pin(t) if pin else t

        self.layout = layout
        blocks = [layout.blocks_in_dram(i) for i in range(layout.num_layers)]
        tables = [0 if layout.is_sliding(i) else layout.num_blocks for i in range(layout.num_layers)]
        self.k = [alloc((H, n, B, D), layout.dtype) for n in blocks]
        self.v = [alloc((H, n, B, D), layout.dtype) for n in blocks]
        self.key_mean = [alloc((H, n, D), torch.float32) for n in tables]
        self.key_max = [alloc((H, n, D), torch.float32) for n in tables]
        self.key_min = [alloc((H, n, D), torch.float32) for n in tables]
        self.importance = [alloc((H, n, B), torch.float32) for n in tables]
        self.first_block = [0] * layout.num_layers
        self.num_tokens = 0  # tokens held; changed only by advance() and reset()
        # global layer -> [KV, blocks] float32: attention mass the last prompt queries put on each
        # block, measured by prefill, read by decode's preselection
        self.prompt_block_mass: dict[int, np.ndarray] = {}

    def advance(self, num_new: int):
        """num_new more tokens are in the cache (their K/V and side tables written)."""
        assert self.num_tokens + num_new <= self.layout.capacity, "the KV cache is full; raise max_seq_len"
        self.num_tokens += num_new

    def reset(self):
        self.num_tokens = 0
        self.prompt_block_mass = {}

    def place_tails(self, num_tokens: int):
        """Before a prefill of num_tokens: sliding layers keep the blocks that end the prompt."""
        end_block = -(-num_tokens // self.layout.block_size)
        for layer in range(self.layout.num_layers):
            if self.layout.is_sliding(layer):
                self.first_block[layer] = max(0, end_block - self.layout.sliding_blocks)

    def first_token(self, layer: int) -> int:
        return self.first_block[layer] * self.layout.block_size

    def tokens(self, layer: int, which: str, start: int, end: int) -> torch.Tensor:
        """K ("k") or V ("v") of absolute positions start..end: a [KV, end-start, D] view."""
        t = self.k[layer] if which == "k" else self.v[layer]
        base = self.first_token(layer)
        assert base <= start <= end <= base + t.shape[1] * t.shape[2], (layer, start, end, base)
        return t.view(t.shape[0], -1, t.shape[-1])[:, start - base:end - base]
