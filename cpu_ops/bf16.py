"""bfloat16 as 16-bit words: numpy encoders and decoders, and the Numba scalar widening.

A bfloat16 is the top half of a float32, so widening is a shift and a bit cast, which LLVM
vectorises inside any loop that reads the words.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload


def to_bf16(x: np.ndarray, rounding: str = "nearest") -> np.ndarray:
    """float32 -> uint16 words. "nearest" rounds half to even; "up" / "down" round toward
    +inf / -inf (bounds stay bounds)."""
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32)
    if rounding == "nearest":
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    truncated = (u >> 16).astype(np.uint16)  # toward zero
    inexact = from_bf16(truncated) != x
    away = inexact & ((x > 0) == (rounding == "up"))
    return truncated + away.astype(np.uint16)


def from_bf16(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


@intrinsic
def bits_as_float32(typingctx, bits):
    """The low 32 bits of an integer, reinterpreted as a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def float32_bits(typingctx, value):
    """A float32's 32 bits as a uint32 (a wider float is rounded to float32 first)."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        v = args[0] if value.bitwidth == 32 else builder.fptrunc(args[0], ir.FloatType())
        return builder.bitcast(v, ir.IntType(32))

    return types.uint32(value), codegen


@nb.njit(inline="always", cache=True)
def bf16_word(value):
    """float32 -> its bfloat16 word, rounded to nearest even (to_bf16's "nearest")."""
    bits = float32_bits(value)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@nb.njit(inline="always", cache=True)
def bf16_value(word):
    """One uint16 bfloat16 word -> float32."""
    return bits_as_float32(np.uint32(word) << 16)


def as_float32(x):
    """A stored element as float32 inside a kernel: uint16 words are bfloat16 (widened by a
    shift), float32 stays. Kernels written with it run straight on bfloat16 blocks, with no
    widened copy in between (the fp16 words, also uint16, are widened by load_rows instead)."""
    return np.float32(x)


@overload(as_float32, inline="always")
def _as_float32(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16 and not x.signed:
        return lambda x: bits_as_float32(np.uint32(x) << 16)
    if isinstance(x, types.Float):
        return lambda x: x
    # other stored types (q8_0 / q4_0 bytes) are widened by load_rows; this only lets a kernel
    # that branches on the storage kind type-check for them
    return lambda x: np.float32(x)
