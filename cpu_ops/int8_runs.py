"""Runs of 32 GGUF weights times 8-bit activations, summed in integer lanes, for the Numba kernels.

A decode step's product is bound by decoding the weights: widening each code to a float and
multiplying it (cpu_ops/vector_runs.py) keeps two cores at 4-6 GB/s. With the activations
rounded to 8 bits per run of 32 (`x ≈ dx * xq`, as ggml's q8 activations), a run's dot product
is integer arithmetic on bytes: the codes stay 32 bytes, `pmaddubsw` multiplies them by xq and
adds pairs into 16-bit lanes, `pmaddwd` adds pairs again into 8 int32 lanes, and one float
multiply-add per run scales them into the row's 8 float lanes. Lanes 0-3 hold weights 0-15 and
lanes 4-7 weights 16-31, so Q6_K's two scales in a run are one vector.

The codes are unsigned (`pmaddubsw`'s first operand): split nibbles with their fifth bits and
K-type byte runs as they are stored, before their center is subtracted. The center and offset
(w = s * (q - center) + offset) are the caller's: with sums[h] = dx * sum(xq) over half h of the
run, they add (offset - s_h * center) * sums[h]. Q8_0's codes are signed: their magnitudes are
the unsigned operand and their signs go onto xq.

No sum overflows: a pair of codes times activations is at most 2 * 128 * 127 (Q8_0's -128) or
2 * 63 * 127, under int16's 32767, and a run's int32 lanes add 4 of them.

The x86 AVX2 instructions are called by name, so these compile only where `AVAILABLE`.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

AVAILABLE = bool(llvm.get_host_cpu_features().get("avx2", False))

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V4B, V16B, V32B = ir.VectorType(I8, 4), ir.VectorType(I8, 16), ir.VectorType(I8, 32)
V16S, V8I, V8F, V32I = ir.VectorType(I16, 16), ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(I32, 32)


def _bytes(vector, values):
    return ir.Constant(vector, list(values) if not isinstance(values, int) else [values] * vector.count)


def _pointer(context, builder, array_type, array, start, vector_type):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [start]), vector_type.as_pointer())


def _load(context, builder, array_type, array, start, vector_type):
    return builder.load(_pointer(context, builder, array_type, array, start, vector_type), align=1)


def _splat_byte(builder, value):
    undef = ir.Constant(V32B, ir.Undefined)
    one = builder.insert_element(undef, builder.trunc(value, I8), ir.Constant(I32, 0))
    return builder.shuffle_vector(one, undef, _bytes(V32I, 0))


def _dot_into(context, builder, signature, acc, codes, xq, xq_arg, x0, s_lo, s_hi):
    """acc[0:8] += <s_lo x4, s_hi x4> * pairwise sums of codes (unsigned) * xq[x0:x0 + 32]."""
    module = builder.module
    maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(V16S, [V32B, V32B]), "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(V8I, [V16S, V16S]), "llvm.x86.avx2.pmadd.wd")
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
    xs = xq if xq_arg is None else _load(context, builder, signature.args[xq_arg], xq, x0, V32B)
    lanes = builder.call(maddwd, [builder.call(maddubs, [codes, xs]), _bytes(V16S, 1)])
    scales = ir.Constant(V8F, ir.Undefined)
    for j in range(8):
        scales = builder.insert_element(scales, s_lo if j < 4 else s_hi, ir.Constant(I32, j))
    at = _pointer(context, builder, signature.args[0], acc, ir.Constant(I64, 0), V8F)
    builder.store(builder.call(fma, [builder.sitofp(lanes, V8F), scales, builder.load(at, align=4)]), at, align=4)


def _check(acc, u8, xq):
    assert acc.dtype == types.float32 and acc.ndim == 1
    assert u8.dtype in (types.uint8, types.int8) and u8.ndim == 1
    assert xq.dtype == types.int8 and xq.ndim == 1


@intrinsic
def nibble_run_dot(typingctx, acc, u8, qs, bits, xq, x0, scale):
    """Split nibbles (Q4_0, Q4_1, Q5_0, Q5_1): 16 bytes at qs, weight j in byte j's low nibble and
    j + 16 in its high one; bit j of `bits` is weight j's fifth bit (0 for Q4)."""
    _check(acc, u8, xq)
    sig = types.void(acc, u8, qs, bits, xq, x0, scale)

    def codegen(context, builder, signature, args):
        acc_v, u8_v, qs_v, bits_v, xq_v, x0_v, scale_v = args
        raw = _load(context, builder, signature.args[1], u8_v, qs_v, V16B)
        low, high = builder.and_(raw, _bytes(V16B, 15)), builder.lshr(raw, _bytes(V16B, 4))
        codes = builder.shuffle_vector(low, high, _bytes(V32I, range(32)))
        # byte j // 8 of the mask to byte j, its bit j % 8 tested: the fifth bit, as 16 or 0
        four = builder.bitcast(builder.trunc(bits_v, I32), V4B)
        spread = builder.shuffle_vector(four, ir.Constant(V4B, ir.Undefined), _bytes(V32I, [j // 8 for j in range(32)]))
        fifth = builder.icmp_unsigned("!=", builder.and_(spread, _bytes(V32B, [1 << (j % 8) for j in range(32)])),
                                      _bytes(V32B, 0))
        codes = builder.or_(codes, builder.select(fifth, _bytes(V32B, 16), _bytes(V32B, 0)))
        _dot_into(context, builder, signature, acc_v, codes, xq_v, 4, x0_v, scale_v, scale_v)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def byte_run_dot(typingctx, acc, u8, low, shift, high, high_shift, high_mask, xq, x0, s_lo, s_hi):
    """Byte runs (Q4_K, Q5_K, Q6_K): weight j's low 4 bits are byte low + j shifted right by
    `shift`; its high bits are byte high + j shifted right by `high_shift`, masked by `high_mask`."""
    _check(acc, u8, xq)
    sig = types.void(acc, u8, low, shift, high, high_shift, high_mask, xq, x0, s_lo, s_hi)

    def codegen(context, builder, signature, args):
        acc_v, u8_v, low_v, shift_v, high_v, hs_v, hm_v, xq_v, x0_v, s_lo_v, s_hi_v = args
        array_type = signature.args[1]
        q = builder.and_(builder.lshr(_load(context, builder, array_type, u8_v, low_v, V32B), _splat_byte(builder, shift_v)),
                         _bytes(V32B, 15))
        top = builder.and_(builder.lshr(_load(context, builder, array_type, u8_v, high_v, V32B), _splat_byte(builder, hs_v)),
                           _splat_byte(builder, hm_v))
        codes = builder.or_(q, builder.shl(top, _bytes(V32B, 4)))
        _dot_into(context, builder, signature, acc_v, codes, xq_v, 7, x0_v, s_lo_v, s_hi_v)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def signed_run_dot(typingctx, acc, i8, start, xq, x0, scale):
    """Signed bytes (Q8_0's 32 codes at start): |code| times xq carrying the code's sign."""
    _check(acc, i8, xq)
    sig = types.void(acc, i8, start, xq, x0, scale)

    def codegen(context, builder, signature, args):
        acc_v, i8_v, start_v, xq_v, x0_v, scale_v = args
        codes = _load(context, builder, signature.args[1], i8_v, start_v, V32B)
        xs = _load(context, builder, signature.args[3], xq_v, x0_v, V32B)
        negative = builder.icmp_signed("<", codes, _bytes(V32B, 0))
        magnitudes = builder.select(negative, builder.sub(_bytes(V32B, 0), codes), codes)
        signed_xs = builder.select(negative, builder.sub(_bytes(V32B, 0), xs), xs)
        _dot_into(context, builder, signature, acc_v, magnitudes, signed_xs, None, x0_v, scale_v, scale_v)
        return context.get_dummy_value()

    return sig, codegen
