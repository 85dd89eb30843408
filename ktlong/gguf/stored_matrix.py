"""A weight matrix kept on the CPU as the GGUF stores it, multiplied in place.

A decode step (or a short follow-up) multiplies a few rows by the matrix with the Numba kernels
of cpu_ops/gguf_matmul.py, which decode each block of the stored bytes as they go: the step
reads the bytes the file holds, 0.56 (Q4_K) to 1.06 (Q8_0) per weight, and nothing else.
`linear` keeps the activations in float32; the CPU decode step's `product_into` takes them in
8 bits, as llama.cpp does, for integer arithmetic.
A prefill chunk of many rows is bound by arithmetic instead: the matrix is dequantised to
float32 for that one product (ggml's values, exactly), and torch's GEMM does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from cpu_ops.gguf_matmul import Activations, dequantize, matmul, product_into

MAX_IN_PLACE_ROWS = 16  # rows of x multiplied in place; more are a prefill chunk (dequantised once)


_SCRATCH = [torch.empty(0)]  # the float32 buffer prefill chunks dequantise into, grown to the largest matrix


def _scratch(shape: tuple[int, int]) -> torch.Tensor:
    """A float32 [out, in] view of one buffer reused by every prefill product: a fresh matrix-sized
    allocation per product costs the kernel's page faults and zeroing, about as long as the
    dequantisation itself."""
    if _SCRATCH[0].numel() < shape[0] * shape[1]:
        _SCRATCH[0] = torch.empty(shape[0] * shape[1])
    return _SCRATCH[0][:shape[0] * shape[1]].view(shape)


@dataclass(frozen=True)
class StoredMatrix:
    """W [out, in] as GGUF blocks: `blocks` [out, bytes per row] uint8, each row whole blocks."""
    blocks: torch.Tensor
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]

    @classmethod
    def stacked(cls, parts: list["StoredMatrix"]) -> tuple["StoredMatrix", list["StoredMatrix"]]:
        """One matrix of the parts' rows, in order, and each part as a view of its rows: products
        with parts that read the same input (q, k and v; gate and up) become one kernel call,
        and the bytes are held once. The parts must share a type and an input width."""
        assert len({(p.ggml_type, p.shape[1]) for p in parts}) == 1
        whole = torch.cat([p.blocks for p in parts])
        views, start = [], 0
        for p in parts:
            views.append(cls(whole[start:start + p.shape[0]], p.ggml_type, p.shape))
            start += p.shape[0]
        return cls(whole, parts[0].ggml_type, (start, parts[0].shape[1])), views

    def float32(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """W dequantised [out, in] float32, into `out` where given."""
        return torch.from_numpy(dequantize(self.ggml_type, self.blocks.numpy(), self.shape[1],
                                           None if out is None else out.numpy()))

    @cached_property
    def _arrays(self) -> tuple:
        u8 = self.blocks.numpy()
        matmul(self.ggml_type, u8[:1], np.zeros((1, self.shape[1]), np.float32))  # checks the row layout once
        return u8, u8.view(np.int8)

    def product_into(self, x: Activations, y: np.ndarray) -> None:
        """y [M, out] = x @ W.T for a decode step's few rows (quantized Activations, 8-bit where
        the machine has AVX2), into float32 y, with no per-call checks or allocation."""
        product_into(self.ggml_type, *self._arrays, x, y)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ W.T [..., out] in x's dtype (computed in float32)."""
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0] <= MAX_IN_PLACE_ROWS:
            y = torch.from_numpy(matmul(self.ggml_type, self.blocks.numpy(), rows.numpy()))
        else:
            y = F.linear(rows, self.float32(_scratch(self.shape)))
        return y.to(x.dtype).view(*x.shape[:-1], self.shape[0])


def compile_kernels(matrices) -> None:
    """Run the kernels of each type among `matrices` once on one row (products over float32 and
    over 8-bit inputs, dequantisation), so that the first prompt finds them compiled (a few
    seconds a type on a fresh install) or loaded from Numba's cache."""
    for m in {m.ggml_type: m for m in matrices}.values():
        row = StoredMatrix(m.blocks[:1], m.ggml_type, (1, m.shape[1]))
        row.linear(torch.zeros(1, m.shape[1]))
        x = Activations(1, m.shape[1])
        x.quantize()
        row.product_into(x, np.empty((1, 1), np.float32))
        row.float32()


def linear(x: torch.Tensor, w: torch.Tensor | StoredMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + bias: F.linear over a tensor, or a StoredMatrix's own product."""
    if not isinstance(w, StoredMatrix):
        return F.linear(x, w, bias)
    y = w.linear(x)
    return y + bias if bias is not None else y
