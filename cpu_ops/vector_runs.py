"""Runs of 32 GGUF weights decoded with LLVM vector operations, for the Numba kernels.

Numba does integer arithmetic on 64-bit values, so a loop that shifts and masks codes before
converting them runs in 64-bit lanes, and converts them one at a time (AVX2 has no vector
conversion from 64-bit integers): 0.5-1 GB/s a core, measured, against 7 GB/s for Q8_0's
bytes, which need neither. Here a run's codes stay 32-bit lanes from load to conversion. LLVM
lowers the 16-lane vectors to the machine's (two AVX2 registers, one AVX-512).

Two layouts of codes:
- split nibbles (Q4_0, Q4_1, Q5_0, Q5_1): 16 bytes, weight j in byte j's low nibble and weight
  j + 16 in its high one, fifth bits (Q5) in a 32-bit mask;
- byte runs (Q4_K, Q5_K, Q6_K): weight j's low 4 bits at byte j of a table, shifted right by a
  run's shift; its high bits (Q5_K: 1, Q6_K: 2, Q4_K: none, mask 0) at byte j of a second table.

`*_fma(lanes, ..., x, x0, ...)` adds w * x[x0:x0 + 32] into lanes[0:32]; `*_store(out, x0, ...)`
writes w to out[x0:x0 + 32]. w = scale * (q - center) + offset, with the scale of weights 0-15
and that of 16-31 apart (Q6_K's sub-blocks of 16).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
V16F, V16I, V16B = ir.VectorType(F32, 16), ir.VectorType(I32, 16), ir.VectorType(ir.IntType(8), 16)


def _splat(builder, value, vector_type):
    if isinstance(vector_type.element, ir.IntType) and value.type.width != 32:
        value = builder.trunc(value, I32)
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(V16I, [0] * 16))


def _const(value):
    return ir.Constant(V16I, list(value) if isinstance(value, range) else [value] * 16)


def _bytes_at(context, builder, u8_type, u8, start, h):
    """16 bytes of a uint8 array from start + 16 h, as <16 x i32>."""
    data = context.make_array(u8_type)(context, builder, u8).data
    at = builder.gep(data, [builder.add(start, ir.Constant(start.type, 16 * h))])
    return builder.zext(builder.load(builder.bitcast(at, V16B.as_pointer()), align=1), V16I)


def _floats_at(context, builder, array_type, array, start, h):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [builder.add(start, ir.Constant(start.type, 16 * h))]), V16F.as_pointer())


def _weights(builder, codes, scales, offset):
    """codes: two <16 x i32> halves; scales: a float per half -> two <16 x float> of weights."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
    off = _splat(builder, offset, V16F)
    return fma, [builder.call(fma, [builder.sitofp(q, V16F), _splat(builder, s, V16F), off])
                 for q, s in zip(codes, scales)]


def _split_nibble_codes(context, builder, u8_type, u8, qs, bits):
    codes = _bytes_at(context, builder, u8_type, u8, qs, 0)
    halves = [builder.and_(codes, _const(15)), builder.lshr(codes, _const(4))]
    mask = _splat(builder, bits, V16I)
    for h in range(2):  # bit j (j + 16) of the mask becomes bit 4 of code j (j + 16); 0 for Q4
        bit = builder.and_(builder.lshr(mask, _const(range(16 * h, 16 * h + 16))), _const(1))
        halves[h] = builder.or_(halves[h], builder.shl(bit, _const(4)))
    return halves


def _byte_run_codes(context, builder, u8_type, u8, low, shift, high, high_shift, high_mask, center):
    codes = []
    for h in range(2):
        q = builder.and_(builder.lshr(_bytes_at(context, builder, u8_type, u8, low, h), _splat(builder, shift, V16I)),
                         _const(15))
        top = builder.and_(builder.lshr(_bytes_at(context, builder, u8_type, u8, high, h),
                                        _splat(builder, high_shift, V16I)), _splat(builder, high_mask, V16I))
        codes.append(builder.sub(builder.or_(q, builder.shl(top, _const(4))), _splat(builder, center, V16I)))
    return codes


