"""The drifting selection (ktlong/bench/drifting_selection.py) where the device selects: decode's
default path on a GPU (ktlong/decode/device_selection.py), so that what a real selection's
overlap from token to token buys (the blocks kept on the device, operators/selected_blocks_kernel.py)
is timed on the 8B shape with random weights.

It is a DeviceSelection's `adjust`: each scoring layer's real selection runs (its cost is
paid), then one small kernel per layer and conversation keeps each of the previous token's blocks with
probability `share` and fills the rest from the real selection's best blocks not kept, in the
real selection's order, per kv head. Layers that reuse another's blocks (layer_step) or read
every block are left as they are. It runs inside the token's CUDA graph: the draws come from a
counter on the device that advances once a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _drift(index_ptr, valid_ptr, previous_ptr, counter_ptr, share, seed, layer, num_layers, width,
           BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """Kv head h: its rows (index) -> the previous token's rows kept at rate `share`, then the
    real rows not kept, in order, up to `width`; the same into previous. A head whose selection
    is not full (fewer blocks than width), or that has no previous token's rows, keeps the real ones."""
    h = tl.program_id(0)
    num_kv = tl.num_programs(0)
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
        self.counter = torch.zeros(1, dtype=torch.int64, device=selection.valid.device)
        self.previous = {j: torch.full_like(selection.index[j], -1) for j, role in enumerate(selection.role)
                         if role == "score"}
        self.first = min(self.previous, default=None)  # the layer whose call starts a token

    def __call__(self, j: int, index: torch.Tensor, valid: torch.Tensor):
        if j == self.first:
            self.counter += 1
        width = index.shape[1]
        _drift[(index.shape[0],)](index, valid, self.previous[j], self.counter, self.share, self.seed, j,
                                  len(self.selection.role), width, BLOCK=self.selection.block_size,
                                  SLOTS=triton.next_power_of_2(width))
