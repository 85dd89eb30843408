"""Merge two partial attention results over disjoint key sets by their log-sum-exp.

o = (o_a e^{lse_a} + o_b e^{lse_b}) / (e^{lse_a} + e^{lse_b}), lse = log(e^{lse_a} + e^{lse_b}).
lse here is the natural log; FlashInfer's merge_state uses base 2, so the GPU path converts.
An empty part has lse = -inf and contributes nothing.
"""

from __future__ import annotations

import math

import torch

from operators.checks import expect

LN2 = math.log(2.0)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """o_*: [..., H, D]; lse_*: [..., H] float32 (natural log) -> (o [..., H, D] float32, lse [..., H]):
    one state per head, for any leading shape (a decode batch's sequences)."""
    expect("o_b", o_b, shape=tuple(o_a.shape), device=o_a.device)
    expect("lse_a", lse_a, shape=tuple(o_a.shape[:-1]), dtype=torch.float32, device=o_a.device)
    expect("lse_b", lse_b, shape=tuple(o_a.shape[:-1]), dtype=torch.float32, device=o_a.device)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    o = (o_a.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / total.clamp_min(1e-30)[..., None]
    return o, m + torch.log(total)


def merge_states_flashinfer(o_a, lse_a, o_b, lse_b):
    """Same contract on CUDA through flashinfer.merge_state (bf16/fp16 values, fp32 base-2 lse)."""
    import flashinfer

    dtype = o_a.dtype if o_a.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    o, lse2 = flashinfer.merge_state(o_a.to(dtype)[None], (lse_a / LN2).float()[None],
                                     o_b.to(dtype)[None], (lse_b / LN2).float()[None])
    return o[0].float(), lse2[0] * LN2
