"""4- and 5-bit GGUF weights kept compact on the CPU, multiplied in place by torch's int4 kernel.

Q4_0, Q4_1, Q4_K, Q5_0, Q5_1 and Q5_K store each run of 32 weights along a row as codes q with a
scale and an offset: w = scale * q + offset (dequant.code_runs). torch's CPU int4 layout
(packed 4-bit codes, and a scale and a zero for each group of 32 along the input:
w = scale * (q - 8) + zero) holds a 4-bit type as it is, with zero = offset + 8 scale. A 5-bit
code q = l + 16 h becomes two such planes whose products add up: the low nibbles l under the
run's scale and offset, and the fifth bits h under 16 x the scale with no offset.

The kernel takes bfloat16 activations, scales and zeros and returns bfloat16, so a product
rounds its input, each run's scale and zero, and its output to bfloat16 (2^-8 of a value at
most). Where the zero is the scale times a power of two (0 for Q4_0, -8 scale for Q5_0's low
nibbles, 8 x 16 scale for the fifth bits) it rounds with the scale, and the weights stay exact
multiples of the rounded scale; otherwise the zero's rounding stays below half a step while a
run's offset is under 128 of its steps, as quantisers make them. A decode step reads about 0.6
bytes per weight for one plane (half a byte of codes, an eighth of scale and zero), 1.25 for
two, against float32's 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ktlong.gguf.stored_matrix import StoredMatrix
from ktlong.gguf.dequant import FIVE_BIT_TYPES, RUN_TYPES, code_runs

INT4_TYPES = RUN_TYPES  # the types that stay compact: one plane, or two for the 5-bit ones
GROUP = 32  # weights per GGUF run along a row, and per scale of torch's int4 layout


@dataclass(frozen=True)
class Int4Weight:
    """A [out, in] weight as planes of 4-bit codes in torch's CPU int4 layout, summed."""
    planes: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (packed uint8, scale_zero [in / GROUP, out, 2] bfloat16)
    shape: tuple[int, int]

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, ggml_type: T, shape: tuple[int, int], rows=lambda t: t) -> "Int4Weight":
        """raw: a tensor of one of INT4_TYPES as bytes (flat uint8); shape: (out, in). rows: a
        reordering of the rows (output features) applied to codes, scales and zeros alike
        (unpermute_qk)."""
        assert ggml_type in INT4_TYPES and raw.dtype == torch.uint8 and raw.dim() == 1
        q, scale, offset = code_runs(raw.view(-1, GGML_QUANT_SIZES[ggml_type][1]), ggml_type)
        groups = (shape[0], shape[1] // GROUP)
        scale, offset = scale.view(groups), offset.view(groups)
        if ggml_type in FIVE_BIT_TYPES:
            planes = [(q & 15, scale, offset), (q >> 4, 16 * scale, torch.zeros_like(offset))]
        else:
            planes = [(q, scale, offset)]
        return cls(tuple(_plane(codes, s, o, shape, rows) for codes, s, o in planes), shape)


def _plane(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, shape: tuple[int, int], rows):
    """One plane in torch's layout: codes [runs, 32] with their runs' scale and offset [out, in / GROUP]."""
    zero = offset + 8 * scale  # torch's layout centres the codes: w = scale (q - 8) + zero
    q = rows(codes.to(torch.int32).view(shape))
    scale_zero = torch.stack([rows(scale).t(), rows(zero).t()], dim=-1).to(torch.bfloat16).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), scale_zero


def linear(x: torch.Tensor, w: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (over x in w's type where w is narrower: a bfloat16 matrix), or for an
    Int4Weight torch's int4 kernel over x in bfloat16 per plane, summed in float32; back in x's type."""
    if isinstance(w, StoredMatrix):
        y = w.linear(x)
        return y + bias if bias is not None else y
    if not isinstance(w, Int4Weight):
        if w.dtype == x.dtype:
            return F.linear(x, w, bias)
        y = F.linear(x.to(w.dtype), w).to(x.dtype)
        return y + bias if bias is not None else y
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    parts = [torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scale_zero) for packed, scale_zero in w.planes]
    y = sum(part.float() for part in parts)
    y = y.to(x.dtype).view(*x.shape[:-1], w.shape[0])
    return y + bias if bias is not None else y
