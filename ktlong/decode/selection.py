"""Which DRAM blocks the CPU attends to at each decode step, for each layer.

Anchors come from the prefill side tables: the mean, max and min keys (MEAN, MAX, QUEST), or
the keys picked per block (DYNAMIC, FIX); they are extended as blocks fill during generation. The first `dense_layer_num` layers read
every context block; other layers select `second_select_num` blocks by anchor score, reselect
every `layer_step` layers and `token_step` tokens (reusing the last selection in between), and,
with `preselect_block`, only among the `preselect_block_count` blocks on which the last prompt
queries put the most attention in prefill (SnapKV's observation window; blocks generated
later are always candidates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from cpu_ops.anchors import anchors_per_block, stored_anchors
from cpu_ops.block_select import QUEST, block_scores, select_blocks
from cpu_ops.kv_storage import StoredKV
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import KEY_ANCHORS

# blocks whose anchors build_all makes between two calls of its `between` (131K tokens at block 128)
BUILD_PIECE = 1024


@dataclass(frozen=True, kw_only=True)
class SelectionSettings:
    """The decode options of ktlong/options.py, same names and types (a test holds them);
    ktlong/session/settings.py builds them from a Config, which holds the values, checked."""
    second_select_num: int
    anchor_type: str
    anchor_num: int
    head_select_mode: str
    dense_layer_num: int
    layer_step: int
    token_step: int
    preselect_block: bool
    preselect_block_count: int
    block_scoring: str  # auto | device | cpu (ktlong/decode/device_anchors.py)
    context_attention: str = "cpu"  # auto | cpu | gpu: the device selects and reads blocks in DRAM (ktlong/decode/dram_blocks.py)

    # ---- the rules of selection, one statement for the host's selector (below) and the device's
    # (ktlong/decode/device_selection.py), which only execute them differently
    def is_dense(self, layer: int) -> bool:
        """The first dense_layer_num layers read every context block."""
        return layer < self.dense_layer_num

    def scores(self, layer: int) -> bool:
        """A sparse layer scores its blocks every layer_step layers; those in between reuse the
        blocks of the last layer that scored."""
        return (layer - self.dense_layer_num) % self.layer_step == 0

    def reselects(self, step: int) -> bool:
        """A step selects anew every token_step tokens; those in between keep the last selection."""
        return step % self.token_step == 0

    def crowded(self, first: int, last: int) -> bool:
        """The context blocks [first, last) outnumber the places: selection (and preselection)
        applies; otherwise every one of them is read."""
        return last - first > self.second_select_num


def stored_view(host: HostKVCache, layer: int, which: str) -> StoredKV:
    """A zero-copy numpy view of one layer's host K or V ([KV, NB, B, R]) for the CPU kernels."""
    kv_type = host.layout.kv_type
    data = host.k[layer] if which == "k" else host.v[layer]
    if kv_type in ("bf16", "fp16"):
        return StoredKV(kv_type, data.view(torch.int16).numpy().view(np.uint16), np.zeros((0,), np.uint16))
    scales = (host.k_scales[layer] if which == "k" else host.v_scales[layer]).numpy().view(np.uint16)
    return StoredKV(kv_type, data.numpy(), scales if host.layout.is_quantized else np.zeros((0,), np.uint16))


def anchor_rows(host: HostKVCache, layer: int, first: int, last: int, anchor_type: str) -> torch.Tensor:
    """The float32 anchors of blocks first..last-1 of one layer, from the prefill's side tables
    -> [KV, blocks, anchors per block, D] (QUEST: its min and max keys)."""
    if anchor_type in ("MAX", "MEAN"):
        return (host.key_max if anchor_type == "MAX" else host.key_mean)[layer][:, first:last, None]
    if anchor_type == "QUEST":
        return torch.stack([host.key_min[layer][:, first:last], host.key_max[layer][:, first:last]], 2)
    return host.anchor_keys[layer][:, first:last]  # the keys prefill (or _block_filled) picked, unquantised


