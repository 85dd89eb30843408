"""The drifting selection (ktlong/bench/drifting_selection.py) where the device selects: decode's
default path on a GPU (ktlong/decode/device_selection.py), so that what a real selection's
overlap from token to token buys (the blocks kept on the device, operators/selected_blocks_kernel.py)
is timed on the 8B shape with random weights.

It is a DeviceSelection's `adjust`: each scoring layer's real selection runs (its cost is
paid), then one small kernel per layer for the batch keeps each of the previous token's blocks
with probability `share` and fills the rest from the real selection's best blocks not kept, in
the real selection's order, per kv head of each conversation (a launch per conversation, on
streams of their own, were eight small kernels and their joins a layer at batch 8). Layers that
reuse another's blocks (layer_step) or read every block are left as they are. It runs inside
the token's CUDA graph: the draws come from a counter on the device that advances once a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.member_tables import device_table, gaps


@triton.jit
def _drift(members_ptr, index_ptr, valid_ptr, previous_ptr, counter_ptr, share, layer, num_layers,
           BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """Member b's kv head h: its rows (index) -> the previous token's rows kept at rate `share`,
    then the real rows not kept, in order, up to its width; the same into previous. A head whose
    selection is not full (fewer blocks than width), or that has no previous token's rows, keeps
    the real ones. Member b's index, valid, previous and counter lie at members[b] from member
    0's (in elements), then its seed and its width."""
    h, b = tl.program_id(0), tl.program_id(1)
    num_kv = tl.num_programs(0)
    row = members_ptr + b * 6
    index_ptr += tl.load(row)
    valid_ptr += tl.load(row + 1)
    previous_ptr += tl.load(row + 2)
    counter_ptr += tl.load(row + 3)
    seed, width = tl.load(row + 4), tl.load(row + 5)
    i = tl.arange(0, SLOTS)
    real = i < width
    now = tl.load(index_ptr + h * width + i, mask=real, other=-1)
    before = tl.load(previous_ptr + h * width + i, mask=real, other=-1)
    full = tl.load(valid_ptr + h) // BLOCK >= width
    had = tl.min(tl.where(real, before, 0)) >= 0
    draw = ((tl.load(counter_ptr) * num_layers + layer) * num_kv + h) * SLOTS + i
    keep = real & (tl.rand(seed, draw.to(tl.uint32)) < share)
    kept = tl.sum(keep.to(tl.int32))
    in_kept = tl.max(((now[:, None] == before[None, :]) & keep[None, :]).to(tl.int32), 1) > 0
    candidate = real & ~in_kept
    rank = tl.cumsum(candidate.to(tl.int32), 0)  # 1 for the first candidate
    take = candidate & (rank <= width - kept)
    at_keep = tl.cumsum(keep.to(tl.int32), 0) - 1
    from_before = tl.max(tl.where(keep[None, :] & (at_keep[None, :] == i[:, None]), before[None, :], -1), 1)
    from_now = tl.max(tl.where(take[None, :] & (kept + rank[None, :] - 1 == i[:, None]), now[None, :], -1), 1)
    drifted = tl.where(full & had, tl.maximum(from_before, from_now), now)
    tl.store(index_ptr + h * width + i, drifted, mask=real)
    tl.store(previous_ptr + h * width + i, drifted, mask=real)


class DeviceDrift:
    def __init__(self, selection, share: float, seed: int = 0):
        """selection: a DeviceSelection; this drifts each of its scoring layers' selections once
        made (assign this object to its `adjust`)."""
        assert 0.0 <= share <= 1.0, share
        self.selection, self.share, self.seed = selection, share, seed
        self.counter = torch.zeros(1, dtype=torch.int64, device=selection.valid[0].device)
        self.previous = {j: torch.full_like(selection.index[j], -1) for j, role in enumerate(selection.role)
                         if role == "score"}
        self.first = min(self.previous, default=None)  # the layer whose call starts a token
        self.tables: dict = {}  # the batch kernel's tables, by the members' addresses (kept while graphs live)

    def __call__(self, selections: list, j: int):
        """Global layer j's rows of a batch's selections (this drift's the first of them, each
        with its own as `adjust`), drifted in one launch."""
        drifts = [s.adjust for s in selections]
        assert all(d.share == self.share for d in drifts), "one batch: one share kept"
        if j == self.first:
            for d in drifts:
                d.counter += 1
        index, valid = [s.index[j] for s in selections], [s.valid[j] for s in selections]
        previous, counters = [d.previous[j] for d in drifts], [d.counter for d in drifts]
        widths = [i.shape[1] for i in index]
        key = tuple(t.data_ptr() for t in (*index, *valid, *previous, *counters))
        if key not in self.tables:  # made in the warm-up run before a capture, which cannot copy to the device
            self.tables[key] = device_table([gaps(index), gaps(valid), gaps(previous), gaps(counters),
                                             [d.seed for d in drifts], widths], index[0].device)
        members = self.tables[key]
        _drift[(index[0].shape[0], len(selections))](members, index[0], valid[0], previous[0], counters[0],
                                                     self.share, j, len(self.selection.role),
                                                     BLOCK=self.selection.block_size,
                                                     SLOTS=triton.next_power_of_2(max(widths)))
