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


def to_bf16(x: np.ndarray, rounding: str = "nearest", out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> uint16 words. "nearest" rounds half to even, on every decode thread (a 1M
    cache's anchors at 8B shapes are 268M values: 2.5 s in numpy on one core, at the end of its
    prefill), into `out` if given (x's shape, each leading row contiguous); "up" / "down" round
    toward +inf / -inf (bounds stay bounds)."""
    x = np.asarray(x, np.float32)
    if rounding == "nearest":
        out = np.empty(x.shape, np.uint16) if out is None else out
        assert out.shape == x.shape and out.dtype == np.uint16
        if x.size < PARALLEL_FROM:  # a block or a few (no kernel to compile for them)
            u = np.ascontiguousarray(x).view(np.uint32)
            out[...] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            return out
        rows = x.shape[0] if x.ndim > 1 else 1  # rows as they lie (a slice of blocks keeps each kv head's row whole)
        target = out.reshape(rows, -1)
        assert np.shares_memory(target, out), "out's rows must each be contiguous"
        _nearest_rows(x.reshape(rows, -1), target)
        return out
    assert out is None, "out is for rounding to nearest"
    x = np.ascontiguousarray(x)
    u = x.view(np.uint32)
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


ROUNDING_PIECE = 1 << 14  # values a thread rounds at a time
PARALLEL_FROM = 1 << 20  # values from which to_bf16 rounds on every thread


@nb.njit(parallel=True, cache=True)
def _nearest_rows(x, out):
    """out[r, i] = x[r, i] as bfloat16 rounded to nearest even, in pieces across the threads."""
    rows, n = x.shape
    pieces = (n + ROUNDING_PIECE - 1) // ROUNDING_PIECE
    for p in nb.prange(rows * pieces):
        r, start = p // pieces, (p % pieces) * ROUNDING_PIECE
        for i in range(start, min(start + ROUNDING_PIECE, n)):
            out[r, i] = bf16_word(x[r, i])


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
