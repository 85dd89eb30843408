"""Quantise K/V rows to GGML's q8_0 and q4_0 on the device, and widen them back.

A row of head_dim values is cut into blocks of 32 along head_dim, so every token quantises on
its own: prefill quantises a chunk, decode a single token, with the same result. Each block
holds GGML's values exactly (gguf.quants.quantize gives the same bits), stored as two planes
that the CPU decode operator reads (cpu_ops/kv_storage.py):
  q8_0: data int8 [..., D], one value per element; scales float16 words [..., D/32]
  q4_0: data uint8 [..., D/2], in each block of 16 bytes byte j holds element j in its low
        nibble and element j+16 in its high nibble (value + 8); scales float16 words [..., D/32]
The arithmetic follows ggml-quants.c step by step in float32: d = amax/127 (q8_0) or
d = (the value of largest magnitude)/-8 (q4_0), multiplied by 1/d, rounded half away from zero
(q8_0) or truncated after +8.5 (q4_0); the stored scale is d in float16.
"""

from __future__ import annotations

import torch

from operators.checks import expect

QBLOCK = 32
QUANTIZED = ("q8_0", "q4_0")


def stored_row_shapes(kv_type: str, head_dim: int) -> tuple[int, int]:
    """(data elements, scale words) of one stored row of head_dim values."""
    assert kv_type in QUANTIZED and head_dim % QBLOCK == 0, (kv_type, head_dim)
    return (head_dim if kv_type == "q8_0" else head_dim // 2), head_dim // QBLOCK


def quantize_kv(x: torch.Tensor, kv_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] (any float dtype) -> data (int8 [..., D] or uint8 [..., D/2]) and scales
    (int16 [..., D/32], the bits of float16 values), on x's device."""
    if kv_type not in QUANTIZED or x.shape[-1] % QBLOCK:
        raise ValueError(f"quantize_kv takes {' or '.join(QUANTIZED)} rows of a multiple of {QBLOCK} values, "
                         f"got {kv_type} and shape {tuple(x.shape)}")
    blocks = x.float().reshape(*x.shape[:-1], -1, QBLOCK)  # [..., D/32, 32]
    if kv_type == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
    else:
        where = blocks.abs().argmax(-1, keepdim=True)  # the first of equal magnitudes, as numpy
        d = blocks.gather(-1, where) / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    if kv_type == "q8_0":
        a = scaled.abs()
        floored = a.floor()
        data = (scaled.sign() * (floored + (2 * (a - floored)).floor())).to(torch.int8)
        data = data.reshape(x.shape)
    else:
        q = (scaled + 8.5).trunc().clamp(0, 15).to(torch.uint8)  # [..., D/32, 32]
        data = (q[..., :16] | (q[..., 16:] << 4)).reshape(*x.shape[:-1], -1)
    scales = d[..., 0].to(torch.float16).view(torch.int16)
    return data, scales


def dequantize_kv(data: torch.Tensor, scales: torch.Tensor, kv_type: str, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of quantize_kv up to the format's rounding: -> [..., D] of dtype, or written
    into out (its dtype; the last dimension contiguous). Each value is its integer times the
    block's scale in float32, rounded once to the output type, in one pass (q4_0: one per half)."""
    if kv_type not in QUANTIZED:
        raise ValueError(f"dequantize_kv takes {' or '.join(QUANTIZED)}, got {kv_type}")
    expect("data", data, dtype=torch.int8 if kv_type == "q8_0" else torch.uint8)
    blocks = data.shape[-1] // (QBLOCK if kv_type == "q8_0" else QBLOCK // 2)
    expect("scales", scales, shape=(*data.shape[:-1], blocks), dtype=torch.int16, device=data.device)
    d = scales.view(torch.float16).float()[..., None]  # [..., D/32, 1]
    if out is None:
        out = torch.empty((*data.shape[:-1], blocks * QBLOCK), dtype=dtype, device=data.device)
    values = out.view(*out.shape[:-1], blocks, QBLOCK)
    if kv_type == "q8_0":
        torch.mul(data.reshape(*data.shape[:-1], blocks, QBLOCK), d, out=values)
    else:
        packed = data.reshape(*data.shape[:-1], blocks, QBLOCK // 2)
        torch.mul((packed & 0xF).to(torch.int8) - 8, d, out=values[..., :QBLOCK // 2])
        torch.mul((packed >> 4).to(torch.int8) - 8, d, out=values[..., QBLOCK // 2:])
    return out
