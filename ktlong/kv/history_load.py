"""A follow-up's history, from the DRAM cache into the device pages, a layer at a time.

Before a follow-up's new tokens run through layer l, the layer's pages receive the first
`history` tokens' K/V from DRAM (one DMA per kv head; q8_0 / q4_0 cross quantised, up to
STAGED_TOKENS at a time, and are widened on the device a piece at a time) and the pooled (mean)
keys of their blocks, which the block selector reads. With `prefetch`, two sets of pages and
pooled keys take turns: while layer l computes on one, layer l+1's history loads into the other
on a stream of its own (one more layer of pages on the device). On the CPU the same turns run
one after the other.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

import torch

from ktlong.kv.device_pages import DevicePages
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import KVLayout
from ktlong.kv.pinned import copy_heads
from ktlong.kv.resident import ResidentHistory
from operators.kv_quant import dequantize_kv

Buffers = tuple[DevicePages, torch.Tensor]  # pages, pooled keys [KV, NB, D] float32


STAGED_TOKENS = 65536  # q8_0 / q4_0 history crosses to the device this many tokens at a time


def staging_bytes(layout: KVLayout, history: int) -> int:
    """Device bytes of the buffer quantised history crosses into, and of what widening a piece
    holds besides: its scales as float32, and for q4_0 two byte planes of nibbles (0 for bf16 /
    fp16 caches)."""
    if not layout.is_quantized:
        return 0
    data, words = layout.stored_row
    nibbles = 2 * data if layout.kv_type == "q4_0" else 0
    return layout.num_kv_heads * min(history, STAGED_TOKENS) * (layout.stored_row_bytes + 4 * words + nibbles)


class Staging:
    """Where a piece of quantised history lands on the device, one DMA per head, before it is
    widened into the pages: [KV, STAGED_TOKENS, R] data and [KV, STAGED_TOKENS, D/32] scales."""

    def __init__(self, layout: KVLayout, history: int, device: torch.device):
        tokens = min(history, STAGED_TOKENS)
        data, words = layout.stored_row
        self.data = torch.empty((layout.num_kv_heads, tokens, data), dtype=layout.stored_dtype, device=device)
        self.scales = torch.empty((layout.num_kv_heads, tokens, words), dtype=torch.int16, device=device)


def load_history(layout: KVLayout, host: HostKVCache, layer: int, history: int,
                 pages: DevicePages, pooled_keys: torch.Tensor, staging: Staging | None = None,
                 resident: ResidentHistory | None = None) -> int:
    """Queue layer's first `history` tokens and their blocks' pooled keys into pages and
    pooled_keys on the current stream; returns the bytes that cross to the device. staging:
    for q8_0 / q4_0 on a GPU (on the CPU the host's rows are widened where they lie); resident:
    device copies of some layers' rows, read for the tokens they hold and brought up to date."""
    if resident is not None and layer in resident.rows:
        crossed = _load_resident(layout, host, layer, history, pages, resident)
        _load_pooled_keys(layout, host, layer, history, pooled_keys)
        return crossed
    for which, buf in (("k", pages.k), ("v", pages.v)):
        dst = pages.tokens(buf)
        if not layout.is_quantized:  # one DMA per head, no staging
            copy_heads(dst[:, :history], host.tokens(layer, which, 0, history))
            continue
        for s in range(0, history, STAGED_TOKENS):
            e = min(history, s + STAGED_TOKENS)
            data, scales = host.tokens(layer, which, s, e), host.scale_tokens(layer, which, s, e)
            if staging is not None:  # one DMA per head and plane, reused piece after piece (one stream)
                copy_heads(staging.data[:, :e - s], data)
                copy_heads(staging.scales[:, :e - s], scales)
                data, scales = staging.data[:, :e - s], staging.scales[:, :e - s]
            dequantize_kv(data, scales, layout.kv_type, layout.dtype, out=dst[:, s:e])
    _load_pooled_keys(layout, host, layer, history, pooled_keys)
    return 2 * history * layout.num_kv_heads * layout.stored_row_bytes


def _load_pooled_keys(layout: KVLayout, host: HostKVCache, layer: int, history: int, pooled_keys: torch.Tensor):
    blocks = -(-history // layout.block_size)
    copy_heads(pooled_keys[:, :blocks], host.key_mean[layer][:, :blocks])


def _load_resident(layout: KVLayout, host: HostKVCache, layer: int, history: int, pages: DevicePages,
                   resident: ResidentHistory) -> int:
    """The rows the device copy lacks cross into it (one DMA per head and plane), then the pages
    are widened (q8_0 / q4_0, a staged piece at a time) or copied from it on the device."""
    rows, start = resident.rows[layer], min(resident.valid[layer], history)
    for which, buf in (("k", pages.k), ("v", pages.v)):
        copy_heads(rows[which][:, start:history], host.tokens(layer, which, start, history))
        if layout.is_quantized:
            copy_heads(rows[f"{which}_scales"][:, start:history], host.scale_tokens(layer, which, start, history))
        resident.widen(layer, which, 0, history, pages.tokens(buf)[:, :history], STAGED_TOKENS)
    resident.valid[layer] = history
    return 2 * (history - start) * layout.num_kv_heads * layout.stored_row_bytes


class HistoryLoader:
    def __init__(self, layout: KVLayout, num_layers: int, host: HostKVCache, history: int,
                 own: Buffers, prefetch: bool, streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None,
                 timer: Callable[[], AbstractContextManager], resident: ResidentHistory | None = None):
        """own: the engine's pages and pooled keys; streams: where the engine computes and where
        it copies the pages to DRAM (None on the CPU); timer: times one layer's load; resident:
        layers whose rows the device keeps between turns."""
        self.resident = resident
        self.layout, self.num_layers = layout, num_layers
        self.host, self.history, self.timer = host, history, timer
        self.compute_stream, self.copy_stream = streams or (None, None)
        self.buffers = [own]
        if prefetch:
            pages, pooled = own
            self.buffers.append((DevicePages(layout, pooled.device), torch.zeros_like(pooled)))
        self.device = own[1].device
        on_gpu = self.device.type == "cuda"
        self.staging = Staging(layout, history, self.device) if on_gpu and layout.is_quantized else None
        self.stream = torch.cuda.Stream(self.device) if prefetch and streams is not None else None
        self.bytes_to_device = 0
        self.loaded = self._load(0) if prefetch else None

    def _buffers(self, layer: int) -> Buffers:
        return self.buffers[layer % len(self.buffers)]

    def _load(self, layer: int):
        """Queue layer's history into its buffers. Ahead of time, on the load stream, after
        whatever used those buffers last (the layer two back: its compute and its copies to
        DRAM); returns the event that marks it done (None on the CPU, where it is done)."""
        if self.stream is None:
            self._load_now(layer)
            return None
        self.stream.wait_stream(self.compute_stream)
        self.stream.wait_stream(self.copy_stream)
        with torch.cuda.stream(self.stream):
            self._load_now(layer)
            return self.stream.record_event()

    def _load_now(self, layer: int):
        """Queue layer's history on the current stream, timed."""
        with self.timer():
            self.bytes_to_device += load_history(self.layout, self.host, layer, self.history,
                                                 *self._buffers(layer), self.staging, self.resident)

    def take(self, layer: int) -> Buffers:
        """Layer's pages and pooled keys, loaded (or queued before anything that reads them);
        with prefetch the next layer's load starts here."""
        if len(self.buffers) == 1:
            self._load(layer)
            return self.buffers[0]
        if self.loaded is not None:
            self.compute_stream.wait_event(self.loaded)
        if layer + 1 < self.num_layers:
            self.loaded = self._load(layer + 1)
        return self._buffers(layer)

    def close(self) -> Buffers:
        """The engine's own buffers back; the second set goes once the compute stream is past
        its load and past the copies to DRAM that read the last layer's pages."""
        if self.stream is not None:
            self.compute_stream.wait_stream(self.stream)
            self.compute_stream.wait_stream(self.copy_stream)
        own, self.buffers, self.staging = self.buffers[0], None, None
        return own
