"""RoPE's inverse frequencies with their scaling (linear, YaRN, llama3-style factors), in numpy,
so that the CPU engine (ktlong/models/cpu_llama.py) computes them without torch; rope.py gives
torch's code the same values."""

from __future__ import annotations

import math

import numpy as np

from ktlong.gguf.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float32) and the attention scale that the scaling asks for.

    freq_factors: llama3-style per-frequency divisors stored as the rope_freqs tensor.
    """
    dim = rope.dim
    freqs = 1.0 / rope.base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    mscale = 1.0
    if rope.scaling_type == "linear":
        freqs = freqs / rope.factor
    elif rope.scaling_type == "yarn":
        freqs, mscale = _yarn(freqs, rope)
    if freq_factors is not None:
        freqs = freqs / np.asarray(freq_factors, np.float64)
    return freqs.astype(np.float32), mscale


def _yarn(freqs: np.ndarray, rope: RopeConfig) -> tuple[np.ndarray, float]:
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
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
    blended = freqs / factor * (1 - keep) + freqs * keep
    mscale = (0.1 * math.log(factor) + 1.0) * rope.yarn_attn_factor if factor > 1 else 1.0
    return blended, mscale


def cos_sin(inv: np.ndarray, positions: np.ndarray, mscale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """positions [T] -> cos, sin [T, dim] float32 in the half-split layout, as rope.rope_cos_sin
    computes them (angles in float32)."""
    angles = positions.astype(np.float32)[:, None] * inv[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return (np.cos(angles) * np.float32(mscale)).astype(np.float32), (np.sin(angles) * np.float32(mscale)).astype(np.float32)
