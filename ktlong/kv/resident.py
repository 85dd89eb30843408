"""Some layers' history kept on the device between turns, as DRAM stores it.

A follow-up moves every layer's history from DRAM to the device, and that crossing is most of
its time (at 128K, 9 GB of q8_0 take 0.19 s over PCIe on the H100). Memory the plan leaves free
beside the decoder can hold some layers' stored rows (int8 and scales for q8_0 / q4_0, the
values themselves for bf16 / fp16), filled as they are prefilled (or by the first follow-up's
load): a follow-up then reads those layers on the device, and only the rows decode added since
(the last answer) cross.

A token's stored row never changes once written, so the copy of a layer stays valid up to
`valid[layer]` tokens; the host cache cuts that where it is cut itself (a new prompt, an edited
conversation, a loaded file), so a copy never outlives the rows it was made from.
"""

from __future__ import annotations

import torch

from ktlong.kv.layout import KVLayout
from operators.kv_quant import dequantize_kv


def resident_layer_bytes(layout: KVLayout) -> int:
    """Device bytes of one layer's K and V rows for the whole capacity, as stored."""
    return 2 * layout.num_kv_heads * layout.capacity * layout.stored_row_bytes


class ResidentHistory:
    def __init__(self, layout: KVLayout, device: torch.device):
        self.layout, self.device = layout, device
        self.rows: dict[int, dict[str, torch.Tensor]] = {}  # layer -> {"k", "v", "k_scales", "v_scales"}
        self.valid: dict[int, int] = {}  # layer -> leading tokens whose rows the copy holds
        # changes whenever the layers held or their valid rows do: a decoder that reads the
        # copies (ktlong/decode/dram_blocks.py) looks at them again before its next step
        self.version = 0

    @property
    def layers(self) -> list[int]:
        return sorted(self.rows)

    @property
    def nbytes(self) -> int:
        """Device bytes of the layers held."""
        return len(self.rows) * resident_layer_bytes(self.layout)

    @property
    def wanted_bytes(self) -> int:
        """Device bytes of every layer that can be held (the global ones)."""
        layers = sum(not self.layout.is_sliding(i) for i in range(self.layout.num_layers))
        return layers * resident_layer_bytes(self.layout)

    def fit(self, room: int):
        """Hold as many layers as `room` bytes allow, the first layers first (a follow-up's first
        layer is the one whose load nothing can overlap); layers beyond it are freed."""
        layout = self.layout
        candidates = [i for i in range(layout.num_layers) if not layout.is_sliding(i)]
        count = min(len(candidates), max(room, 0) // resident_layer_bytes(layout))
        wanted = set(candidates[:count])
        for layer in [i for i in self.rows if i not in wanted]:
            del self.rows[layer], self.valid[layer]
            self.version += 1
        data, words = layout.stored_row
        shape = (layout.num_kv_heads, layout.capacity)
        for layer in sorted(wanted - set(self.rows)):
            rows = {w: torch.empty(shape + (data,), dtype=layout.stored_dtype, device=self.device) for w in "kv"}
            if layout.is_quantized:
                rows.update({f"{w}_scales": torch.empty(shape + (words,), dtype=torch.int16, device=self.device)
                             for w in "kv"})
            self.rows[layer], self.valid[layer] = rows, 0
            self.version += 1

    def write(self, layer: int, which: str, start: int, end: int, data: torch.Tensor,
              scales: torch.Tensor | None = None):
        """Rows start..end of K ("k") or V ("v") as stored, from the device ([KV, end-start, R])."""
        rows = self.rows[layer]
        rows[which][:, start:end].copy_(data)
        if scales is not None:
            rows[f"{which}_scales"][:, start:end].copy_(scales)

    def extend(self, layer: int, start: int, end: int):
        """Both K and V of start..end are written: the copy holds them if it held what precedes."""
        if self.valid[layer] == start and end != start:
            self.valid[layer] = end
            self.version += 1

    def widen(self, layer: int, which: str, start: int, end: int, dst: torch.Tensor, piece: int = 0):
        """Rows start..end of K ("k") or V ("v") into dst ([KV, end-start, D], the pages' dtype):
        q8_0 / q4_0 widened `piece` tokens at a time (0: at once), which bounds the float32
        scales widening holds; other types copied."""
        rows = self.rows[layer]
        data = rows[which]
        if not self.layout.is_quantized:
            dst.copy_(data[:, start:end])
            return
        scales, piece = rows[f"{which}_scales"], piece or max(end - start, 1)
        for s in range(start, end, piece):
            e = min(end, s + piece)
            dequantize_kv(data[:, s:e], scales[:, s:e], self.layout.kv_type, self.layout.dtype,
                          out=dst[:, s - start:e - start])

    def truncate(self, num_tokens: int):
        """The host keeps only its first num_tokens tokens: what follows is written over."""
        for layer in self.valid:
            if self.valid[layer] > num_tokens:
                self.valid[layer] = num_tokens
                self.version += 1
