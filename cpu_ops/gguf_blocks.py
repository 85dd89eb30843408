"""GGUF weight blocks decoded inside Numba kernels, as ggml lays them out (ggml-common.h).

A matrix stays as the file stores it: `u8` [rows, row_bytes] (and the same bytes as int8, `i8`,
for the types with signed codes), each row whole blocks. Every type here is read as runs of 32
weights w = scale * q + offset, where the first and last 16 weights of a run may have scales of
their own (Q6_K's sub-blocks of 16): `block_halves` and `run_params` give a run's scales, offset and fifth bits; Q8_0's
codes are bytes, and the other types' runs are decoded by cpu_ops/vector_runs.py, from the
16 bytes of split nibbles at `split_nibbles_at` or the byte tables of `byte_run_layout`. The
products and the dequantisation in gguf_matmul.py both read blocks through these, so both compute
each weight as ggml does, in float32 (for every type but Q6_K the product scale * q is exact, and
so is the weight; Q6_K rounds (d * scale) * q as ggml does).

Indices are unsigned: with signed ones Numba wraps negative indices around, and the check it
emits for that stops LLVM from vectorising the loops over a run.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba as nb
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from cpu_ops.bf16 import bits_as_float32

# the types read in place, by ggml's type number (a kernel is compiled per type)
KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
BLOCK_SIZE = {t: GGML_QUANT_SIZES[t][0] for t in KERNEL_TYPES}
TYPE_SIZE = {t: GGML_QUANT_SIZES[t][1] for t in KERNEL_TYPES}
RUN = 32  # weights per run: a block of the small types, an eighth of a K block

U = np.uint64
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1), int(T.Q8_0)
Q4_K, Q5_K, Q6_K = int(T.Q4_K), int(T.Q5_K), int(T.Q6_K)


F16C = bool(llvm.get_host_cpu_features().get("f16c", False))  # x86's half -> float instruction


@intrinsic
def _half_f16c(typingctx, u8, o):
    """The half at bytes o, o + 1 widened by the machine's instruction (vcvtph2ps)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.bitcast(builder.gep(data, [args[1]]), ir.HalfType().as_pointer())
        return builder.fpext(builder.load(at, align=1), ir.FloatType())

    return types.float32(u8, o), codegen


@nb.njit(inline="always", cache=True)
def half_by_bits(u8, o):
    """The IEEE half at bytes o, o + 1 -> float32 without F16C: its bits moved into a float32 and
    scaled by 2^112, which rebiases the exponent of normal values and makes subnormal ones
    normal; exact for every finite half, without branches (a scale is never inf or nan in a
    valid file)."""
    h = np.uint32(u8[o]) | (np.uint32(u8[o + U(1)]) << np.uint32(8))
    bits = ((h & np.uint32(0x7FFF)) << np.uint32(13)) | ((h & np.uint32(0x8000)) << np.uint32(16))
    return bits_as_float32(bits) * np.float32(5.192296858534828e+33)


@nb.njit(inline="always", cache=True)
def _half(u8, o):
    """The IEEE half at bytes o, o + 1 -> float32, exactly: one instruction with F16C, eight
    scalar operations (a block's) without."""
    if F16C:
        return _half_f16c(u8, o)
    return half_by_bits(u8, o)


@nb.njit(inline="always", cache=True)
def _u32(u8, o):
    return (np.uint32(u8[o]) | (np.uint32(u8[o + U(1)]) << np.uint32(8))
            | (np.uint32(u8[o + U(2)]) << np.uint32(16)) | (np.uint32(u8[o + U(3)]) << np.uint32(24)))


@nb.njit(inline="always", cache=True)
def _k_scale_min(u8, s, k):
    """Q4_K / Q5_K: the 6-bit scale and minimum of sub-block k from the 12 bytes at s."""
    if k < U(4):
        return np.float32(u8[s + k] & np.uint8(63)), np.float32(u8[s + k + U(4)] & np.uint8(63))
    sc = (u8[s + k + U(4)] & np.uint8(15)) | ((u8[s + k - U(4)] >> np.uint8(6)) << np.uint8(4))
    mn = (u8[s + k + U(4)] >> np.uint8(4)) | ((u8[s + k] >> np.uint8(6)) << np.uint8(4))
    return np.float32(sc), np.float32(mn)


@nb.njit(inline="always", cache=True)
def block_halves(kind, u8, o):
    """The block at byte o's float16 fields: (its scale d, its minimum or dmin, or 0), read once
    for all of a K block's eight runs."""
    if kind == Q4_1 or kind == Q5_1 or kind == Q4_K or kind == Q5_K:
        return _half(u8, o), _half(u8, o + U(2))
    return _half(u8, o + (U(208) if kind == Q6_K else U(0))), np.float32(0)


@nb.njit(inline="always", cache=True)
def run_params(kind, u8, i8, o, k, d, m):
    """Run k of the block at byte o of a row, whose halves are d, m (block_halves): (scale of
    weights 0-15, scale of 16-31, offset, the run's fifth bits as a 32-bit mask, or 0)."""
    zero, none = np.float32(0), np.uint32(0)
    if kind == Q8_0:
        return d, d, zero, none
    if kind == Q4_0:
        return d, d, np.float32(-8) * d, none
    if kind == Q4_1:
        return d, d, m, none
    if kind == Q5_0:
        return d, d, np.float32(-16) * d, _u32(u8, o + U(2))
    if kind == Q5_1:
        return d, d, m, _u32(u8, o + U(4))
    if kind == Q4_K or kind == Q5_K:  # d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
        sc, mn = _k_scale_min(u8, o + U(4), k)
        scale = d * sc
        return scale, scale, -(m * mn), none
    # Q6_K: ql[128], qh[64], scales[16] int8, d; run k reads scales 2k' and 2k' + 1 of its half
    s = o + U(192) + U(8) * (k // U(4)) + U(2) * (k % U(4))
    return d * np.float32(i8[s]), d * np.float32(i8[s + U(1)]), zero, none


@nb.njit(inline="always", cache=True)
def split_nibbles_at(kind, o):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: the byte of the block at o where its 16 bytes of codes start
    (weight j < 16 in byte j's low nibble, weight j + 16 in its high one)."""
    return o + (U(2) if kind == Q4_0 else U(6) if kind == Q5_0 else U(4) if kind == Q4_1 else U(8))


@nb.njit(inline="always", cache=True)
def byte_run_layout(kind, o, k):
    """Q4_K / Q5_K / Q6_K, run k of the block at byte o, as vector_runs' byte runs read it: (the
    table of low 4 bits, their shift, the table of high bits, their shift, their mask, center)."""
    if kind == Q4_K or kind == Q5_K:  # runs 2g and 2g + 1: the low and high nibbles of 32 bytes
        low = o + (U(16) if kind == Q4_K else U(48)) + U(32) * (k // U(2))
        shift = U(4) * (k % U(2))
        if kind == Q4_K:
            return low, shift, low, U(0), U(0), U(0)
        return low, shift, o + U(16), k, U(1), U(0)  # Q5_K: bit k of qh[j]
    # Q6_K: run k = 4 n + p of half n: low 4 bits from ql (byte j, or j + 32 for odd p; the high
    # nibble for p >= 2), high 2 bits from qh[j] at bit 2p; codes are centred on 32
    p = k % U(4)
    low = o + U(64) * (k // U(4)) + U(32) * (p % U(2))
    return low, U(4) * (p // U(2)), o + U(128) + U(32) * (k // U(4)), U(2) * p, U(3), U(32)
