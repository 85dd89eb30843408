"""4-bit GGUF weights kept 4-bit on the CPU, multiplied in place by torch's int4 kernel.

Q4_0, Q4_1 and Q4_K store each run of 32 weights along a row as 4-bit codes q with a scale d
(and a minimum): w = d * (q - 8), w = d * q + m, or (Q4_K, a 6-bit scale and minimum per run
under two float16 factors) w = d * sc * q - dmin * mn. torch's CPU int4 layout (packed codes,
and a scale and a zero for each group of 32 along the input: w = scale * (q - 8) + zero) holds
them as they are: the zero is 0, m + 8d, or 8 d sc - dmin mn. The kernel takes bfloat16
activations and bfloat16 scales and zeros, so a product rounds its input and each run's scale
and zero to bfloat16 (by 2^-8 of their size at most: below half a 4-bit step while a run's
offset is under 128 of its steps, as quantisers make them). A decode step reads a quarter of
the bytes float32 weights take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ktlong.gguf.dequant import four_bit_runs

INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
GROUP = 32  # weights per GGUF block along a row, and per scale of torch's int4 layout


@dataclass(frozen=True)
class Int4Weight:
    """A [out, in] weight in torch's CPU int4 layout."""
    packed: torch.Tensor  # uint8, from _convert_weight_to_int4pack_for_cpu
    scale_zero: torch.Tensor  # [in / GROUP, out, 2] bfloat16
    shape: tuple[int, int]

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, ggml_type: T, shape: tuple[int, int], rows=lambda t: t) -> "Int4Weight":
        """raw: a Q4_0, Q4_1 or Q4_K tensor's bytes (flat uint8); shape: (out, in). rows: a
        reordering of the rows (output features) applied to codes, scales and zeros alike
        (unpermute_qk)."""
        assert ggml_type in INT4_TYPES and raw.dtype == torch.uint8 and raw.dim() == 1
        out_features, in_features = shape
        q, d, offset = four_bit_runs(raw.view(-1, GGML_QUANT_SIZES[ggml_type][1]), ggml_type)
        zero = offset + 8 * d  # torch's layout centres the codes: w = d (q - 8) + zero
        groups = (out_features, in_features // GROUP)
        q = rows(q.to(torch.int32).view(out_features, in_features))
        d, zero = rows(d.view(groups)), rows(zero.view(groups))
        scale_zero = torch.stack([d.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        return cls(packed, scale_zero, (out_features, in_features))


def linear(x: torch.Tensor, w: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or for an Int4Weight torch's int4 kernel over x in bfloat16, back in x's type."""
    if not isinstance(w, Int4Weight):
        return F.linear(x, w, bias)
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, w.packed, GROUP, w.scale_zero)
    y = y.to(x.dtype).view(*x.shape[:-1], w.shape[0])
    return y + bias if bias is not None else y
