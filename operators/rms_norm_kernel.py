"""RMSNorm in one Triton kernel, for GPUs: a decode step normalises each layer's input twice, and
the torch version (widen, square, mean, add, rsqrt, multiply, narrow, multiply by the weight) is
eight kernels each time; at 8B shapes a token spends more on launching them than on the math.

Same arithmetic as ktlong/models/llama.py's rms_norm, step by step: float32 statistics, the
normalised row rounded to the input's type, then the product with the weight rounded again, so
the result is the torch version's to the last bit but for the order of the mean's sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.narrow import narrow


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / n + eps)
    normed = (x32 * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in the type torch's `normed * weight` gives."""
    n = x.shape[-1]
    expect("weight", weight, shape=(n,), device=x.device)
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm[(rows.shape[0],)](rows, weight.contiguous(), out, n, eps, BLOCK=triton.next_power_of_2(n))
    return out.view(*x.shape[:-1], n)


@triton.jit
def _add_rms_norm(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
    """Row r: s = x + y rounded to x's type, then _rms_norm's arithmetic on s."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    s = narrow(x + y, dtype)
    tl.store(sum_ptr + row * n + cols, s.to(dtype), mask=inside)
    inv = tl.rsqrt(tl.sum(s * s, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    out = narrow(s * inv, dtype) * w
    tl.store(out_ptr + row * n + cols, narrow(out, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm_kernel(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y [..., N] of one type, weight [N] -> (x + y, rms_norm(x + y, weight)) in one pass: a
    residual add and the next norm, rounded as torch's add and rms_norm_kernel round them."""
    n = x.shape[-1]
    expect("y", y, shape=tuple(x.shape), dtype=x.dtype, device=x.device)
    expect("weight", weight, shape=(n,), device=x.device)
    rows, other = x.reshape(-1, n).contiguous(), y.reshape(-1, n).contiguous()
    total = torch.empty_like(rows)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _add_rms_norm[(rows.shape[0],)](rows, other, weight.contiguous(), total, out, n, eps,
                                        BLOCK=triton.next_power_of_2(n))
    return total.view(x.shape), out.view(x.shape)
