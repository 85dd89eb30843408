"""KV storage types for the DRAM cache and the Numba readers that widen them to float32.

A stored K or V block tensor is [KV, NB, B, D] of:
  bf16 / fp16: uint16 words (bf16 widens by a shift; fp16 by IEEE half decoding);
  q8_0: int8 values [KV, NB, B, D] with a float16 scale per 32 values ([KV, NB, B, D/32] words);
  q4_0: packed nibbles [KV, NB, B, D/2] with a float16 scale per 32 values: in each group's 16
        bytes, byte j holds value j + 8 in its low nibble and value j + 16 + 8 in its high one;
  fp32: float32 as is (exact CPU reference runs).
q8_0 and q4_0 hold GGML's blocks (ggml-quants.c) as two planes: the same values and scales bit
for bit, the scales apart from the values. The reference encoders here are plain numpy; the
kernels read rows with `load_row`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from cpu_ops.bf16 import bits_as_float32, from_bf16, to_bf16

KV_TYPES = ("bf16", "fp16", "q8_0", "q4_0")
KIND = {"bf16": 0, "fp16": 1, "q8_0": 2, "q4_0": 3, "fp32": 4}
QBLOCK = 32


@dataclass
class StoredKV:
    kind: str
    data: np.ndarray  # uint16 / int8 / uint8, see above
    scales: np.ndarray  # uint16 float16 words [KV, NB, B, D/32] for q8_0 / q4_0, else an empty array

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (2 if self.kind == "q4_0" else 1)

    def nbytes_per_token(self) -> int:
        return self.data.shape[-1] * self.data.itemsize + self.scales.shape[-1] * 2 * (self.scales.ndim == 4)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    a = np.abs(x)
    floored = np.floor(a)
    return np.sign(x) * (floored + np.floor(2 * (a - floored)))


def encode(x: np.ndarray, kind: str) -> StoredKV:
    """x: float32 [KV, NB, B, D] -> StoredKV (bf16/fp16 round to nearest; q8_0/q4_0 as GGML)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    empty = np.zeros((0,), np.uint16)
    if kind == "bf16":
        return StoredKV(kind, to_bf16(x), empty)
    if kind == "fp16":
        return StoredKV(kind, x.astype(np.float16).view(np.uint16), empty)
    groups = x.reshape(*x.shape[:-1], -1, QBLOCK)
    if kind == "q8_0":
        d = np.abs(groups).max(-1, keepdims=True) / np.float32(127)
    elif kind == "q4_0":
        extreme = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)
        d = extreme / np.float32(-8)
    else:
        raise ValueError(f"unknown kv type {kind}")
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    scales = d[..., 0].astype(np.float16).view(np.uint16)
    if kind == "q8_0":
        return StoredKV(kind, _round_half_away(groups * inverse).astype(np.int8).reshape(x.shape), scales)
    q = np.trunc(groups * inverse + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    packed = (q[..., :16] | (q[..., 16:] << np.uint8(4))).reshape(*x.shape[:-1], -1)
    return StoredKV(kind, packed, scales)


def decode(s: StoredKV) -> np.ndarray:
    """Reference widening of a StoredKV to float32 [KV, NB, B, D]."""
    if s.kind == "bf16":
        return from_bf16(s.data)
    if s.kind == "fp16":
        return s.data.view(np.float16).astype(np.float32)
    if s.kind == "fp32":
        return s.data.astype(np.float32)
    d = s.scales.view(np.float16).astype(np.float32)[..., None]
    if s.kind == "q8_0":
        g = s.data.astype(np.float32).reshape(*s.data.shape[:-1], -1, QBLOCK)
        return (g * d).reshape(s.data.shape)
    packed = s.data.reshape(*s.data.shape[:-1], -1, QBLOCK // 2)
    g = np.concatenate([(packed & 0xF).astype(np.float32) - 8, (packed >> 4).astype(np.float32) - 8], -1)
    return (g * d).reshape(*s.data.shape[:-1], -1)


@nb.njit(inline="always", cache=True)
def half_value(word):
    """One uint16 IEEE half word -> float32, by moving the exponent and mantissa bits into
    place (no pow, no division: the widening costs a few integer operations per scale)."""
    h = np.uint32(word)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    magnitude = h & np.uint32(0x7FFF)
    if magnitude >= np.uint32(0x7C00):  # inf / nan: all exponent bits set
        return bits_as_float32(sign | np.uint32(0x7F800000) | ((magnitude & np.uint32(0x3FF)) << np.uint32(13)))
    if magnitude >= np.uint32(0x0400):  # normal: rebias the exponent from 15 to 127
        return bits_as_float32(sign | ((magnitude << np.uint32(13)) + np.uint32(112 << 23)))
    value = np.float32(magnitude) * np.float32(5.960464477539063e-08)  # subnormal: m * 2**-24
    return -value if sign else value


@nb.njit(inline="always", cache=True)
def load_row(kind, data, scales, h, b, t, out_u32, out_f32):
    """Widen row (h, b, t) of a stored tensor into out_f32 [D] (out_u32 aliases it)."""
    row = data[h, b, t]
    if kind == 0:
        for c in range(out_f32.shape[0]):
            out_u32[c] = np.uint32(row[c]) << 16
    elif kind == 1:
        for c in range(out_f32.shape[0]):
            out_f32[c] = half_value(row[c])
    elif kind == 4:
        for c in range(out_f32.shape[0]):
            out_f32[c] = row[c]
    elif kind == 2:
        row_scales = scales[h, b, t]
        groups = row_scales.shape[0]
        width = row.shape[0] // groups  # 32, read from the shapes: a loop of unknown length vectorises,
        for group in range(groups):  # while one of a constant 32 is unrolled into scalar conversions
            scale, base = half_value(row_scales[group]), group * width
            for j in range(width):
                out_f32[base + j] = np.float32(row[base + j]) * scale
    else:
        row_scales = scales[h, b, t]
        groups = row_scales.shape[0]
        half = row.shape[0] // groups  # 16 bytes per group, as a runtime length (see q8_0)
        for group in range(groups):
            scale, src, dst = half_value(row_scales[group]), group * half, group * 2 * half
            for j in range(half):
                byte = np.int32(row[src + j])
                out_f32[dst + j] = np.float32((byte & 0xF) - 8) * scale
                out_f32[dst + half + j] = np.float32((byte >> 4) - 8) * scale


@nb.njit(inline="always", cache=True)
def load_rows(kind, data, scales, h, b, first, n, out_u32, out_f32):
    """Widen rows first..first+n-1 of block (h, b) into out_f32[:n] (out_u32 aliases it)."""
    for t in range(n):
        load_row(kind, data, scales, h, b, first + t, out_u32[t], out_f32[t])
