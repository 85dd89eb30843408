"""4-bit GGUF weights kept 4-bit on the CPU, multiplied in place by torch's int4 kernel.

Q4_0 and Q4_1 store each run of 32 weights along a row as 4-bit codes q with a scale d (and,
Q4_1, a minimum m): w = d * (q - 8), or w = d * q + m. torch's CPU int4 layout (packed codes,
and a scale and a zero for each group of 32 along the input: w = scale * (q - 8) + zero) holds
them as they are: Q4_0's zero is 0, Q4_1's is m + 8d. The kernel takes bfloat16 activations and
bfloat16 scales and zeros, so a product rounds its input and each block's d and m to bfloat16
(2^-9 relative, far below the 4-bit codes' own error). A decode step reads a quarter of the
bytes float32 weights take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

INT4_TYPES = frozenset({T.Q4_0, T.Q4_1})
GROUP = 32  # weights per GGUF block along a row, and per scale of torch's int4 layout


@dataclass(frozen=True)
class Int4Weight:
    """A [out, in] weight in torch's CPU int4 layout."""
    packed: torch.Tensor  # uint8, from _convert_weight_to_int4pack_for_cpu
    scale_zero: torch.Tensor  # [in / GROUP, out, 2] bfloat16
    shape: tuple[int, int]

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, ggml_type: T, shape: tuple[int, int], rows=lambda t: t) -> "Int4Weight":
        """raw: a Q4_0 or Q4_1 tensor's bytes (flat uint8); shape: (out, in). rows: a reordering
        of the rows (output features) applied to codes, scales and zeros alike (unpermute_qk)."""
        assert ggml_type in INT4_TYPES and raw.dtype == torch.uint8 and raw.dim() == 1
        out_features, in_features = shape
        blocks = raw.view(out_features * in_features // GROUP, -1)
        d = blocks[:, :2].contiguous().view(torch.float16).float()[:, 0]
        if ggml_type == T.Q4_0:
            codes, zero = blocks[:, 2:], torch.zeros_like(d)
        else:
            codes, zero = blocks[:, 4:], blocks[:, 2:4].contiguous().view(torch.float16).float()[:, 0] + 8 * d
        # byte j of a block holds element j (low nibble) and element j + 16 (high nibble)
        q = torch.cat([codes & 0xF, codes >> 4], dim=1).to(torch.int32).view(out_features, in_features)
        groups = (out_features, in_features // GROUP)
        q, d, zero = rows(q), rows(d.view(groups)), rows(zero.view(groups))
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
