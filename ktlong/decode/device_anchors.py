"""A device copy of the decode anchors, so blocks are scored where memory is fast
(`block_scoring`).

Scoring reads every anchor of every block each token (cpu_ops/block_select.py); that read
grows with the context and, on the CPU, is the part of decode that does. With a copy of the
anchors on the GPU, each global layer's scores are computed right after its q (inside the
CUDA graph when there is one) and only the scores cross to the host, where top-k and the
selection rules (candidates, token_step, layer_step, dense layers) stay. The copy follows the
host anchors: built after prefill, and updated as blocks fill during generation.

Bytes: global layers x kv heads x blocks x anchors per block x head_dim x 2, e.g. 268 MB for
LLaMA-3.1-8B at 512K with one anchor. The blocks are those the conversation can reach (its
prompt and answer room, `Decoder`'s reach), not max_seq_len's: a server's decoders share one pool
of device bytes for their anchors (ktlong/session/anchors_pool.py, sized by memory_plan).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ktlong.decode.selection import DecodeBlockSelector, SelectionSettings
from operators.block_scores import device_block_scores


def scores_on_device(settings: SelectionSettings) -> bool:
    """device: with torch on the model's device, whatever it is; cpu: never (the plan resolves
    auto, ktlong/session/plan.py)."""
    assert settings.block_scoring in ("device", "cpu"), "resolve_selection first"
    return settings.block_scoring == "device"


def _as_bf16(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words).view(np.int16)).view(torch.bfloat16)


class DeviceAnchors:
    def __init__(self, selector: DecodeBlockSelector, layers: list[int], device: torch.device,
                 between: Callable[[], None] = lambda: None, num_blocks: int | None = None):
        """num_blocks: the leading blocks to copy and score (all of the cache's by default);
        between(): called after each layer's copy."""
        self.selector = selector
        self.quest = selector.s.anchor_type == "QUEST"
        self.shared = selector.s.head_select_mode == "SHARED"
        self.num_blocks = len(selector.block_ids) if num_blocks is None else num_blocks
        self.anchors = {}
        for layer in layers:
            self.anchors[layer] = _as_bf16(selector.anchors[layer][:, :self.num_blocks]).to(device)
            between()

    @property
    def num_rows(self) -> int:
        return 1 if self.shared else self.selector.num_kv

    def update(self, layer: int, first: int, last: int):
        """Blocks first..last-1 of the host anchors changed: copy them over."""
        assert last <= self.num_blocks, "a conversation grows within the blocks its decoder was sized for"
        self.anchors[layer][:, first:last].copy_(_as_bf16(self.selector.anchors[layer][:, first:last]))

    def scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [H, D] on the device -> float32 [1 or KV, num_blocks], every block the
        conversation can reach (fixed shape; blocks past the context score against zero anchors
        and are never asked for)."""
        return device_block_scores(q, self.anchors[layer], self.quest, self.shared)
