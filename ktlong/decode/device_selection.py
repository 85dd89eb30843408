"""Decode block selection on the device, so that a token with `context_attention: gpu` is one
piece of device work with no host round trip per layer.

With the GPU reading the selected blocks from DRAM itself (ktlong/decode/dram_blocks.py), the
host's only remaining part of a global layer is the top-k: it waits for the layer's scores, picks
the blocks and hands them back, 32 times a token at 8B shapes (20 ms of waiting per token at
128K, most of it the device idling while the host catches up). Here the same rules run in
fixed-shape torch ops right after the scores (captured with the rest of the token in one CUDA
graph when graphs are on):

- blocks outside the DRAM context [first, last) never win; with preselection, the prompt blocks
  preselection did not keep never win either (generated blocks always compete), unless the
  context holds no more than second_select_num blocks, when all of them are read (as the host);
- the best second_select_num blocks by score (one shared row for every kv head, or per head),
  the count of those that can win, in score order (the kernel reads the first `count`);
- the first dense_layer_num layers read every context block; with layer_step, the layers in
  between reuse the last scoring layer's blocks; with token_step, a step that does not
  reselect keeps the blocks of the last one that did (`fresh`, set by the host each step).

The blocks are those the host's selector (ktlong/decode/selection.py) picks from the same scores;
only the order within a selection (and so the float32 sum's) differs. A batch's conversations
select together (`select_batch`): on a GPU a scoring layer is three kernel launches for all of
them (scores, top-k, rows: operators/block_scores_kernel.py, operators/block_topk_kernel.py),
each conversation's anchors, mask and step found by their offsets from the first one's. Under tensor parallelism
each rank scores its own kv heads' anchors and SHARED scores are summed over the ranks here, on
the device (an all-reduce inside the token's graph), so that every rank picks the same blocks.
What the host cannot hand over it keeps: a layer_step whose first sparse layer does not score
takes the previous token's last selection, so that stays on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from ktlong.decode.device_anchors import DeviceAnchors
from ktlong.decode.selection import DecodeBlockSelector
from ktlong.kv.pinned import PinnedTensors
from operators import triton_installed
from operators.member_tables import MemberTables


def selects_on_device(selector: DecodeBlockSelector, anchors: DeviceAnchors | None, global_layers: list[int]) -> bool:
    """Whether device selection reproduces the host's for these settings (see the module's doc)."""
    s = selector.s
    if anchors is None or not s.second_select_num:
        return False
    sparse = [layer for layer in global_layers if not s.is_dense(layer)]
    return not sparse or s.scores(sparse[0])


class DeviceSelection:
    def __init__(self, selector: DecodeBlockSelector, anchors: DeviceAnchors, global_layers: list[int],
                 device: torch.device):
        s = selector.s
        self.selector, self.anchors, self.settings = selector, anchors, s
        self.num_kv, self.block_size = selector.num_kv, selector.block_size
        # blocks scored: those the conversation can reach (its anchors'); the DRAM table's rows
        # are per kv head of all the cache's blocks
        self.num_blocks = NB = anchors.num_blocks
        self.table_blocks = len(selector.block_ids)
        self.k = s.second_select_num  # more than the cache holds: all of them (the host's rule too)
        self.places = min(self.k, NB)  # top-k's width
        # per global layer: "dense", "score", or the index j of the layer whose blocks it reuses
        self.role: list[str | int] = []
        scoring = None
        for j, layer in enumerate(global_layers):
            if s.is_dense(layer):
                self.role.append("dense")
            elif not s.scores(layer) and scoring is not None:
                self.role.append(scoring)
            else:
                self.role.append("score")
                scoring = j
        self.layers = global_layers
        # the pages each layer reads: rows h * table_blocks + block of the head-major DRAM table,
        # and the tokens that count per kv head; kept between steps (token_step reuses them)
        width = [NB if role == "dense" else self.places for role in self.role]
        self.index = [torch.zeros((self.num_kv, w), dtype=torch.int64, device=device) for w in width]
        self.valid = torch.zeros((len(global_layers), self.num_kv), dtype=torch.int64, device=device)
        self.head_rows = (torch.arange(self.num_kv, device=device) * self.table_blocks)[:, None]
        self.blocks = torch.arange(NB, device=device)
        # 0 for a block that may win, -inf for a prompt block preselection left out, per layer
        self.bias = torch.zeros((len(global_layers), anchors.num_rows, NB), device=device)
        # [first, last, fresh] of the step, written by the host before the device work; and the
        # tokens each layer read, for the decoder's counts
        self._pinned = pinned = PinnedTensors(device.type == "cuda")  # unpinned when this goes
        self._params_host = pinned.pin(torch.zeros(3, dtype=torch.int64))
        self.params = torch.zeros(3, dtype=torch.int64, device=device)
        self.has_selection = False
        # the Triton kernels (scores, top-k, rows: select_batch) on a GPU where triton is installed
        # and the anchors are linear; else torch's ops, one conversation at a time
        self.kernel = _kernels_apply(anchors, selector, device)
        # applied to each scoring layer's selection after it is made, on the device, as
        # adjust(selections of the batch, j) (the first's, for all): the bench's drifting
        # selection (ktlong/bench/device_drift.py); None in use
        self.adjust = None

    def load_candidates(self):
        """After build_all and preselect: the preselection mask of every layer to the device."""
        for j, layer in enumerate(self.layers):
            allowed = self.selector.competing(layer, per_head=not self.anchors.shared)
            if allowed is None:
                self.bias[j].zero_()
                continue
            bias = np.where(allowed[:, :self.num_blocks], 0.0, -np.inf).astype(np.float32)
            self.bias[j].copy_(torch.from_numpy(bias))
        self.has_selection = False

    def set_step(self, step: int, first: int, last: int):
        """The host's part of a step: the context range and whether this step reselects."""
        fresh = self.settings.reselects(step) or not self.has_selection
        self._params_host.copy_(torch.tensor([first, last, int(fresh)]))
        self.params.copy_(self._params_host, non_blocking=True)
        self.has_selection = self.has_selection or self.settings.crowded(first, last)

    def select(self, j: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global layer j's selection from q [H, D] -> (rows [KV, S], valid tokens [KV]), fixed
        shapes, no sync (captured)."""
        role = self.role[j]
        if isinstance(role, int):
            self.valid[j].copy_(self.valid[role])
            return self.index[role], self.valid[j]
        first, last = self.params[0], self.params[1]
        if role == "dense":
            blocks = (first + self.blocks).clamp(max=self.num_blocks - 1)
            self.index[j].copy_(self.head_rows + blocks)
            self.valid[j].copy_(((last - first).clamp(min=0) * self.block_size).expand(self.num_kv))
            return self.index[j], self.valid[j]
        scores = self.anchors.scores(self.layers[j], q)  # [R, NB]: torch's ops (the kernels: select_batch)
        inside = (self.blocks >= first) & (self.blocks < last)
        crowded = (last - first) > self.k  # SelectionSettings.crowded, on device values
        bias = torch.where(crowded, self.bias[j], torch.zeros_like(self.bias[j]))
        scores = torch.where(inside, scores + bias, torch.full_like(scores, float("-inf")))
        if self.anchors.shared and self.selector.tp is not None:  # every rank's heads: the same blocks on each
            self.selector.tp.all_reduce(scores)
        top, picked = torch.topk(scores, self.places, dim=1)  # best first: the kernel reads the first count
        fresh = self.params[2].bool()
        count = (top > float("-inf")).sum(1)
        if picked.shape[0] == 1:
            picked, count = picked.expand(self.num_kv, -1), count.expand(self.num_kv)
        self.index[j].copy_(torch.where(fresh, self.head_rows + picked, self.index[j]))
        self.valid[j].copy_(torch.where(fresh, count * self.block_size, self.valid[j]))
        if self.adjust is not None:
            self.adjust([self], j)
        return self.index[j], self.valid[j]


def select_batch(selections: list[DeviceSelection], j: int, q: torch.Tensor, tables: MemberTables | None = None,
                 lanes: list = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global layer j's selection of every conversation of a batch (one selection plan: the same
    role per layer), q [B, H, D] -> each one's (rows [KV, S_b], valid tokens [KV]). Where the
    kernels apply and the layer scores, three launches for the batch: the scores of every
    member's blocks (its anchors as long as its own reach; -inf past them), the top-k of every
    row together, and each member's rows (then the first's `adjust`, for all); tables: the
    batch's store of its tables (operators/member_tables.py). Otherwise each
    conversation's own `select`, on lanes[b % len(lanes)] when CUDA streams are given (a few
    small kernels each: side by side). Fixed shapes, no sync."""
    first = selections[0]
    if first.role[j] != "score" or not all(s.kernel for s in selections):
        return _on_lanes([lambda b=b, s=s: s.select(j, q[b]) for b, s in enumerate(selections)], q.device, lanes)
    from operators import block_topk_kernel
    from operators.block_scores_kernel import masked_block_scores, selection_rows

    layer = first.layers[j]
    scores = masked_block_scores(q, [s.anchors.anchors[layer].view(s.num_kv, s.num_blocks, -1) for s in selections],
                                 [s.bias[j] for s in selections], [s.params for s in selections], first.k,
                                 first.anchors.shared, first.anchors.quest, tables)  # [B, R, most blocks]
    if first.anchors.shared and first.selector.tp is not None:  # every rank's heads: the same blocks on each
        first.selector.tp.all_reduce(scores)
    batch, rows, most = scores.shape
    places = max(s.places for s in selections)  # each member's first places_b: its own top-k (-inf pads the rest)
    flat = scores.view(batch * rows, most)
    top, picked = (block_topk_kernel.block_topk(flat, places) if block_topk_kernel.kernel_applies(most, places)
                   else torch.topk(flat, places, dim=1))
    selection_rows(top.view(batch, rows, places), picked.view(batch, rows, places), [s.params for s in selections],
                   [s.index[j] for s in selections], [s.valid[j] for s in selections],
                   [s.table_blocks for s in selections], first.block_size, tables)
    if first.adjust is not None:
        first.adjust(selections, j)
    return [(s.index[j], s.valid[j]) for s in selections]


def _on_lanes(calls: list, device: torch.device, lanes: list = ()) -> list:
    """Each call's result, call b queued on lanes[b % len(lanes)] when CUDA streams are given
    (joined to the current stream before and after), else in turn."""
    if not lanes:
        return [call() for call in calls]
    main = torch.cuda.current_stream(device)
    for lane in lanes:
        lane.wait_stream(main)
    results = []
    for b, call in enumerate(calls):
        with torch.cuda.stream(lanes[b % len(lanes)]):  # a conversation keeps its lane: its steps stay in order
            results.append(call())
    for lane in lanes:
        main.wait_stream(lane)
    return results


def _kernels_apply(anchors: DeviceAnchors, selector: DecodeBlockSelector, device: torch.device) -> bool:
    """Whether the Triton kernels select (select_batch): on a GPU where triton is installed, the
    anchors linear (one per block, or QUEST's pair)."""
    if device.type != "cuda" or not triton_installed():
        return False
    from operators.block_scores_kernel import kernel_applies

    return kernel_applies(selector.num_anchors, anchors.quest, selector.host.layout.head_dim)
