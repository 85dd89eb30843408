"""The decode-time KV kept on the compute device: sink blocks plus a sliding local window.

Per layer: K/V of the first `sink_tokens` tokens and of positions window_start..end, where
window_start is block-aligned and at most `local_windows_len + block_size` tokens back. Tokens
that slide out are already in DRAM (every new token is written through), and the CPU
operator attends to them from there. The sink sits in front of the window in one buffer,
so the device attends to one contiguous view.
"""

from __future__ import annotations

import torch

from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import KVLayout
from ktlong.kv.pinned import copy_heads
from operators.kv_quant import dequantize_kv


class DeviceWindow:
    def __init__(self, layout: KVLayout, local_windows_len: int, sink_tokens: int, device: torch.device):
        assert sink_tokens % layout.block_size == 0
        self.layout, self.device = layout, device
        self.block_size = layout.block_size
        self.local_windows_len = local_windows_len
        self.sink_tokens = sink_tokens
        self.capacity = local_windows_len + 2 * layout.block_size
        # [:, :, :sink_tokens] is the sink, [:, :, sink_tokens:] the window
        shape = (layout.num_layers, layout.num_kv_heads, sink_tokens + self.capacity, layout.head_dim)
        self.buf_k = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.buf_v = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.sink_k, self.sink_v = self.buf_k[:, :, :sink_tokens], self.buf_v[:, :, :sink_tokens]
        self.k, self.v = self.buf_k[:, :, sink_tokens:], self.buf_v[:, :, sink_tokens:]
        self.window_start = 0  # absolute position of self.k[:, :, 0]
        self.end = 0  # tokens in the cache

    def first_window_position(self, end: int) -> int:
        """Block-aligned start that keeps at least local_windows_len on the device."""
        return max(end - self.local_windows_len, 0) // self.block_size * self.block_size

    def load_from_host(self, host: HostKVCache, resident=None, unchanged: int = 0):
        """After prefill: copy the sink tokens and the window of every layer to the device.
        resident: the layers whose rows the device keeps between turns (ktlong/kv/resident.py),
        read there. unchanged: leading tokens whose rows the buffers already hold (a follow-up
        rewrote the cache after them); the sink stays when it lies within them."""
        end = host.num_tokens
        self.end = end
        self.window_start = self.first_window_position(end)
        n, sinks = end - self.window_start, min(self.sink_tokens, end)
        load_sink = unchanged < sinks
        for layer in range(self.layout.num_layers):
            for which, window, sink in (("k", self.k, self.sink_k), ("v", self.v, self.sink_v)):
                self._load(window[layer, :, :n], host, resident, layer, which, self.window_start, end)
                if load_sink and not self.layout.is_sliding(layer):  # sliding layers never read the sink
                    self._load(sink[layer, :, :sinks], host, resident, layer, which, 0, sinks)

    def _load(self, dst: torch.Tensor, host: HostKVCache, resident, layer: int, which: str, start: int, end: int):
        """q8_0 / q4_0 widen on the device: the quantised bytes cross, the window holds dtype. A
        resident layer is read where the device keeps it."""
        if resident is not None and layer in resident.rows and resident.valid[layer] >= end:
            resident.widen(layer, which, start, end, dst)
            return
        data = host.tokens(layer, which, start, end)
        if not self.layout.is_quantized:
            copy_heads(dst, data)
            return
        scales = host.scale_tokens(layer, which, start, end)
        if self.device.type != "cpu":  # the quantised rows cross, head by head
            data, scales = _on_device(data, self.device), _on_device(scales, self.device)
        dequantize_kv(data, scales, self.layout.kv_type, self.layout.dtype, out=dst)

    def advance(self):
        self.end += 1
        if self.end - self.window_start >= self.capacity:  # slide by one block
            B = self.block_size
            n = self.end - self.window_start - B
            self.k[:, :, :n] = self.k[:, :, B:B + n].clone()
            self.v[:, :, :n] = self.v[:, :, B:B + n].clone()

            self.window_start += B

    def layer_buffers(self, layer: int):
        """The whole sink + window buffer of one layer: [KV, sink + capacity, D] views."""
        return self.buf_k[layer], self.buf_v[layer]

    def copy_to_sink(self, position: int):
        """After a step whose token was written to the window only (graph replay): a position
        inside the sink joins the sink as well, every layer."""
        if position < self.sink_tokens:
            i = self.sink_tokens + position - self.window_start
            self.buf_k[:, :, position] = self.buf_k[:, :, i]
            self.buf_v[:, :, position] = self.buf_v[:, :, i]

    @property
    def context_blocks(self) -> tuple[int, int]:
        """Blocks [first, last) that live only in DRAM: after the sinks, before the window."""
        first = -(-min(self.sink_tokens, self.window_start) // self.block_size)
        return first, self.window_start // self.block_size


def _on_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty(rows.shape, dtype=rows.dtype, device=device)
    copy_heads(out, rows)
    return out
