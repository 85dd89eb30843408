"""Products with GGUF weight matrices read in place, and their dequantisation, in Numba.

`matmul(kind, blocks, x)` is x @ W.T for a few rows of x (a decode step, a short follow-up). It
reads the matrix's stored bytes and nothing else: 0.56 (Q4_K) to 1.06 (Q8_0) bytes per weight
against bfloat16's 2 and float32's 4, which is what a decode step on a CPU waits for. Each run
of 32 weights is decoded where it is used (by cpu_ops/vector_runs.py, or by a plain vectorised
loop for Q8_0's bytes) and added into 32 lanes, so a row costs one horizontal sum.
`dequantize(kind, blocks, width)` writes the whole matrix in float32, for products over many
rows, where arithmetic, not reading, sets the pace. Both split W's rows between Numba's threads;
a kernel is compiled per type.

`Activations` holds a decode step's input rows, and on an AVX2 machine their 8-bit form: x
rounded per run of 32 to xq * dx, dx = max|x| / 127, as ggml's q8 activations. Its products
(`product_into`) sum codes times xq in integer lanes (cpu_ops/int8_runs.py), where decoding
each weight to a float costs more than reading it; they equal W @ (xq * dx) within float32
summation.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops import int8_runs, named_for
from cpu_ops.checks import expect
from cpu_ops.gguf_blocks import (BLOCK_SIZE, KERNEL_TYPES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, RUN, TYPE_SIZE, U,
                                 block_halves, byte_run_layout, run_params, split_nibbles_at)
from cpu_ops.int8_runs import byte_run_dot, nibble_run_dot, signed_run_dot
from cpu_ops.vector_runs import byte_run_fma, byte_run_store, nibble_run_fma, nibble_run_store

ROWS_PER_TASK = 32  # rows of W a thread takes at a time: enough tasks to balance 2 to 16 threads


@nb.njit(inline="always", fastmath=True, cache=True)
def _row_runs(kind, runs, type_size, ru, ri, num_blocks, target, xm, store):
    """Every run of one row of W (ru, ri: its bytes): with store, its weights written to target (a
    row of W in float32); else weight * xm added into target's 32 lanes. kind, runs, type_size and
    store are constants of the kernel this is inlined into, so LLVM folds the branches away."""
    for b in range(num_blocks):
        o = b * U(type_size)
        d, dmin = block_halves(kind, ru, o)
        for k in range(U(runs)):
            s_lo, s_hi, offset, bits = run_params(kind, ru, ri, o, k, d, dmin)
            x0 = (b * U(runs) + k) * U(RUN)
            if kind == Q4_0 or kind == Q4_1 or kind == Q5_0 or kind == Q5_1:
                if store:
                    nibble_run_store(target, x0, ru, split_nibbles_at(kind, o), s_lo, offset, bits)
                else:
                    nibble_run_fma(target, ru, split_nibbles_at(kind, o), xm, x0, s_lo, offset, bits)
            elif kind == Q4_K or kind == Q5_K or kind == Q6_K:
                low, shift, high, high_shift, high_mask, center = byte_run_layout(kind, o, k)
                if store:
                    byte_run_store(target, x0, ru, low, shift, high, high_shift, high_mask, center,
                                   s_lo, s_hi, offset)
                else:
                    byte_run_fma(target, ru, low, shift, high, high_shift, high_mask, center, xm, x0,
                                 s_lo, s_hi, offset)
            elif store:  # Q8_0: signed bytes, which a plain loop vectorises
                for j in range(U(RUN)):
                    target[x0 + j] = s_lo * np.float32(ri[o + U(2) + j])
            else:
                for j in range(U(RUN)):
                    target[j] += s_lo * np.float32(ri[o + U(2) + j]) * xm[x0 + j]


@nb.njit(fastmath=True)
def _int8_run(kind, runs, lanes, ru, ri, o, b, k, d, dmin, xm, dx, half_sums):
    """Run k of the block at byte o (block b) of one row of W times the 8-bit inputs xm, into the
    row's 8 lanes; returns the share of the offsets and centers, (offset - s_h c) * sums[h].
    A call that LLVM inlines, kind and k constants there: inlined in Numba's IR instead, its eight
    copies in a K type's int8_matmul took 13-16 s to compile, against 2-3 s, for the same speed.
    Not cached itself (the kernels that call it hold its code in their own cache files): kind is
    a literal of its signature, and one function's signatures share a cache index that Numba
    updates without a lock (named_for)."""
    s_lo, s_hi, offset, bits = run_params(kind, ru, ri, o, k, d, dmin)
    run = b * U(runs) + k
    x0, first, second = run * U(RUN), half_sums[U(2) * run], half_sums[U(2) * run + U(1)]
    if kind == Q4_0 or kind == Q4_1 or kind == Q5_0 or kind == Q5_1:
        nibble_run_dot(lanes, ru, split_nibbles_at(kind, o), bits, xm, x0, s_lo * dx[run])
        return offset * (first + second)
    if kind == Q4_K or kind == Q5_K or kind == Q6_K:
        low, shift, high, high_shift, high_mask, center = byte_run_layout(kind, o, k)
        byte_run_dot(lanes, ru, low, shift, high, high_shift, high_mask, xm, x0, s_lo * dx[run], s_hi * dx[run])
        c = np.float32(center)
        return (offset - s_lo * c) * first + (offset - s_hi * c) * second
    signed_run_dot(lanes, ri, o + U(2), xm, x0, s_lo * dx[run])
    return np.float32(0)


def _compile(weight_type):
    """The type's three kernels (float32 products, dequantisation, products over 8-bit inputs);
    its number (kind) and sizes are constants of each (a closure's variables)."""
    kind, block_size, type_size = int(weight_type), BLOCK_SIZE[weight_type], TYPE_SIZE[weight_type]
    runs = block_size // RUN

    @nb.njit(parallel=True, fastmath=True, cache=True)
    @named_for(weight_type.name)
    def matmul(u8, i8, x, y):
        # u8, i8: [out, row_bytes]; x: [M, in] float32 -> y: [M, out] float32
        num_out, num_x = u8.shape[0], x.shape[0]
        num_blocks = U(x.shape[1] // block_size)
        for task in nb.prange((num_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            lanes = np.empty(RUN, np.float32)
            for m in range(num_x):
                for r in range(task * ROWS_PER_TASK, min(num_out, (task + 1) * ROWS_PER_TASK)):
                    lanes[:] = 0
                    _row_runs(kind, runs, type_size, u8[r], i8[r], num_blocks, lanes, x[m], False)
                    y[m, r] = lanes.sum()

    @nb.njit(parallel=True, fastmath=True, cache=True, nogil=True)  # nogil: threads may dequantise parts at once
    @named_for(weight_type.name)
    def dequantize(u8, i8, out):
        # u8, i8: [out, row_bytes] -> out: [out, in] float32
        num_out, num_blocks = u8.shape[0], U(out.shape[1] // block_size)
        for task in nb.prange((num_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            for r in range(task * ROWS_PER_TASK, min(num_out, (task + 1) * ROWS_PER_TASK)):
                _row_runs(kind, runs, type_size, u8[r], i8[r], num_blocks, out[r], out[r], True)

    @nb.njit(parallel=True, fastmath=True, cache=True)
    @named_for(weight_type.name)
    def int8_matmul(u8, i8, xq, scales, sums, y):
        # xq: [M, in] int8, scales: [M, in / 32], sums: [M, in / 16] (Activations) -> y: [M, out]
        num_out, num_x = u8.shape[0], xq.shape[0]
        num_blocks = U(xq.shape[1] // block_size)
        for task in nb.prange((num_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            lanes = np.empty(8, np.float32)
            for m in range(num_x):
                xm, dx, half_sums = xq[m], scales[m], sums[m]
                for r in range(task * ROWS_PER_TASK, min(num_out, (task + 1) * ROWS_PER_TASK)):
                    ru, ri = u8[r], i8[r]
                    lanes[:] = 0
                    rest = np.float32(0)  # the offsets' and centers' share, sum_h (offset - s_h c) * sums[h]
                    for b in range(num_blocks):
                        o = b * U(type_size)
                        d, dmin = block_halves(kind, ru, o)
                        if kind == Q4_K or kind == Q5_K or kind == Q6_K:  # written out: each run's shifts
                            # and offsets become constants (Q6_K's 12 products a Qwen2.5-0.5B step: 8.6 -> 5.7 ms)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(0), d, dmin, xm, dx, half_sums)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(1), d, dmin, xm, dx, half_sums)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(2), d, dmin, xm, dx, half_sums)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(3), d, dmin, xm, dx, half_sums)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(4), d, dmin, xm, dx, half_sums)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(5), d, dmin, xm, dx, half_sums)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(6), d, dmin, xm, dx, half_sums)
                            rest += _int8_run(kind, runs, lanes, ru, ri, o, b, U(7), d, dmin, xm, dx, half_sums)
                        else:
                            for k in range(U(runs)):
                                rest += _int8_run(kind, runs, lanes, ru, ri, o, b, k, d, dmin, xm, dx, half_sums)
                    y[m, r] = lanes.sum() + rest

    return matmul, dequantize, int8_matmul


_KERNELS = {t: _compile(t) for t in KERNEL_TYPES}


def _check(kind, blocks: np.ndarray, width: int):
    if kind not in _KERNELS:
        raise ValueError(f"no kernel reads GGUF type {kind!r}; these do: {', '.join(t.name for t in KERNEL_TYPES)}")
    expect("blocks", blocks, ndim=2, dtype=np.uint8)
    if not blocks.flags.c_contiguous:
        raise ValueError("blocks must be C-contiguous")
    if width % BLOCK_SIZE[kind] or blocks.shape[1] != width // BLOCK_SIZE[kind] * TYPE_SIZE[kind]:
        raise ValueError(f"blocks of shape {blocks.shape} do not hold rows of {width} {kind.name} weights")


def matmul(kind, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """kind: a GGMLQuantizationType of KERNEL_TYPES; blocks: [out, row_bytes] uint8, W's rows as
    stored; x: [M, in] float32 -> x @ W.T: [M, out] float32."""
    expect("x", x, ndim=2, dtype=np.float32)
    _check(kind, blocks, x.shape[1])
    y = np.empty((x.shape[0], blocks.shape[0]), np.float32)
    _KERNELS[kind][0](blocks, blocks.view(np.int8), np.ascontiguousarray(x), y)
    return y


@nb.njit(cache=True)  # no fastmath: x * (127 / max) rounds as numpy does, not by a reciprocal
def _quantize_rows(x, xq, scales, sums):
    for m in range(x.shape[0]):
        for run in range(x.shape[1] // RUN):
            x0 = run * RUN
            big = np.float32(0)
            for j in range(RUN):
                big = max(big, abs(x[m, x0 + j]))
            inverse = np.float32(127) / big if big > 0 else np.float32(0)
            scales[m, run] = big / np.float32(127)
            for h in range(2):
                total = np.int32(0)
                for j in range(x0 + 16 * h, x0 + 16 * h + 16):
                    q = np.int32(np.rint(x[m, j] * inverse))
                    xq[m, j] = q
                    total += q
                sums[m, 2 * run + h] = scales[m, run] * np.float32(total)


class Activations:
    """A product's input rows x [M, width] float32 (write them into `.x`), and after `quantize()`
    their 8-bit form for `product_into`: xq [M, width] int8 = round(x * 127 / max|run|), the
    runs' scales dx = max|run| / 127 [M, width / 32] and dx * sum(xq) over each 16 [M, width / 16].
    With int8 False (by default, where the machine has no AVX2) quantize() does nothing and
    products use x as it is."""

    def __init__(self, rows: int, width: int, int8: bool | None = None):
        if width % RUN:
            raise ValueError(f"8-bit activations come in runs of {RUN}; a width of {width} is not whole runs")
        self.x = np.zeros((rows, width), np.float32)
        self.int8 = int8_runs.AVAILABLE if int8 is None else int8
        self.xq = np.zeros((rows, width), np.int8)
        self.scales = np.zeros((rows, width // RUN), np.float32)
        self.sums = np.zeros((rows, width // 16), np.float32)

    def quantize(self) -> None:
        if self.int8:
            _quantize_rows(self.x, self.xq, self.scales, self.sums)


def product_into(kind, blocks: np.ndarray, signed: np.ndarray, x: Activations, y: np.ndarray) -> None:
    """y [M, out] = x @ W.T without per-call checks (a caller that checked the matrix once and calls
    it every layer of every step; signed: blocks.view(np.int8)): in integer lanes over x's 8-bit
    form (quantized), or in float lanes over x.x where the machine has no AVX2."""
    if x.int8:
        _KERNELS[kind][2](blocks, signed, x.xq, x.scales, x.sums, y)
    else:
        _KERNELS[kind][0](blocks, signed, x.x, y)


def dequantize(kind, blocks: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """blocks: [out, row_bytes] uint8 of rows of `width` weights -> W: [out, width] float32, written
    into `out` where given (a buffer reused across products spares the allocation's page faults)."""
    _check(kind, blocks, width)
    if out is None:
        out = np.empty((blocks.shape[0], width), np.float32)
    expect("out", out, dtype=np.float32, shape=(blocks.shape[0], width))
    _KERNELS[kind][1](blocks, blocks.view(np.int8), out)
    return out
