"""Rotary embedding of q or k in one Triton kernel, for GPUs (the torch version slices, negates,
concatenates, converts cos and sin, multiplies twice and adds: eight kernels for each of q and k
in every layer of a decode step).

Same arithmetic as ktlong/models/rope.py's apply_rope, rounding where it rounds: cos and sin
narrowed to x's type, each product rounded, then their sum (compiled, a product may fuse into the
sum: results within a rounding step of torch's).
Half-split pairs (i, i + rot/2) over the first rot channels; the rest pass through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, pos_ptr, inv_ptr, mscale, out_ptr, heads, dim, rot, HALF: tl.constexpr,
          PASS: tl.constexpr, TABLES: tl.constexpr):
    """Token t, head h; PASS: the width (a power of two) covering the channels past rot, 0 if none.
    TABLES: cos and sin read from [T, rot] tables; else computed here as rope_cos_sin does (the
    angle position * inv_freq in float32, its cosine and sine times mscale)."""
    t, h = tl.program_id(0), tl.program_id(1)
    base = (t * heads + h) * dim
    i = tl.arange(0, HALF)
    half = rot // 2
    inside = i < half
    a = tl.load(x_ptr + base + i, mask=inside, other=0.0)
    b = tl.load(x_ptr + base + half + i, mask=inside, other=0.0)
    dtype = a.dtype
    if TABLES:
        c1 = tl.load(cos_ptr + t * rot + i, mask=inside, other=0.0).to(dtype).to(tl.float32)
        c2 = tl.load(cos_ptr + t * rot + half + i, mask=inside, other=0.0).to(dtype).to(tl.float32)
        s1 = tl.load(sin_ptr + t * rot + i, mask=inside, other=0.0).to(dtype).to(tl.float32)
        s2 = tl.load(sin_ptr + t * rot + half + i, mask=inside, other=0.0).to(dtype).to(tl.float32)
    else:  # both halves of the half-split tables hold the same angles
        angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i, mask=inside, other=0.0)
        c1 = (tl.cos(angle) * mscale).to(dtype).to(tl.float32)
        s1 = (tl.sin(angle) * mscale).to(dtype).to(tl.float32)
        c2, s2 = c1, s1
    a32, b32 = a.to(tl.float32), b.to(tl.float32)
    # out[:half] = a * cos - b * sin, out[half:] = b * cos + a * sin, each product rounded as torch does
    lo = (a32 * c1).to(dtype).to(tl.float32) + (-b32 * s1).to(dtype).to(tl.float32)
    hi = (b32 * c2).to(dtype).to(tl.float32) + (a32 * s2).to(dtype).to(tl.float32)
    tl.store(out_ptr + base + i, lo.to(dtype), mask=inside)
    tl.store(out_ptr + base + half + i, hi.to(dtype), mask=inside)
    if PASS:  # channels past rot, unrotated
        j = tl.arange(0, PASS)
        rest = rot + j < dim
        tl.store(out_ptr + base + rot + j, tl.load(x_ptr + base + rot + j, mask=rest, other=0.0), mask=rest)


def rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, rot] float32 (half-split, as rope_cos_sin gives) -> [T, H, D]."""
    expect("x", x, ndim=3)
    tokens, heads, dim = x.shape
    expect("cos", cos, ndim=2, dtype=torch.float32, device=x.device)
    expect("sin", sin, shape=tuple(cos.shape), dtype=torch.float32, device=x.device)
    rot = cos.shape[-1]
    if cos.shape[0] != tokens or rot > dim or rot % 2:
        raise ValueError(f"cos and sin {tuple(cos.shape)} must hold an even rotary width of at most head_dim "
                         f"{dim} for each of x's {tokens} tokens")
    return _launch(x, rot, cos.contiguous(), sin.contiguous(), cos, cos, 1.0)


def rope_positions_kernel(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                          mscale: float) -> torch.Tensor:
    """x [T, H, D] rotated at positions [T] (int64) with inv_freq [rot / 2] float32: rope_kernel over
    rope_cos_sin(inv_freq, positions, mscale)'s tables, computed in the kernel (a prefill chunk
    saves the seven operations that build them, in every layer)."""
    expect("x", x, ndim=3)
    expect("positions", positions, shape=(x.shape[0],), dtype=torch.int64, device=x.device)
    expect("inv_freq", inv_freq, ndim=1, dtype=torch.float32, device=x.device)
    rot = 2 * inv_freq.shape[0]
    if rot > x.shape[2]:
        raise ValueError(f"the rotary width {rot} is past head_dim {x.shape[2]}")
    return _launch(x, rot, None, None, positions.contiguous(), inv_freq.contiguous(), mscale)


def _launch(x, rot, cos, sin, positions, inv_freq, mscale) -> torch.Tensor:
    tokens, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if tokens:
        tables = cos is not None
        _rope[(tokens, heads)](x, cos if tables else positions, sin if tables else positions, positions, inv_freq,
                               mscale, out, heads, dim, rot, HALF=triton.next_power_of_2(rot // 2),
                               PASS=triton.next_power_of_2(dim - rot) if rot < dim else 0, TABLES=tables)
    return out
