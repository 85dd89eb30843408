"""A device copy of the decode anchors, so blocks are scored where memory is fast
(`block_scoring`).

Scoring reads every anchor of every block each token (cpu_ops/block_select.py); that read
grows with the context and, on the CPU, is the part of decode that does. With a copy of the
anchors on the GPU, each global layer's scores are computed right after its q (inside the
CUDA graph when there is one) and only the scores cross to the host, where top-k and the
selection rules (candidates, token_step, layer_step, dense layers) stay. The anchors are rounded
to bfloat16 here, from the prefill's float32 side tables, as the host rounds its own for CPU
scoring (a 1M cache's at 8B shapes: 1 GiB over PCIe once, where the host's rounding took 6-10 s
inside the server on the H200); built after prefill, and updated as blocks fill during generation.

Bytes: global layers x kv heads x blocks x anchors per block x head_dim x 2, e.g. 268 MB for
LLaMA-3.1-8B at 512K with one anchor. The blocks are those the conversation can reach (its
prompt and answer room, `Decoder`'s reach), not max_seq_len's: a server's decoders share one pool
of device bytes for their anchors (ktlong/session/anchors_pool.py, sized by memory_plan).
"""

from __future__ import annotations

from typing import Callable

import torch

from ktlong.decode.selection import BUILD_PIECE, DecodeBlockSelector, SelectionSettings, anchor_rows
from operators.block_scores import device_block_scores


def scores_on_device(settings: SelectionSettings) -> bool:
    """device: with torch on the model's device, whatever it is; cpu: never (the plan resolves
    auto, ktlong/session/plan.py)."""
    assert settings.block_scoring in ("device", "cpu"), "resolve_selection first"
    return settings.block_scoring == "device"


def rounded_bf16(rows: torch.Tensor, rounding: str) -> torch.Tensor:
    """float32 -> bfloat16 on rows' device, as cpu_ops/bf16.to_bf16 rounds on the host: "nearest"
    (half to even), or "up" / "down" (toward +inf / -inf: QUEST's bounds stay bounds)."""
    if rounding == "nearest":
        return rows.to(torch.bfloat16)
    bits = rows.contiguous().view(torch.int32)
    truncated = bits & -65536  # toward zero: the top 16 bits
    inexact = truncated.view(torch.float32) != rows
    away = inexact & ((rows > 0) == (rounding == "up"))  # one step away from zero, in magnitude
    return ((truncated >> 16) + away.to(torch.int32)).to(torch.int16).view(torch.bfloat16)


class DeviceAnchors:
    def __init__(self, selector: DecodeBlockSelector, layers: list[int], device: torch.device,
                 between: Callable[[], None] = lambda: None, num_blocks: int | None = None):
        """The anchors of the blocks the cache holds, from the prefill's side tables (float32),
        rounded to bfloat16 here on the device as the host would round them (the selector keeps
        none of its own). num_blocks: the leading blocks to hold and score (all of the cache's
        by default); between(): called after every BUILD_PIECE blocks of a layer."""
        self.selector = selector
        self.quest = selector.s.anchor_type == "QUEST"
        self.shared = selector.s.head_select_mode == "SHARED"
        self.num_blocks = len(selector.block_ids) if num_blocks is None else num_blocks
        self.device = device
        layout = selector.host.layout
        held = min(-(-selector.host.num_tokens // layout.block_size), self.num_blocks)
        self.anchors = {}
        for layer in layers:
            self.anchors[layer] = torch.zeros((layout.num_kv_heads, self.num_blocks, selector.num_anchors,
                                               layout.head_dim), dtype=torch.bfloat16, device=device)
            for first in range(0, held, BUILD_PIECE):
                self.update([layer], first, min(first + BUILD_PIECE, held))
                between()

    @property
    def num_rows(self) -> int:
        return 1 if self.shared else self.selector.num_kv

    def update(self, layers: list[int], first: int, last: int):
        """Blocks first..last-1 of these layers' side tables changed: round them again (the
        layers' rows cross to the device in one copy)."""
        assert last <= self.num_blocks, "a conversation grows within the blocks its decoder was sized for"
        kind = self.selector.s.anchor_type
        parts = [anchor_rows(self.selector.host, layer, first, last, kind) for layer in layers]
        # one layer (the setup's pieces): its rows go as they lie, with no copy on the host first
        rows = (parts[0][None] if len(parts) == 1 else torch.stack(parts)).to(self.device)  # [layers, KV, n, A, D]
        rows = (torch.stack([rounded_bf16(rows[:, :, :, 0], "down"), rounded_bf16(rows[:, :, :, 1], "up")], 3)
                if self.quest else rounded_bf16(rows, "nearest"))  # every layer's at once
        for layer, r in zip(layers, rows):
            self.anchors[layer][:, first:last] = r

    def scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [H, D] on the device -> float32 [1 or KV, num_blocks], every block the
        conversation can reach (fixed shape; blocks past the context score against zero anchors
        and are never asked for)."""
        return device_block_scores(q, self.anchors[layer], self.quest, self.shared)
