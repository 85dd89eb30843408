"""A token embedding kept as the GGUF stores it, its rows dequantised as tokens look them up.

A model with an output head of its own reads its embedding only a row per token. Kept in its
stored type (Qwen2.5-Coder-0.5B's Q5_0: 94 MB) instead of bfloat16 (272 MB) or float32 (545 MB),
it costs a CPU process far less memory, and each looked-up row is dequantised exactly as the
whole table would be. A tied embedding, which is the output head too, is multiplied whole and
stays a tensor.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from ktlong.gguf.dequant import dequantize


class StoredRows:
    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, int],
                 dtype: torch.dtype):
        """raw: the table's bytes, flat uint8, whole rows of `shape` [rows, width] in ggml_type;
        rows come back in dtype."""
        assert raw.dtype == torch.uint8 and raw.numel() % shape[0] == 0
        self.rows = raw.view(shape[0], -1)  # [rows, bytes per row]: a row is whole blocks
        self.ggml_type, self.shape, self.dtype = ggml_type, shape, dtype

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ids (any shape) -> [*ids.shape, width], dequantised."""
        picked = self.rows[ids.reshape(-1)]
        out = dequantize(picked.reshape(-1), self.ggml_type, (picked.shape[0], self.shape[1]), self.dtype)
        return out.view(*ids.shape, self.shape[1])