class DecodeBlockSelector:
    def __init__(self, settings: SelectionSettings, host: HostKVCache, num_heads: int, tp=None,
                 host_anchors: bool = True):
        """tp: with tensor parallelism, SHARED scores (sums over kv heads) are summed over the
        ranks' heads too, so that every rank selects the same blocks. host_anchors: keep the
        anchors as bfloat16 words here, to score blocks on the CPU; where the device scores them
        (ktlong/decode/device_anchors.py, which rounds them itself) the host has none."""
        self.s, self.host, self.tp = settings, host, tp
        self.host_anchors = host_anchors
        layout = host.layout
        self.block_size, self.num_kv = layout.block_size, layout.num_kv_heads
        self.num_anchors = anchors_per_block(settings.anchor_type, settings.anchor_num)
        if settings.anchor_type in KEY_ANCHORS:
            assert (layout.anchor_type, layout.anchor_num) == (settings.anchor_type, settings.anchor_num), \
                "the KV layout keeps other anchor keys than decode selects with: build both from one config"
        kept = lambda i: 0 if layout.is_sliding(i) or not host_anchors else layout.num_blocks  # noqa: E731
        self.anchors = [np.zeros((layout.num_kv_heads, kept(i), self.num_anchors, layout.head_dim), np.uint16)
                        for i in range(layout.num_layers)]  # bfloat16 words
        self.candidates: list[np.ndarray | None] = [None] * layout.num_layers  # [KV, NB] bool
        # per layer, what `competing` gives (per kv head, any head's), made once by preselect
        self._competing: list[tuple[np.ndarray, np.ndarray] | None] = [None] * layout.num_layers
        self.prompt_blocks = 0
        self.cache: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # layer -> blocks, counts, step
        self.last_selected_layer = -1
        self.block_ids = np.arange(layout.num_blocks, dtype=np.int32)

    # ---- anchors -----------------------------------------------------------------------
    def build_all(self, num_tokens: int, layers: list[int] | None = None, first_block: int = 0,
                  between: Callable[[], None] = lambda: None):
        """After a prefill of num_tokens: the anchors of blocks first_block.. (the ones that
        prefill wrote; all of them by default), and selection starts over (no preselection, no
        selection kept from earlier steps). between(): called after every BUILD_PIECE blocks
        of a layer (a 1M cache's layer took 0.2-0.3 s on the H200's host beside a prefill).
        Without host anchors, only the selection starts over."""
        num_blocks = -(-num_tokens // self.block_size)
        self.prompt_blocks = num_tokens // self.block_size
        for layer in (range(len(self.anchors)) if layers is None else layers) if self.host_anchors else ():
            for first in range(first_block, num_blocks, BUILD_PIECE):
                self.update_blocks(layer, first, min(first + BUILD_PIECE, num_blocks))
                between()
        self.candidates = [None] * len(self.anchors)
        self._competing = [None] * len(self.anchors)
        self.cache = {}
        self.last_selected_layer = -1

    def update_blocks(self, layer: int, first: int, last: int):
        """(Re)build the anchors of blocks first..last-1 of one layer (where the host keeps them)."""
        if self.host_anchors:
            rows = anchor_rows(self.host, layer, first, last, self.s.anchor_type).numpy()
            stored_anchors(rows, self.s.anchor_type, out=self.anchors[layer][:, first:last])

    # ---- preselection ------------------------------------------------------------------
    def preselect(self, layer: int, block_mass: np.ndarray, first: int, last: int):
        """block_mass: [KV, blocks], the attention mass the last prompt queries put on each block
        (ktlong/prefill.py). Only context blocks [first, last) compete: sinks and the local
        window are attended on the device anyway, and would otherwise win most places."""
        if not self.s.preselect_block:
            return
        total = np.full((self.num_kv, len(self.block_ids)), -np.inf, np.float32)
        total[:, first:last] = block_mass[:, first:last]
        if self.s.head_select_mode == "SHARED":
            shared = np.ascontiguousarray(total[:, first:last].sum(0, keepdims=True))
            total[:, first:last] = self.tp.all_reduce_host(shared) if self.tp is not None else shared
        keep = np.zeros((self.num_kv, len(self.block_ids)), bool)
        count = min(self.s.preselect_block_count, max(last - first, 0))
        top = np.argpartition(-total, count - 1, axis=1)[:, :count] if count else np.zeros((self.num_kv, 0), int)
        np.put_along_axis(keep, top, True, axis=1)
        self.candidates[layer] = keep
        allowed = keep.copy()
        allowed[:, self.prompt_blocks:] = True  # generated blocks always compete
        self._competing[layer] = (allowed, allowed.any(0, keepdims=True))

    def competing(self, layer: int, per_head: bool) -> np.ndarray | None:
        """The blocks that may win after preselection -> [KV, NB] bool per kv head, or [1, NB]
        any head's; None without preselection. Generated blocks always compete. Not to be written."""
        masks = self._competing[layer]
        return None if masks is None else masks[0 if per_head else 1]

    # ---- selection ---------------------------------------------------------------------
    def select(self, layer: int, step: int, q: np.ndarray, first: int, last: int, device_scores=None):
        """Blocks in [first, last) for the CPU to attend to -> (blocks [KV, S] int32, counts [KV]).
        device_scores: None, or a function returning this layer's scores of every block [R, NB]
        computed on the device (ktlong/decode/device_anchors.py), called only if this step scores."""
        s = self.s
        if s.is_dense(layer) or not s.crowded(first, last):
            blocks = np.tile(np.arange(first, last, dtype=np.int32), (self.num_kv, 1))
            return blocks, np.full(self.num_kv, last - first, np.int32)
        cached = self.cache.get(layer)
        if cached is not None and not s.reselects(step):
            return cached[0], cached[1]
        if not s.scores(layer) and self.last_selected_layer in self.cache:
            blocks, counts, _ = self.cache[self.last_selected_layer]
        else:
            blocks, counts = self._score_and_pick(layer, q, first, last, device_scores)
            self.last_selected_layer = layer
        self.cache[layer] = (blocks, counts, step)
        return blocks, counts

    def _score_and_pick(self, layer, q, first, last, device_scores=None):
        """Score the candidate blocks in [first, last) (all of them, or with preselection the
        preselected ones and those generated since the prompt) and keep the best k."""
        shared = self.s.head_select_mode == "SHARED"
        candidates = self.candidates[layer]
        ids = self.block_ids[first:last]
        if candidates is not None:
            ids = ids[self.competing(layer, per_head=False)[0, first:last]]
        if device_scores is not None:
            scores = device_scores()
            scores = scores[:, first:last] if candidates is None else scores[:, ids]
        else:
            scores = block_scores(q, self.anchors[layer], ids, QUEST if self.s.anchor_type == "QUEST" else 0, shared)
        if shared and self.tp is not None:
            scores = self.tp.all_reduce_host(np.ascontiguousarray(scores, dtype=np.float32))
        if candidates is not None and not shared:  # SEPARATE: each head among its own candidates
            scores[~self.competing(layer, per_head=True)[:, ids]] = -np.inf
        k = self.s.second_select_num
        blocks = np.zeros((self.num_kv, max(k, 1)), np.int32)
        counts = np.zeros(self.num_kv, np.int32)
        select_blocks(scores, ids, k, blocks, counts)
        return blocks, counts
