"""Products with GGUF weight matrices read in place, and their dequantisation, in Numba.

`matmul(kind, blocks, x)` is x @ W.T for a few rows of x (a decode step, a short follow-up). It
reads the matrix's stored bytes and nothing else: 0.56 (Q4_K) to 1.06 (Q8_0) bytes per weight
against bfloat16's 2 and float32's 4, which is what a decode step on a CPU waits for. Each weight
is decoded where it is used and added into 32 lanes that follow the run (decoded by
cpu_ops/vector_runs.py, or by a plain vectorised loop for Q8_0's bytes), so a row costs
one horizontal sum. `dequantize(kind, blocks)`
writes the whole matrix in float32, for products over many rows, where arithmetic, not reading,
sets the pace. Both split W's rows between Numba's threads; a kernel is compiled per type.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.checks import expect
from cpu_ops.gguf_blocks import (BLOCK_SIZE, BYTE_RUN_KINDS, KERNEL_TYPES, RUN, SPLIT_NIBBLE_KINDS, TYPE_SIZE, U,
                                 block_halves, byte_run_layout, run_params, split_nibbles_at)
from cpu_ops.vector_runs import byte_run_fma, byte_run_store, nibble_run_fma, nibble_run_store

ROWS_PER_TASK = 32  # rows of W a thread takes at a time: enough tasks to balance 2 to 16 threads


def _compile(kind: int, block_size: int, type_size: int):
    runs = block_size // RUN
    split, byte_runs = kind in SPLIT_NIBBLE_KINDS, kind in BYTE_RUN_KINDS

    @nb.njit(parallel=True, fastmath=True, cache=True)
    def matmul(u8, i8, x, y):
        # u8, i8: [out, row_bytes]; x: [M, in] float32 -> y: [M, out] float32
        num_out, num_x = u8.shape[0], x.shape[0]
        num_blocks = U(x.shape[1] // block_size)
        for task in nb.prange((num_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            lanes = np.empty(RUN, np.float32)
            for m in range(num_x):
                xm = x[m]
                for r in range(task * ROWS_PER_TASK, min(num_out, (task + 1) * ROWS_PER_TASK)):
                    ru, ri = u8[r], i8[r]
                    lanes[:] = 0
                    for b in range(num_blocks):
                        o = b * U(type_size)
                        d, dmin = block_halves(kind, ru, o)
                        for k in range(U(runs)):
                            s_lo, s_hi, offset, bits = run_params(kind, ru, ri, o, k, d, dmin)
                            x0 = (b * U(runs) + k) * U(RUN)
                            if split:
                                nibble_run_fma(lanes, ru, split_nibbles_at(kind, o), xm, x0, s_lo, offset, bits)
                            elif byte_runs:
                                low, shift, high, high_shift, high_mask, center = byte_run_layout(kind, o, k)
                                byte_run_fma(lanes, ru, low, shift, high, high_shift, high_mask, center, xm, x0,
                                             s_lo, s_hi, offset)
                            else:  # Q8_0: signed bytes, which a plain loop vectorises
                                for j in range(U(RUN)):
                                    lanes[j] += s_lo * np.float32(ri[o + U(2) + j]) * xm[x0 + j]
                    y[m, r] = lanes.sum()

    @nb.njit(parallel=True, fastmath=True, cache=True)
    def dequantize(u8, i8, out):
        # u8, i8: [out, row_bytes] -> out: [out, in] float32
        num_out, num_blocks = u8.shape[0], U(out.shape[1] // block_size)
        for task in nb.prange((num_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            for r in range(task * ROWS_PER_TASK, min(num_out, (task + 1) * ROWS_PER_TASK)):
                ru, ri, row = u8[r], i8[r], out[r]
                for b in range(num_blocks):
                    o = b * U(type_size)
                    d, dmin = block_halves(kind, ru, o)
                    for k in range(U(runs)):
                        s_lo, s_hi, offset, bits = run_params(kind, ru, ri, o, k, d, dmin)
                        x0 = (b * U(runs) + k) * U(RUN)
                        if split:
                            nibble_run_store(row, x0, ru, split_nibbles_at(kind, o), s_lo, offset, bits)
                        elif byte_runs:
                            low, shift, high, high_shift, high_mask, center = byte_run_layout(kind, o, k)
                            byte_run_store(row, x0, ru, low, shift, high, high_shift, high_mask, center,
                                           s_lo, s_hi, offset)
                        else:
                            for j in range(U(RUN)):
                                row[x0 + j] = s_lo * np.float32(ri[o + U(2) + j])

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


def dequantize(kind, blocks: np.ndarray, width: int) -> np.ndarray:
    """blocks: [out, row_bytes] uint8 of rows of `width` weights -> W: [out, width] float32."""
    _check(kind, blocks, width)
    out = np.empty((blocks.shape[0], width), np.float32)
    _KERNELS[kind][1](blocks, blocks.view(np.int8), out)
    return out
