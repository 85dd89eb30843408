"""Decode over the DRAM cache, one token at a time: the device attends to the sinks and the
local window, and to blocks selected from the rest, merged by log-sum-exp.

A Decoder is one conversation's decode state: its device window, anchors, selection state
(token_step, layer_step, preselection) and the DRAM cache it reads. Decoders step together in a
batch (ktlong/decode/batch.py): one pass over the weights per step for all of them, each reading
its own blocks; a decoder stepped alone is a batch of one, its own (`step`).

Who reads the selected blocks is the plan's `context_attention`:
- gpu: the device reads them where they lie in pinned DRAM (ktlong/decode/dram_blocks.py), and
  where it also selects them (ktlong/decode/device_selection.py) a token is one piece of device
  work, one CUDA graph;
- cpu (hybrid): per global layer the device computes q/k/v, appends k/v to its window, attends
  to the window and (with `block_scoring` on the device) scores every block, and hands q, k/v
  and the scores to the host (ktlong/decode/step.py); the host writes k/v through to DRAM,
  selects blocks and runs the Numba operator; the next device segment merges the two states.
On a CPU-only machine both parts run on the CPU with the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ktlong.decode.batch import DecodeBatch, WhileWaiting
from ktlong.decode.dram_blocks import DramBlocks
from ktlong.decode.selection import DecodeBlockSelector, SelectionSettings, stored_view
from ktlong.decode.device_anchors import DeviceAnchors, scores_on_device
from ktlong.decode.device_selection import DeviceSelection, selects_on_device
from ktlong.decode.window import DeviceWindow
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import SINK_BLOCKS
from ktlong.kv.memory_plan import decode_anchor_bytes
from ktlong.models.llama import LlamaModel
from operators.block_summary import anchor_keys, block_summaries


@dataclass
class DecodeTimes:
    steps: int = 0
    total: float = 0.0
    cpu_attention: float = 0.0  # the Numba operator (selection excluded)
    selection: float = 0.0
    device_wait: float = 0.0  # waiting for q to reach the host (device work before it)
    block_filled: float = 0.0  # the side tables and anchors of blocks the answer filled (Decoder._block_filled)
    kv_bytes: int = 0  # K/V bytes of the blocks the CPU operator read
    selected: int = 0  # (kv head, block) pairs selected, beyond the window
    device_read: int = 0  # of them, read by the device (`context_attention: gpu`)
    near_read: int = 0  # of those, read from the device's copy of a layer's rows, not over PCIe
    kept_read: int = 0  # of those, read from the blocks kept from the last tokens (where the device selects)


class Decoder:
    def __init__(self, model: LlamaModel, host: HostKVCache, settings: SelectionSettings,
                 local_windows_len: int, use_cuda_graph: bool = False,
                 block_mass: dict[int, np.ndarray] | None = None, resident=None,
                 between: Callable[[], None] = lambda: None, reach_tokens: int | None = None):
        """settings, resolved (ktlong/session/plan.py): context_attention "gpu": the device reads
        every selected block where it lies in DRAM (ktlong/decode/dram_blocks.py); "cpu": the
        Numba operator reads them. block_mass: the prefill's attention mass per global layer and
        block (PrefillStats.block_mass), for preselection. resident: the layers whose rows the
        device keeps between turns (ktlong/kv/resident.py), where the window and the selected
        blocks' reads (`context_attention: gpu`) find them. between(): called between the parts
        of the setup and within its long parts (a 1M cache's took 7-10 s on the H200): a prefill
        beside decoding answers gives the host back to their steps there
        (ktlong/session/sliced_prefill.py). reach_tokens: the most tokens the conversation holds
        before its next prefill (its prompt and its answer's room; the cache's capacity by
        default), for which its device anchors are sized (`anchor_bytes`)."""
        context_attention = settings.context_attention
        assert context_attention in ("cpu", "gpu"), "resolve_selection first (ktlong/session/plan.py)"
        # host seconds of each part of the setup (the server's log names them where it is long)
        self.setup_seconds: dict[str, float] = {}
        since = [time.perf_counter()]

        def done(part: str):
            now = time.perf_counter()
            self.setup_seconds[part] = self.setup_seconds.get(part, 0.0) + now - since[0]
            between()
            since[0] = time.perf_counter()

        self.model, self.host, self.settings = model, host, settings
        layout = host.layout
        self.layout, self.block_size = layout, layout.block_size
        self.reach_tokens = layout.capacity if reach_tokens is None else min(reach_tokens, layout.capacity)
        reach_blocks = -(-self.reach_tokens // layout.block_size)
        self.window = DeviceWindow(layout, local_windows_len, SINK_BLOCKS * layout.block_size, model.device)
        # the global layers' rows of the window's buffers: a filled block's keys in one gather
        self._global_rows = torch.tensor(layout.global_layers, device=model.device)
        self.resident = resident
        self.window.load_from_host(host, resident)
        done("window")
        c = model.config
        assert not c.sliding_window or local_windows_len >= c.sliding_window, "the window must cover sliding layers"
        self.global_layers = layout.global_layers
        self.selector = DecodeBlockSelector(settings, host, c.num_heads, model.tp,
                                            host_anchors=not scores_on_device(settings))
        self.selector.build_all(host.num_tokens, self.global_layers, between=between)
        done("anchors")
        self._preselect(block_mass or {})
        done("preselection")
        # block scores computed on the device from a copy of the anchors (`block_scoring`)
        self.device_anchors = (DeviceAnchors(self.selector, self.global_layers, model.device, between, reach_blocks)
                               if scores_on_device(settings) else None)
        # what the plan counts for them (the anchors' pool: ktlong/session/anchors_pool.py)
        self.anchor_bytes = (decode_anchor_bytes(layout, self.selector.num_anchors, reach_blocks)
                             if self.device_anchors is not None else 0)
        done("device anchors")
        self.k_stored = [stored_view(host, layer, "k") for layer in range(layout.num_layers)]
        self.v_stored = [stored_view(host, layer, "v") for layer in range(layout.num_layers)]
        self.block_bytes = 2 * layout.block_size * self.k_stored[0].nbytes_per_token()  # K and V of one head
        self.step_index = 0
        self.times = DecodeTimes()
        self.cuda = model.device.type == "cuda"
        # the device's reads of the selected blocks in DRAM, and its own selection, which makes a
        # token one piece of device work
        self.dram_blocks = None
        self.selection = None
        if context_attention == "gpu" and settings.second_select_num:
            if selects_on_device(self.selector, self.device_anchors, self.global_layers):
                self.selection = DeviceSelection(self.selector, self.device_anchors, self.global_layers, model.device)
                self.selection.load_candidates()
            # a step names at most every block the cache holds (the evaluation's dense arm asks for more)
            self.dram_blocks = DramBlocks(host, self.global_layers, min(settings.second_select_num,
                                                                        host.layout.num_blocks), model.scale,
                                          model.device, self.selection)
        done("device selection")
        self._resident_seen = None  # the resident.version the selected blocks' reads follow
        self.follow_resident()
        # this conversation stepped alone: a batch of one, with its own body and graphs, kept
        # with the decoder while it is parked (ktlong/session/parked_decoders.py)
        self.alone = DecodeBatch(model, [self], use_cuda_graph and self.cuda)
        done("step buffers")

    @property
    def body(self):
        """The device part of this decoder's steps alone (ktlong/decode/step.py)."""
        return self.alone.body

    def _preselect(self, block_mass: dict[int, np.ndarray]):
        first, last = self.window.context_blocks
        for layer, mass in block_mass.items():
            if layer in self.global_layers:
                self.selector.preselect(layer, mass, first, last)

    @torch.inference_mode()
    def extend(self, first_block: int, block_mass: dict[int, np.ndarray]):
        """A follow-up's prefill rewrote the cache from block first_block on and extended it:
        go on from there as a new decoder would, keeping the device buffers and the captured
        graphs (building and capturing them again is most of a short follow-up's setup). The
        window loads again, the anchors of the rewritten blocks are rebuilt (host and device
        copies), and selection starts over with the new prompt's preselection."""
        self.selector.build_all(self.host.num_tokens, self.global_layers, first_block)
        if self.device_anchors is not None:  # small copies from pageable memory: before the window's DMA
            last = -(-self.host.num_tokens // self.block_size)
            for layer in self.global_layers:  # a layer at a time: a long follow-up's rows are many
                self.device_anchors.update([layer], first_block, last)
        # queued; crosses while the host preselects
        self.window.load_from_host(self.host, self.resident, first_block * self.block_size)
        self._preselect(block_mass)
        if self.selection is not None:
            self.selection.load_candidates()
        if self.dram_blocks is not None:
            self.dram_blocks.forget_kept()
        self.follow_resident()
        self.step_index = 0

    def follow_resident(self):
        """The selected blocks' reads follow the device's copies of layers' rows (resident):
        which layers it holds and how far. The copies change between turns, not within one; a
        body whose captured graphs hold an address the copies no longer have captures them
        again (DecodeStep.ready)."""
        if self.dram_blocks is None or self.resident is None or self.resident.version == self._resident_seen:
            return
        self._resident_seen = self.resident.version
        self.dram_blocks.use_resident(self.resident)

    @torch.inference_mode()
    def capture_graphs(self):
        """Capture the CUDA graphs of this decoder's steps alone now, at the end of prefill, so
        that no decode step pays for it."""
        start = time.perf_counter()
        self.alone.capture_graphs([self])
        self.setup_seconds["graphs"] = time.perf_counter() - start

    @torch.inference_mode()
    def step(self, token_id: int, while_waiting: WhileWaiting | None = None) -> torch.Tensor:
        """Run one token at position host.num_tokens, this conversation alone; return its logits
        [vocab]. while_waiting: DecodeBatch.step's."""
        return self.alone.step([self], [token_id], while_waiting)[0]

    @property
    def position(self) -> int:
        """Where the next token goes."""
        pos = self.host.num_tokens
        assert pos < self.layout.capacity, "the KV cache is full; raise max_seq_len"
        assert pos < self.reach_tokens, "a conversation grows within the tokens its decoder was sized for"
        return pos

    def write_through(self, layer: int, pos: int, kv: np.ndarray, scales: np.ndarray):
        """The new token's K/V of a global layer, [2, KV, R] as DRAM stores them (and their
        scales), into DRAM at pos."""
        b, t = divmod(pos, self.block_size)
        k_dram, v_dram = self.k_stored[layer], self.v_stored[layer]
        k_dram.data[:, b, t], v_dram.data[:, b, t] = kv[0], kv[1]
        if self.layout.is_quantized:
            k_dram.scales[:, b, t], v_dram.scales[:, b, t] = scales[0], scales[1]

    def end_step(self, pos: int, start: float):
        """After the step that wrote pos: the window, the cache and the selection state move on."""
        self.window.advance()
        self.host.advance(1)
        if (pos + 1) % self.block_size == 0:
            self._block_filled(pos // self.block_size)
        self.step_index += 1
        self.times.steps += 1
        self.times.total += time.perf_counter() - start

    def _block_filled(self, block: int):
        """A block completed during generation: its side tables and anchors join selection. Its
        keys cross from the device in one copy for every global layer, and its device anchors go
        back in one: beside a prefill, each copy of a step waits for the copy engines the
        prefill's DRAM writes keep busy."""
        start = time.perf_counter()
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # the write-through copies must have landed
        h, layers = self.host, self.global_layers
        k = self._unquantized_block_keys(block).flatten(0, 1)  # every layer's heads as heads: [L * KV, 1, B, D]
        mean, kmax, kmin = (t.view(len(layers), -1, t.shape[-1]) for t in block_summaries(k, self.block_size))
        anchors = None
        if self.layout.anchor_keys:  # DYNAMIC ranks generated keys by their norm (no prompt query saw them)
            importance = k[:, 0].float().norm(dim=-1) if self.layout.anchor_type == "DYNAMIC" else None
            anchors = anchor_keys(k, self.block_size, self.layout.anchor_type, self.layout.anchor_num, importance)
            anchors = anchors.view(len(layers), -1, *anchors.shape[2:])
        for i, layer in enumerate(layers):
            h.key_mean[layer][:, block], h.key_max[layer][:, block], h.key_min[layer][:, block] = mean[i], kmax[i], kmin[i]
            if anchors is not None:
                h.anchor_keys[layer][:, block] = anchors[i]
            self.selector.update_blocks(layer, block, block + 1)
        if self.device_anchors is not None:
            self.device_anchors.update(self.global_layers, block, block + 1)
        self.times.block_filled += time.perf_counter() - start

    def _unquantized_block_keys(self, block: int) -> torch.Tensor:
        """The keys of a block that just filled, as prefill summarises them: unquantised, [global
        layers, KV, 1, B, D]. With q8_0 / q4_0 in DRAM they come from the device window, which
        holds them in its own type (one gather and one copy), unless the window is shorter than a
        block; otherwise from DRAM, widened."""
        B, window, layers = self.block_size, self.window, self.global_layers
        start = block * B
        if self.layout.is_quantized and start >= window.window_start:
            at = start - window.window_start
            rows = window.k[self._global_rows, :, at:at + B]
            return rows.to("cpu", torch.float32)[:, :, None]
        if self.layout.is_quantized:
            return torch.stack([self.host.unquantized(layer, "k", start, start + B, torch.float32)
                                for layer in layers])[:, :, None]
        return torch.stack([self.host.k[layer][:, block:block + 1] for layer in layers])

