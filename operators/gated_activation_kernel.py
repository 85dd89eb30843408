"""The MLP's gate: silu(gate) * up in one Triton kernel, for GPUs, from the gate/up product's
output [T, 2 I] (torch: a slice, silu and the product, two kernels and a [T, I] temporary).

Rounded as torch rounds on the narrow type: silu(gate) computed in float32 and rounded, then the
product of the two narrow values rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.narrow import narrow

COLUMNS = 1024  # columns a program takes


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, width, COLUMNS: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * COLUMNS + tl.arange(0, COLUMNS)
    inside = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
    act = narrow(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * width + cols, narrow(act * up, dtype).to(dtype), mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (gate, then up) -> silu(gate) * up [T, I], in gate_up's type."""
    expect("gate_up", gate_up, ndim=2)
    tokens, double = gate_up.shape
    if double % 2:
        raise ValueError(f"gate_up's width {double} must be even: gate and up side by side")
    width = double // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_mul[(tokens, triton.cdiv(width, COLUMNS))](gate_up, out, width, COLUMNS=COLUMNS)
    return out
