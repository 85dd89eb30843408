"""Who attends each sequence's query of a global layer to the blocks the host selected from DRAM,
once per global layer and step for the whole batch, between the device's segments
(ktlong/decode/batch.py):

- the device, where the sequence's selection fits its index (`context_attention: gpu`): it reads
  the blocks where they lie in pinned DRAM (ktlong/decode/dram_blocks.py), in a part queued
  first for every sequence at once, so that it reads while the CPU works; its state stays on
  the device;
- the Numba operator otherwise (cpu_ops/sparse_attention.py): `context_attention: cpu`, or a
  dense layer's every block, which does not fit the device's index. Its state (out, lse) goes
  back to the device through the exchange buffers.

When the device also selects the blocks, no host part is left between layers, and the batch
runs the token as one piece of device work instead (DecodeBatch._device_step).
"""

from __future__ import annotations

import numpy as np

from cpu_ops.sparse_attention import sparse_attention

Selection = tuple[np.ndarray, np.ndarray] | None  # blocks [KV, S] and their counts [KV]; None: nothing


class ContextAttention:
    def __init__(self, body, block_size: int, scale: float):
        """body: the batch's device part (ktlong/decode/step.py), whose exchange buffers carry
        each sequence's q in and its state out, and which replays the device's reads."""
        self.body, self.block_size, self.scale = body, block_size, scale
        self.q, self.out, self.lse = body.q_host.numpy(), body.o_host.numpy(), body.lse_host.numpy()

    def attend(self, j: int, layer: int, sequences: list, selections: list[Selection], ends: list[int]) -> list[int]:
        """Global layer j's (model layer `layer`) selections, one per sequence, over contexts of
        `ends` tokens -> how many (kv head, block) pairs of each the CPU read."""
        on_device = [False] * len(sequences)
        if self.body.reads_dram:
            for b, (sequence, selection) in enumerate(zip(sequences, selections)):
                on_device[b] = selection is not None and sequence.dram_blocks.fits(selection[0])
                if on_device[b]:
                    sequence.dram_blocks.split(j, *selection)
                else:
                    sequence.dram_blocks.no_hits(j)
            self.body.replay_dram_blocks(j)  # queued first: the device reads while the CPU works
        read = []
        for b, (sequence, selection, end) in enumerate(zip(sequences, selections, ends)):
            count = 0 if selection is None or on_device[b] else int(selection[1].sum())
            if count:
                self.out[j, b], self.lse[j, b] = sparse_attention(
                    self.q[j, b], sequence.k_stored[layer], sequence.v_stored[layer], *selection, end,
                    self.block_size, self.scale)
            else:
                self.lse[j, b] = -np.inf  # an empty state: the merge keeps the device's
            read.append(count)
        return read
