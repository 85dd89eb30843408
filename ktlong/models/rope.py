"""Rotary position embedding: inverse frequencies (with scaling) and the half-split rotation."""

from __future__ import annotations

import math

import torch

from ktlong.gguf.model_config import RopeConfig
from operators import triton_installed


def inv_freq(rope: RopeConfig, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (float32) and the attention scale that the scaling asks for.

    freq_factors: llama3-style per-frequency divisors stored as the rope_freqs tensor.
    """
    dim = rope.dim
    freqs = 1.0 / rope.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    mscale = 1.0
    if rope.scaling_type == "linear":
        freqs = freqs / rope.factor
    elif rope.scaling_type == "yarn":
        freqs, mscale = _yarn(freqs, rope)
    if freq_factors is not None:
        freqs = freqs / freq_factors.to(torch.float64)
    return freqs.float(), mscale


def _yarn(freqs: torch.Tensor, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    # YaRN (Peng et al. 2023): keep high frequencies, interpolate low ones by `factor`,
    # blend linearly between the dimensions where beta_fast and beta_slow rotations fit
    # into the original context.
    dim, base, factor = rope.dim, rope.base, rope.factor
    original = rope.original_context_length

    def dim_of_rotations(num_rotations):
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of_rotations(rope.yarn_beta_fast)), 0)
    high = min(math.ceil(dim_of_rotations(rope.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
    blended = freqs / factor * (1 - keep) + freqs * keep
    mscale = (0.1 * math.log(factor) + 1.0) * rope.yarn_attn_factor if factor > 1 else 1.0
    return blended, mscale


def rope_cos_sin(inv: torch.Tensor, positions: torch.Tensor, mscale: float = 1.0):
    """positions: [T] int64 -> cos, sin: [T, dim] float32 (half-split layout)."""
    angles = positions.to(torch.float32)[:, None] * inv.to(positions.device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * mscale, angles.sin() * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rotates the first cos.shape[-1] channels, half-split pairs (i, i + d/2)."""
    if x.is_cuda and triton_installed():  # one kernel instead of eight
        from operators.rope_kernel import rope_kernel

        return rope_kernel(x, cos, sin)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    out = x_rot * cos + rotated * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


def rope_at(q: torch.Tensor, k: torch.Tensor, inv: torch.Tensor, positions: torch.Tensor,
            mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KV, D] rotated at positions [T]: apply_rope over rope_cos_sin's tables.
    On a GPU one kernel each computes the tables' entries where it uses them."""
    if q.is_cuda and triton_installed():
        from operators.rope_kernel import rope_positions_kernel

        return (rope_positions_kernel(q, positions, inv, mscale), rope_positions_kernel(k, positions, inv, mscale))
    cos, sin = rope_cos_sin(inv, positions, mscale)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
