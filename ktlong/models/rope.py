"""Rotary position embedding: inverse frequencies (with scaling) and the half-split rotation."""

from __future__ import annotations

import torch

from ktlong.gguf.model_config import RopeConfig
from ktlong.models.rope_frequencies import inverse_frequencies
from operators import triton_installed


def inv_freq(rope: RopeConfig, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (float32) and the attention scale that the scaling asks for
    (rope_frequencies.inverse_frequencies, as a tensor).

    freq_factors: llama3-style per-frequency divisors stored as the rope_freqs tensor.
    """
    factors = None if freq_factors is None else freq_factors.double().cpu().numpy()
    freqs, mscale = inverse_frequencies(rope, factors)
    return torch.from_numpy(freqs), mscale


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
