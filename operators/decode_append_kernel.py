"""A decode step's new key and value of one layer, placed in one Triton kernel, for GPUs: into the
device window at the step's slot, and into the host's exchange rows from which the new token is
written through to DRAM (as DRAM stores it: the window's type, or q8_0 quantised here).

With torch ops the same work is two casts, two index copies, a stack, about fifteen kernels of
q8_0 quantisation (operators/kv_quant.py) and two copies to host memory: twenty launches a global
layer, 640 a token at 8B shapes, each a node of the step's CUDA graph. The exchange rows are
pinned host memory, which the kernel writes over PCIe in place; the host reads them after the
step's event, when the writes have landed.

q8_0 follows quantize_kv's arithmetic in float32 step by step (amax / 127, its IEEE reciprocal,
the product, rounding half away from zero), so the bytes are the same; the stored scale is d in
float16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.kv_quant import QBLOCK


@triton.jit
def _place_row(src_ptr, dst_ptr, data_ptr, scales_ptr, row, at, groups,
               DIM: tl.constexpr, QUANT: tl.constexpr, EXCHANGE: tl.constexpr):
    """One kv head's new row (src, [DIM // 32, 32] positions at) -> the window (dst, its type) and
    exchange row `row` (values, or q8_0 data and scale words)."""
    x = tl.load(src_ptr + at).to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + at, x)
    if EXCHANGE:
        if QUANT:
            xf = x.to(tl.float32)
            d = tl.max(tl.abs(xf), 1) / 127.0
            inverse = tl.where(d == 0, 0.0, 1.0 / tl.where(d == 0, 1.0, d))
            scaled = xf * inverse[:, None]
            a = tl.abs(scaled)
            whole = tl.floor(a)
            rounded = whole + tl.floor(2 * (a - whole))
            tl.store(data_ptr + row * DIM + at, tl.where(scaled < 0, -rounded, rounded).to(tl.int8))
            tl.store(scales_ptr + row * (DIM // 32) + groups, d.to(tl.float16).to(tl.int16, bitcast=True))
        else:
            tl.store(data_ptr + row * DIM + at, x.to(data_ptr.dtype.element_ty))


@triton.jit
def _append_token(k_ptr, v_ptr, slot_ptr, wk_ptr, wv_ptr, w_head, w_token, data_ptr, scales_ptr, num_kv,
                  DIM: tl.constexpr, QUANT: tl.constexpr, EXCHANGE: tl.constexpr):
    """Kv head h: its key and value rows into the window at token slot and into the exchange."""
    h = tl.program_id(0)
    groups = tl.arange(0, DIM // 32)
    at = groups[:, None] * 32 + tl.arange(0, 32)[None, :]
    window = h * w_head + tl.load(slot_ptr) * w_token
    _place_row(k_ptr + h * DIM, wk_ptr + window, data_ptr, scales_ptr, h, at, groups, DIM, QUANT, EXCHANGE)
    _place_row(v_ptr + h * DIM, wv_ptr + window, data_ptr, scales_ptr, num_kv + h, at, groups, DIM, QUANT, EXCHANGE)


def kernel_applies(kv_type: str, head_dim: int) -> bool:
    """Values or q8_0 (q4_0's packed nibbles stay on torch), head_dim a power of two of at least 32."""
    return kv_type in ("bf16", "fp16", "fp32", "q8_0") and head_dim >= QBLOCK and head_dim & (head_dim - 1) == 0


def append_token(k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 data: torch.Tensor | None = None, scales: torch.Tensor | None = None):
    """k, v [KV, D]: the step's new rows -> keys[:, slot], values[:, slot] of the window buffers
    [KV, N, D] (slot: a 1-element int64 device tensor), and with data, the exchange rows: [2, KV,
    D] values, or q8_0 int8 [2, KV, D] with scales int16 [2, KV, D/32] (float16 words). Fixed
    shapes, no sync."""
    num_kv, dim = k.shape
    expect("v", v, shape=(num_kv, dim), dtype=k.dtype, device=k.device)
    expect("keys", keys, shape=(num_kv, None, dim), device=k.device)
    expect("values", values, shape=tuple(keys.shape), dtype=keys.dtype, device=k.device)
    if keys.stride(2) != 1 or values.stride() != keys.stride():
        raise ValueError("the window's keys and values must share one layout with contiguous rows")
    quant = scales is not None
    if data is not None:  # pinned host memory, written in place: its device is not checked
        expect("data", data, shape=(2, num_kv, dim), dtype=torch.int8 if quant else None)
        if quant:
            expect("scales", scales, shape=(2, num_kv, dim // QBLOCK), dtype=torch.int16)
    _append_token[(num_kv,)](k.contiguous(), v.contiguous(), slot, keys, values, keys.stride(0), keys.stride(1),
                             data if data is not None else keys, scales if quant else slot, num_kv,
                             DIM=dim, QUANT=quant, EXCHANGE=data is not None)
