"""Dequantise GGML tensor bytes to torch floats, on whatever device the bytes live.

Each block format takes a uint8 tensor [num_blocks, type_size] and returns float32
[num_blocks, block_size]. Formats follow ggml's block structs (ggml-common.h).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    # b: [n, 2k] uint8 -> [n, k] float32
    return b.contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """Split each byte of b: [n, m] into 8/width fields of `width` bits, lowest first: [n, 8/width, m]."""
    shifts = torch.arange(0, 8, width, device=b.device, dtype=torch.uint8)
    return (b.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << width) - 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # qs: [n, 16] -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31
    return _bits(qs, 4).reshape(qs.shape[0], -1)


def _bit_planes(qh: torch.Tensor) -> torch.Tensor:
    # qh: [n, 4] little-endian 32-bit mask -> [n, 32], element j takes bit j
    return _bits(qh, 1).transpose(1, 2).reshape(qh.shape[0], -1)


def _q8_0(b):
    d = _f16(b[:, :2])
    return d * b[:, 2:].contiguous().view(torch.int8).float()


def _q2_k(b):
    # scales[16] (lo nibble scale, hi nibble min), qs[64], d, dmin
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    # qs viewed as two halves of 32 bytes; each 2-bit plane of a half covers 32 elements
    q = _bits(qs.reshape(n * 2, 32), 2).reshape(n, 16, 16).float()
    sc = (scales & 0xF).float().unsqueeze(-1)
    mn = (scales >> 4).float().unsqueeze(-1)
    return (d.unsqueeze(-1) * sc * q - dmin.unsqueeze(-1) * mn).reshape(n, QK_K)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte, 8 x (6-bit scale, 6-bit min) table of Q4_K and Q5_K."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([a & 0x3F, (hi & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    minimum = torch.cat([m & 0x3F, (hi >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale.float(), minimum.float()


def _q3_k(b):
    # hmask[32], qs[64], scales[12] (16 x 6-bit signed, offset 32), d
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = _bits(packed[:, :8], 4).reshape(n, 16)
    high = _bits(packed[:, 8:12], 2).reshape(n, 16)
    scale = ((low | (high << 4)).to(torch.int16) - 32).float()
    lo2 = _bits(qs.reshape(n * 2, 32), 2).reshape(n, 16, 16).to(torch.int16)
    hbit = _bits(hmask, 1).reshape(n, 16, 16).to(torch.int16)
    q = lo2 - 4 * (1 - hbit)  # a clear high bit subtracts 4
    return (d.unsqueeze(-1) * scale.unsqueeze(-1) * q.float()).reshape(n, QK_K)


RUN_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K})


def code_runs(b: torch.Tensor, ggml_type: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0, Q4_1, Q4_K, Q5_0, Q5_1 or Q5_K blocks [n, type_size] as runs of 32 weights
    w = scale * q + offset: the codes q [runs, 32] uint8 (4 bits, or 5 for the Q5 types), scale
    and offset [runs, 1] float32 (a block is one run; a K block, eight under its 6-bit scales and
    minimums)."""
    n = b.shape[0]
    if ggml_type == T.Q4_0:  # w = d (q - 8)
        d = _f16(b[:, :2])
        return _nibbles(b[:, 2:]), d, -8 * d
    if ggml_type == T.Q4_1:  # w = d q + m
        return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])
    if ggml_type == T.Q5_0:  # w = d (q - 16), the fifth bits in a 32-bit mask
        d = _f16(b[:, :2])
        return _nibbles(b[:, 6:]) | (_bit_planes(b[:, 2:6]) << 4), d, -16 * d
    if ggml_type == T.Q5_1:  # w = d q + m
        return _nibbles(b[:, 8:]) | (_bit_planes(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4])
    scale, minimum = _k_scale_min(b[:, 4:16])  # Q4_K, Q5_K: w = d sc q - dmin mn
    if ggml_type == T.Q4_K:
        q = _bits(b[:, 16:].reshape(n * 4, 32), 4).reshape(n * 8, 32)
    else:
        assert ggml_type == T.Q5_K, ggml_type
        low = _bits(b[:, 48:176].reshape(n * 4, 32), 4).reshape(n, 8, 32)
        q = (low | (_bits(b[:, 16:48], 1).reshape(n, 8, 32) << 4)).reshape(n * 8, 32)
    return q, (_f16(b[:, :2]) * scale).reshape(-1, 1), (-_f16(b[:, 2:4]) * minimum).reshape(-1, 1)


def _runs(ggml_type: T):
    def dequant(b):
        q, scale, offset = code_runs(b, ggml_type)
        return (scale * q.float() + offset).reshape(b.shape[0], -1)
    return dequant


def _q6_k(b):
    # ql[128], qh[64], scales[16] int8, d
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    # per half of 128: quarter k = nibble * 2 + which 32 bytes of ql; high bits: plane k of qh
    low = _bits(ql.reshape(n * 2, 64), 4).reshape(n, 2, 4, 32)
    high = _bits(qh.reshape(n * 2, 32), 2).reshape(n, 2, 4, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(n, 16, 16)
    return (d.unsqueeze(-1) * scales.unsqueeze(-1) * q).reshape(n, QK_K)


_BLOCK_DEQUANT = {
    **{t: _runs(t) for t in RUN_TYPES}, T.Q8_0: _q8_0, T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q6_K: _q6_k,
}
SUPPORTED_TYPES = frozenset([T.F32, T.F16, T.BF16, *_BLOCK_DEQUANT])


def dequantize(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw: flat uint8 bytes of one tensor -> tensor of `shape` (outermost first) in `dtype`."""
    assert raw.dtype == torch.uint8 and raw.dim() == 1
    if ggml_type == T.F32:
        out = raw.view(torch.float32)
    elif ggml_type == T.F16:
        out = raw.view(torch.float16)
    elif ggml_type == T.BF16:
        out = raw.view(torch.bfloat16)
    else:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        out = _BLOCK_DEQUANT[ggml_type](raw.view(-1, type_size))
    return out.reshape(shape).to(dtype)
