"""A weight matrix kept on the CPU as the GGUF stores it, multiplied in place.

A decode step (or a short follow-up) multiplies a few rows by the matrix with the Numba kernels
of cpu_ops/gguf_matmul.py, which decode each block of the stored bytes as they go: the step
reads the bytes the file holds, 0.56 (Q4_K) to 1.06 (Q8_0) per weight, and nothing else. The
rows go in rounded to 8 bits per run of 32 where the machine has AVX2, as llama.cpp takes them,
for integer arithmetic (1.7-2.3x float32's speed: Qwen2.5-Coder-0.5B's matrices, 2 cores); the
CPU decode step quantizes its Activations itself (`product_into`), torch's decode step through
`product` (eight_bit). A prompt's rows keep float32 inputs however few they are: a prompt's
logits are where a rounding shows, SmolLM2-135M's first token of the README's example turning
from "Paris" to "L'" with its head's inputs in 8 bits, and again (The -2.11 against L' -1.87)
when a cached question's last token alone went through 8-bit layers, which made the server's
second answer to a question differ from its first.
A prefill chunk of many rows is bound by arithmetic instead: the matrix is dequantised to
float32 for that one product (ggml's values, exactly), and numpy's matmul (BLAS) does the rest.
Everything here is numpy, so the torch-free CPU engine (ktlong/models/cpu_llama.py) and torch's
model (through ktlong/models/llama.linear) share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from gguf import GGMLQuantizationType

from cpu_ops.checks import expect
from cpu_ops.gguf_matmul import Activations, dequantize, matmul, product_into
from cpu_ops.workers import Workers
from ktlong.gguf.model_config import unpermute_qk
from ktlong.gguf.reader import GGUFFile

MAX_IN_PLACE_ROWS = 16  # rows of x multiplied in place; more are a prefill chunk (dequantised once)


_SCRATCH = [np.empty(0, np.float32)]  # the float32 buffer prefill chunks dequantise into, grown to the largest matrix


def _scratch(shape: tuple[int, int]) -> np.ndarray:
    """A float32 [out, in] view of one buffer reused by every prefill product: a fresh matrix-sized
    allocation per product costs the kernel's page faults and zeroing, about as long as the
    dequantisation itself."""
    if _SCRATCH[0].size < shape[0] * shape[1]:
        _SCRATCH[0] = np.empty(shape[0] * shape[1], np.float32)
    return _SCRATCH[0][:shape[0] * shape[1]].reshape(shape)


@dataclass(frozen=True)
class StoredMatrix:
    """W [out, in] as GGUF blocks: `blocks` [out, bytes per row] uint8, each row whole blocks."""
    blocks: np.ndarray
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]

    @classmethod
    def stacked(cls, parts: list["StoredMatrix"]) -> tuple["StoredMatrix", list["StoredMatrix"]]:
        """One matrix of the parts' rows, in order, and each part as a view of its rows: products
        with parts that read the same input (q, k and v; gate and up) become one kernel call,
        and the bytes are held once. The parts must share a type and an input width."""
        assert len({(p.ggml_type, p.shape[1]) for p in parts}) == 1
        whole = np.concatenate([p.blocks for p in parts])
        views, start = [], 0
        for p in parts:
            views.append(cls(whole[start:start + p.shape[0]], p.ggml_type, p.shape))
            start += p.shape[0]
        return cls(whole, parts[0].ggml_type, (start, parts[0].shape[1])), views

    @classmethod
    def from_gguf(cls, gf: GGUFFile, name: str, shape: tuple[int, int], permuted_heads: int = 0) -> "StoredMatrix":
        """The tensor `name` (of KERNEL_TYPES) copied out of the file as stored, its rows
        reordered where permuted_heads asks (a row is whole blocks)."""
        gf.check_shape(name, shape)
        blocks = np.array(gf.raw(name)).reshape(shape[0], -1)
        if permuted_heads:
            blocks = np.ascontiguousarray(unpermute_qk(blocks, permuted_heads))
        return cls(blocks, gf.tensors[name].ggml_type, shape)

    def rows(self, ids: np.ndarray) -> "StoredMatrix":
        """The matrix of rows `ids` (an embedding's looked-up tokens), still as stored."""
        return StoredMatrix(self.blocks[ids], self.ggml_type, (len(ids), self.shape[1]))

    def float32(self, out: np.ndarray | None = None) -> np.ndarray:
        """W dequantised [out, in] float32, into `out` where given."""
        return dequantize(self.ggml_type, self.blocks, self.shape[1], out)

    @cached_property
    def _arrays(self) -> tuple:
        matmul(self.ggml_type, self.blocks[:1], np.zeros((1, self.shape[1]), np.float32))  # checks the row layout once
        return self.blocks, self.blocks.view(np.int8)

    def product_into(self, x: Activations, y: np.ndarray) -> None:
        """y [M, out] = x @ W.T for a decode step's few rows (quantized Activations, 8-bit where
        the machine has AVX2), into float32 y, with no per-call checks or allocation."""
        product_into(self.ggml_type, *self._arrays, x, y)

    def dequantized(self) -> np.ndarray:
        """W [out, in] float32 in the buffer every prefill product reuses: valid until the next
        product of many rows."""
        return self.float32(_scratch(self.shape))

    def product(self, rows: np.ndarray, out: np.ndarray | None = None, workers: Workers = Workers(1),
                eight_bit: bool = False) -> np.ndarray:
        """rows [M, in] float32 -> rows @ W.T [M, out] float32 (into `out` where given): in place
        for a few rows (over their 8-bit form where eight_bit and the machine has AVX2:
        Activations), else over the matrix dequantised (numpy's matmul), each worker
        dequantising and multiplying its share of W's rows."""
        if rows.shape[0] <= MAX_IN_PLACE_ROWS:
            expect("rows", rows, ndim=2, dtype=np.float32, shape=(None, self.shape[1]))
            x = Activations(rows.shape[0], self.shape[1], None if eight_bit else False)
            x.x[...] = rows
            x.quantize()
            y = np.empty((rows.shape[0], self.shape[0]), np.float32)
            self.product_into(x, y)
            if out is None:
                return y
            out[...] = y
            return out
        if out is None:
            out = np.empty((rows.shape[0], self.shape[0]), np.float32)
        w = _scratch(self.shape)

        def share(span):
            a, b = span
            dequantize(self.ggml_type, self.blocks[a:b], self.shape[1], w[a:b])
            np.matmul(rows, w[a:b].T, out=out[:, a:b])

        workers.map(share, workers.spans(self.shape[0]))
        return out


def compile_kernels(matrices) -> None:
    """Run the kernels of each type among `matrices` once on one row (products over float32 and
    over 8-bit inputs, dequantisation), so that the first prompt finds them compiled (a few
    seconds a type on a fresh install) or loaded from Numba's cache."""
    for m in {m.ggml_type: m for m in matrices}.values():
        row = StoredMatrix(m.blocks[:1], m.ggml_type, (1, m.shape[1]))
        row.product(np.zeros((1, m.shape[1]), np.float32))
        x = Activations(1, m.shape[1])
        x.quantize()
        row.product_into(x, np.empty((1, 1), np.float32))
        row.float32()