def _fma_into(context, builder, sig, lanes, x, x0, fma, weights, lanes_arg, x_arg):
    zero = ir.Constant(I64, 0)
    for h, w in enumerate(weights):
        xs = builder.load(_floats_at(context, builder, sig.args[x_arg], x, x0, h), align=4)
        acc = _floats_at(context, builder, sig.args[lanes_arg], lanes, zero, h)
        builder.store(builder.call(fma, [w, xs, builder.load(acc, align=4)]), acc, align=4)


def _store(context, builder, sig, out, x0, weights):
    for h, w in enumerate(weights):
        builder.store(w, _floats_at(context, builder, sig.args[0], out, x0, h), align=4)


def _check(floats, u8, x=None):
    assert isinstance(u8, types.Array) and u8.dtype == types.uint8 and u8.ndim == 1
    assert floats.dtype == types.float32 and floats.ndim == 1
    assert x is None or (x.dtype == types.float32 and x.ndim == 1)


@intrinsic
def nibble_run_fma(typingctx, lanes, u8, qs, x, x0, scale, offset, bits):
    _check(lanes, u8, x)
    sig = types.void(lanes, u8, qs, x, x0, scale, offset, bits)

    def codegen(context, builder, signature, args):
        lanes_v, u8_v, qs_v, x_v, x0_v, scale_v, offset_v, bits_v = args
        codes = _split_nibble_codes(context, builder, signature.args[1], u8_v, qs_v, bits_v)
        fma, weights = _weights(builder, codes, (scale_v, scale_v), offset_v)
        _fma_into(context, builder, signature, lanes_v, x_v, x0_v, fma, weights, 0, 3)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def nibble_run_store(typingctx, out, x0, u8, qs, scale, offset, bits):
    _check(out, u8)
    sig = types.void(out, x0, u8, qs, scale, offset, bits)

    def codegen(context, builder, signature, args):
        out_v, x0_v, u8_v, qs_v, scale_v, offset_v, bits_v = args
        codes = _split_nibble_codes(context, builder, signature.args[2], u8_v, qs_v, bits_v)
        _store(context, builder, signature, out_v, x0_v, _weights(builder, codes, (scale_v, scale_v), offset_v)[1])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def byte_run_fma(typingctx, lanes, u8, low, shift, high, high_shift, high_mask, center, x, x0, s_lo, s_hi, offset):
    _check(lanes, u8, x)
    sig = types.void(lanes, u8, low, shift, high, high_shift, high_mask, center, x, x0, s_lo, s_hi, offset)

    def codegen(context, builder, signature, args):
        lanes_v, u8_v, low_v, shift_v, high_v, hs_v, hm_v, center_v, x_v, x0_v, s_lo_v, s_hi_v, offset_v = args
        codes = _byte_run_codes(context, builder, signature.args[1], u8_v, low_v, shift_v, high_v, hs_v, hm_v, center_v)
        fma, weights = _weights(builder, codes, (s_lo_v, s_hi_v), offset_v)
        _fma_into(context, builder, signature, lanes_v, x_v, x0_v, fma, weights, 0, 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def byte_run_store(typingctx, out, x0, u8, low, shift, high, high_shift, high_mask, center, s_lo, s_hi, offset):
    _check(out, u8)
    sig = types.void(out, x0, u8, low, shift, high, high_shift, high_mask, center, s_lo, s_hi, offset)

    def codegen(context, builder, signature, args):
        out_v, x0_v, u8_v, low_v, shift_v, high_v, hs_v, hm_v, center_v, s_lo_v, s_hi_v, offset_v = args
        codes = _byte_run_codes(context, builder, signature.args[2], u8_v, low_v, shift_v, high_v, hs_v, hm_v, center_v)
        _store(context, builder, signature, out_v, x0_v, _weights(builder, codes, (s_lo_v, s_hi_v), offset_v)[1])
        return context.get_dummy_value()

    return sig, codegen
