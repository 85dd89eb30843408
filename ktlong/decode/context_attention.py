"""Who attends a global layer's query to the blocks the host selected from DRAM, behind one
small interface that the decoder calls once per global layer and step, between the device's
segments (ktlong/decode/decoder.py):

- CpuContextAttention: the Numba operator reads the blocks from DRAM (cpu_ops/sparse_attention.py);
  its state (out, lse) goes back to the device through the exchange buffers;
- GpuContextAttention: the device reads them where they lie in pinned DRAM
  (ktlong/decode/dram_blocks.py), in a part replayed now; its state stays on the device. A dense
  layer's every block does not fit its index: the CPU operator reads those.

When the device also selects the blocks, no host part is left between layers, and the decoder
runs the token as one piece of device work instead (Decoder._device_step).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from cpu_ops.sparse_attention import sparse_attention


class ContextAttention(Protocol):
    def attend(self, j: int, layer: int, blocks: np.ndarray | None, counts: np.ndarray | None, end: int) -> int:
        """Global layer j's (model layer `layer`) selected blocks [KV, S] with their counts [KV]
        (None: nothing selected) of a context of `end` tokens -> how many of them the CPU read."""


class CpuContextAttention:
    def __init__(self, q: np.ndarray, out: np.ndarray, lse: np.ndarray, k_stored: list, v_stored: list,
                 block_size: int, scale: float):
        """q, out, lse: the exchange buffers [global layers, H, ...] (numpy views); k_stored,
        v_stored: every layer's DRAM K and V as the operator reads them."""
        self.q, self.out, self.lse = q, out, lse
        self.k_stored, self.v_stored, self.block_size, self.scale = k_stored, v_stored, block_size, scale

    def attend(self, j: int, layer: int, blocks: np.ndarray | None, counts: np.ndarray | None, end: int) -> int:
        read = int(counts.sum()) if counts is not None else 0
        if not read:
            self.lse[j] = -np.inf  # an empty state: the merge keeps the device's
            return 0
        self.out[j], self.lse[j] = sparse_attention(self.q[j], self.k_stored[layer], self.v_stored[layer], blocks,
                                                    counts, end, self.block_size, self.scale)
        return read


class GpuContextAttention:
    def __init__(self, dram_blocks, body, cpu: CpuContextAttention):
        """dram_blocks: the device's reads of the DRAM pages; body: the decode step, which replays
        them (DecodeStep.replay_dram_blocks); cpu: for what does not fit the device's index."""
        self.dram_blocks, self.body, self.cpu = dram_blocks, body, cpu

    def attend(self, j: int, layer: int, blocks: np.ndarray | None, counts: np.ndarray | None, end: int) -> int:
        on_device = blocks is not None and self.dram_blocks.fits(blocks)
        if on_device:
            self.dram_blocks.split(j, blocks, counts)
        else:
            self.dram_blocks.no_hits(j)
        self.body.replay_dram_blocks(j)  # queued first: the device reads while the CPU works
        return self.cpu.attend(j, layer, None, None, end) if on_device else self.cpu.attend(j, layer, blocks, counts, end)
