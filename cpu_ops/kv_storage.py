"""KV storage types for the DRAM cache and the Numba readers that widen them to float32.

A stored K or V block tensor is [KV, NB, B, D] of:
  bf16 / fp16: uint16 words (bf16 widens by a shift; fp16 by IEEE half decoding);
  q8_0: int8 values with a float32 scale per 32 values ([KV, NB, B, D/32]);
  q4_0: packed nibbles [KV, NB, B, D/2] (value - 8) with a float32 scale per 32 values;
  fp32: float32 as is (exact CPU reference runs).
The reference encoders here are plain numpy; the kernels read rows with `load_row`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from cpu_ops.bf16 import from_bf16, to_bf16

KV_TYPES = ("bf16", "fp16", "q8_0", "q4_0")
KIND = {"bf16": 0, "fp16": 1, "q8_0": 2, "q4_0": 3, "fp32": 4}
QBLOCK = 32


@dataclass
class StoredKV:
    kind: str
    data: np.ndarray  # uint16 / int8 / uint8, see above
    scales: np.ndarray  # float32 [KV, NB, B, D/32] for q8_0 / q4_0, else an empty array

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (2 if self.kind == "q4_0" else 1)

    def nbytes_per_token(self) -> int:
        return self.data.shape[-1] * self.data.itemsize + self.scales.shape[-1] * 4 * (self.scales.ndim == 4)


def encode(x: np.ndarray, kind: str) -> StoredKV:
    """x: float32 [KV, NB, B, D] -> StoredKV (round to nearest for every type)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    empty = np.zeros((0,), np.float32)
    if kind == "bf16":
        return StoredKV(kind, to_bf16(x), empty)
    if kind == "fp16":
        return StoredKV(kind, x.astype(np.float16).view(np.uint16), empty)
    groups = x.reshape(*x.shape[:-1], -1, QBLOCK)
    amax = np.abs(groups).max(-1)
    if kind == "q8_0":
        scale = (amax / 127).astype(np.float32)
        q = np.round(groups / np.where(scale == 0, 1, scale)[..., None])
        return StoredKV(kind, np.clip(q, -127, 127).astype(np.int8).reshape(x.shape), scale)
    if kind == "q4_0":
        # signed max over the group picks the scale so that value -8 reaches the extreme
        idx = np.abs(groups).argmax(-1)
        extreme = np.take_along_axis(groups, idx[..., None], -1)[..., 0]
        scale = (extreme / -8).astype(np.float32)
        q = np.round(groups / np.where(scale == 0, 1, scale)[..., None]) + 8
        q = np.clip(q, 0, 15).astype(np.uint8).reshape(x.shape)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        return StoredKV(kind, packed, scale)
    raise ValueError(f"unknown kv type {kind}")


def decode(s: StoredKV) -> np.ndarray:
    """Reference widening of a StoredKV to float32 [KV, NB, B, D]."""
    if s.kind == "bf16":
        return from_bf16(s.data)
    if s.kind == "fp16":
        return s.data.view(np.float16).astype(np.float32)
    if s.kind == "fp32":
        return s.data.astype(np.float32)
    if s.kind == "q8_0":
        g = s.data.astype(np.float32).reshape(*s.data.shape[:-1], -1, QBLOCK)
        return (g * s.scales[..., None]).reshape(s.data.shape)
    low, high = (s.data & 0xF).astype(np.float32), (s.data >> 4).astype(np.float32)
    q = np.empty((*s.data.shape[:-1], s.data.shape[-1] * 2), np.float32)
    q[..., 0::2], q[..., 1::2] = low - 8, high - 8
    g = q.reshape(*q.shape[:-1], -1, QBLOCK)
    return (g * s.scales[..., None]).reshape(q.shape)


@nb.njit(inline="always", cache=True)
def _half_to_float(h):
    sign = -1.0 if (h >> 15) & 1 else 1.0
    exp = (h >> 10) & 0x1F
    frac = h & 0x3FF
    if exp == 0:
        return sign * frac * 5.960464477539063e-08  # 2**-24
    if exp == 31:
        return sign * np.inf if frac == 0 else np.nan
    return sign * (1.0 + frac / 1024.0) * 2.0 ** (exp - 15)


@nb.njit(inline="always", cache=True)
def load_row(kind, data, scales, h, b, t, out_u32, out_f32):
    """Widen row (h, b, t) of a stored tensor into out_f32 [D] (out_u32 aliases it)."""
    d = out_f32.shape[0]
    if kind == 0:
        row = data[h, b, t]
        for c in range(d):
            out_u32[c] = np.uint32(row[c]) << 16
    elif kind == 1:
        row = data[h, b, t]
        for c in range(d):
            out_f32[c] = _half_to_float(np.int32(row[c]))
    elif kind == 2:
        row = data[h, b, t]
        sc = scales[h, b, t]
        for c in range(d):
            out_f32[c] = row[c] * sc[c // 32]
    elif kind == 4:
        row = data[h, b, t]
        for c in range(d):
            out_f32[c] = row[c]
    else:
        row = data[h, b, t]
        sc = scales[h, b, t]
        for c in range(d // 2):
            byte = np.int32(row[c])
            out_f32[2 * c] = ((byte & 0xF) - 8) * sc[(2 * c) // 32]
            out_f32[2 * c + 1] = ((byte >> 4) - 8) * sc[(2 * c + 1) // 32]


@nb.njit(inline="always", cache=True)
def load_block(kind, data, scales, h, b, valid, out_u32, out_f32):
    """Widen the first `valid` rows of block (h, b) into out_f32 [B, D] (out_u32 aliases it)."""
    if kind == 0:
        blk = data[h, b]
        d = blk.shape[1]
        for t in range(valid):
            for c in range(d):
                out_u32[t, c] = np.uint32(blk[t, c]) << 16
    else:
        for t in range(valid):
            load_row(kind, data, scales, h, b, t, out_u32[t], out_f32[t])
