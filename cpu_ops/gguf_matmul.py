"""Products with GGUF weight matrices read in place, and their dequantisation, in Numba.

`matmul(kind, blocks, x)` is x @ W.T for a few rows of x (a decode step, a short follow-up). It
reads the matrix's stored bytes and nothing else: 0.56 (Q4_K) to 1.06 (Q8_0) bytes per weight
against bfloat16's 2 and float32's 4, which is what a decode step on a CPU waits for. Each run
of 32 weights is decoded where it is used (by cpu_ops/vector_runs.py, or by a plain vectorised
loop for Q8_0's bytes) and added into 32 lanes, so a row costs one horizontal sum.
`dequantize(kind, blocks, width)` writes the whole matrix in float32, for products over many
rows, where arithmetic, not reading, sets the pace. Both split W's rows between Numba's threads;
a kernel is compiled per type.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.checks import expect
from cpu_ops.gguf_blocks import (BLOCK_SIZE, KERNEL_TYPES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, RUN, TYPE_SIZE, U,
                                 block_halves, byte_run_layout, run_params, split_nibbles_at)
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


def _compile(kind: int, block_size: int, type_size: int):
    """The type's two kernels; kind and the sizes are constants of each (a closure's variables),
    and Numba's cache keeps one entry per type."""
    runs = block_size // RUN

    @nb.njit(parallel=True, fastmath=True, cache=True)
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

    @nb.njit(parallel=True, fastmath=True, cache=True)
    def dequantize(u8, i8, out):
        # u8, i8: [out, row_bytes] -> out: [out, in] float32
        num_out, num_blocks = u8.shape[0], U(out.shape[1] // block_size)
        for task in nb.prange((num_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            for r in range(task * ROWS_PER_TASK, min(num_out, (task + 1) * ROWS_PER_TASK)):
                _row_runs(kind, runs, type_size, u8[r], i8[r], num_blocks, out[r], out[r], True)

    return matmul, dequantize


_KERNELS = {t: _compile(int(t), BLOCK_SIZE[t], TYPE_SIZE[t]) for t in KERNEL_TYPES}


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


def matmul_into(kind, blocks: np.ndarray, signed: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """matmul's product without its checks, into y [M, out]: for a caller that checked the
    matrix once and calls it every layer of every step (signed: blocks.view(np.int8))."""
    _KERNELS[kind][0](blocks, signed, x, y)


def dequantize(kind, blocks: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """blocks: [out, row_bytes] uint8 of rows of `width` weights -> W: [out, width] float32, written
    into `out` where given (a buffer reused across products spares the allocation's page faults)."""
    _check(kind, blocks, width)
    if out is None:
        out = np.empty((blocks.shape[0], width), np.float32)
    expect("out", out, dtype=np.float32, shape=(blocks.shape[0], width))
    _KERNELS[kind][1](blocks, blocks.view(np.int8), out)
    return out
