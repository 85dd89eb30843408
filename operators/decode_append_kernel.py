"""A decode step's new key and value of one layer, placed in one Triton kernel, for GPUs: into the
device window at the step's slot, and into host memory as DRAM stores it (the window's type, or
q8_0 quantised here): the DRAM cache's own row at the token's position where the device reads
that cache anyway (`context_attention: gpu`), else the exchange rows from which the host writes
the token through.

With torch ops the same work is two casts, two index copies, a stack, about fifteen kernels of
q8_0 quantisation (operators/kv_quant.py) and two copies to host memory: twenty launches a global
layer, 640 a token at 8B shapes, each a node of the step's CUDA graph. Both destinations are
pinned host memory, which the kernel writes over PCIe in place; the host reads them after the
step's event, when the writes have landed. One launch writes every conversation of a batch, each
member's buffers found by their offsets from the first member's.

q8_0 follows quantize_kv's arithmetic in float32 step by step (amax / 127, its IEEE reciprocal,
the product, rounding half away from zero), so the bytes are the same; the stored scale is d in
float16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.kv_quant import QBLOCK
from operators.member_tables import device_table, gaps


@triton.jit
def _place_row(src_ptr, dst_ptr, data_ptr, scales_ptr, at, groups,
               DIM: tl.constexpr, QUANT: tl.constexpr, STORE: tl.constexpr):
    """One kv head's new row (src, [DIM // 32, 32] positions at) -> the window (dst, its type)
    and, with STORE, the stored row at data_ptr (values, or q8_0 data and its scale words at
    scales_ptr)."""
    x = tl.load(src_ptr + at).to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + at, x)
    if STORE:
        if QUANT:
            xf = x.to(tl.float32)
            d = tl.max(tl.abs(xf), 1) / 127.0
            inverse = tl.where(d == 0, 0.0, 1.0 / tl.where(d == 0, 1.0, d))
            scaled = xf * inverse[:, None]
            a = tl.abs(scaled)
            whole = tl.floor(a)
            rounded = whole + tl.floor(2 * (a - whole))
            tl.store(data_ptr + at, tl.where(scaled < 0, -rounded, rounded).to(tl.int8))
            tl.store(scales_ptr + groups, d.to(tl.float16).to(tl.int16, bitcast=True))
        else:
            tl.store(data_ptr + at, x.to(data_ptr.dtype.element_ty))


@triton.jit
def _append_token(k_ptr, v_ptr, stride_k, stride_v, slot_ptr, wk_ptr, wv_ptr, w_head, w_token, members_ptr, kd_ptr,
                  vd_ptr, ks_ptr, vs_ptr, stored_ptr, position_ptr, d_head, s_head,
                  DIM: tl.constexpr, QUANT: tl.constexpr, STORE: tl.constexpr):
    """Member b's kv head h: its key and value rows (member b's at stride_k * b, stride_v * b:
    views of the layer's products, read in place) into its window at its token slot and into
    its stored tables at its token position; member b's buffers at their offsets from member 0's."""
    h, b = tl.program_id(0), tl.program_id(1)
    num_kv = tl.num_programs(0)
    groups = tl.arange(0, DIM // 32)
    at = groups[:, None] * 32 + tl.arange(0, 32)[None, :]
    wk_ptr += tl.load(members_ptr + 2 * b) * 16  # in units of 16 elements (member_offsets)
    wv_ptr += tl.load(members_ptr + 2 * b + 1) * 16
    window = h * w_head + tl.load(slot_ptr + b) * w_token
    row, scale_row = h * d_head, h * s_head
    if STORE:
        kd_ptr += tl.load(stored_ptr + 4 * b)
        vd_ptr += tl.load(stored_ptr + 4 * b + 1)
        ks_ptr += tl.load(stored_ptr + 4 * b + 2)
        vs_ptr += tl.load(stored_ptr + 4 * b + 3)
        position = tl.load(position_ptr + b)
        row, scale_row = row + position * DIM, scale_row + position * (DIM // 32)
    k_ptr += b * stride_k + h * DIM
    v_ptr += b * stride_v + h * DIM
    _place_row(k_ptr, wk_ptr + window, kd_ptr + row, ks_ptr + scale_row, at, groups, DIM, QUANT, STORE)
    _place_row(v_ptr, wv_ptr + window, vd_ptr + row, vs_ptr + scale_row, at, groups, DIM, QUANT, STORE)


def kernel_applies(kv_type: str, head_dim: int) -> bool:
    """Values or q8_0 (q4_0's packed nibbles stay on torch), head_dim a power of two of at least 32."""
    return kv_type in ("bf16", "fp16", "fp32", "q8_0") and head_dim >= QBLOCK and head_dim & (head_dim - 1) == 0


class StoredRows(NamedTuple):
    """Where a layer's new K/V go as DRAM stores them: k, v [KV, N, D] (values, or q8_0 int8 with
    k_scales, v_scales [KV, N, D/32] int16 words of float16; None for values), and the row each
    member of a batch writes, `position` ([B] int64 device tensor, read at launch). Host memory registered with CUDA
    (pinned: the DRAM cache itself, or the host's exchange rows with N = 1), written in place."""
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    position: torch.Tensor


def stored_offsets(rows: list[StoredRows], device: torch.device, at: tuple | None = None) -> torch.Tensor:
    """[B, 4] int64 on the device: where each member's stored k, v, k_scales and v_scales lie, in
    elements from member 0's, or from the tensors `at` (append_token's `stored_at`) when given
    (append_token's `stored_members`; made outside any capture)."""
    for r in rows:
        for mine, first in zip(r[:4], rows[0][:4]):
            if (mine is None) != (first is None) or (mine is not None and (
                    mine.shape != first.shape or mine.stride() != first.stride() or mine.dtype != first.dtype)):
                raise ValueError("every member's stored rows must share one layout")
    return device_table([gaps([r[i] for r in rows], base=None if at is None or at[i] is None else at[i].data_ptr())
                         for i in range(4)], device)


def append_token(k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 members: torch.Tensor, stored: StoredRows | None = None, stored_members: torch.Tensor | None = None,
                 at: tuple | None = None, stored_at: tuple | None = None):
    """A batch's new rows k, v [B, KV, D] -> member b's window buffers (like member 0's keys,
    values [KV, N, D], at members[b] units of 16 elements from them: window_attention_kernel.member_offsets)
    at slot[b] ([B] int64 device tensor), and with `stored` (member 0's, its position [B]) each
    member's stored rows (at stored_members[b]: stored_offsets) at its position. at, stored_at:
    the tensors the offsets count from (keys', values'; stored k, v, k_scales, v_scales': a
    batch's bases, member_tables.Bases), in place of those tensors. One launch for the batch;
    fixed shapes, no sync."""
    batch, num_kv, dim = k.shape
    expect("v", v, shape=(batch, num_kv, dim), dtype=k.dtype, device=k.device)
    expect("slot", slot, shape=(batch,), dtype=torch.int64, device=k.device)
    expect("members", members, shape=(batch, 2), dtype=torch.int64, device=k.device)
    expect("keys", keys, shape=(num_kv, None, dim), device=k.device)
    expect("values", values, shape=tuple(keys.shape), dtype=keys.dtype, device=k.device)
    if keys.stride(2) != 1 or values.stride() != keys.stride():
        raise ValueError("the window's keys and values must share one layout with contiguous rows")
    quant = stored is not None and stored.k_scales is not None
    if stored is not None:  # host memory, written in place: its device is not checked
        expect("stored.k", stored.k, shape=(num_kv, None, dim), dtype=torch.int8 if quant else None)
        expect("stored.v", stored.v, shape=tuple(stored.k.shape), dtype=stored.k.dtype)
        expect("stored.position", stored.position, shape=(batch,), dtype=torch.int64, device=k.device)
        expect("stored_members", stored_members, shape=(batch, 4), dtype=torch.int64, device=k.device)
        if stored.k.stride(2) != 1 or stored.v.stride() != stored.k.stride():
            raise ValueError("the stored keys and values must share one layout with contiguous rows")
        if quant:
            expect("stored.k_scales", stored.k_scales, shape=(num_kv, stored.k.shape[1], dim // QBLOCK),
                   dtype=torch.int16)
            expect("stored.v_scales", stored.v_scales, shape=tuple(stored.k_scales.shape), dtype=torch.int16)
            if stored.k_scales.stride(2) != 1 or stored.v_scales.stride() != stored.k_scales.stride():
                raise ValueError("the stored scales of keys and values must share one layout with contiguous rows")
    to = stored if stored is not None else StoredRows(keys, values, None, None, slot)  # placeholders, never written
    scales = (to.k_scales, to.v_scales) if quant else (slot, slot)
    # each member's heads one after another (the products' views are): read in place, not copied
    k, v = (t if t.stride(2) == 1 and t.stride(1) == dim else t.contiguous() for t in (k, v))
    keys_at, values_at = at or (keys, values)
    stored_k, stored_v, *stored_scales = to.k, to.v, *scales
    if stored is not None and stored_at is not None:
        stored_k, stored_v = stored_at[:2]
        stored_scales = stored_at[2:] if quant else stored_scales
    _append_token[(num_kv, batch)](k, v, k.stride(0), v.stride(0), slot, keys_at, values_at, keys.stride(0),
                                   keys.stride(1), members, stored_k, stored_v, *stored_scales,
                                   stored_members if stored is not None else members, to.position,
                                   to.k.stride(0), scales[0].stride(0) if quant else 0,
                                   DIM=dim, QUANT=quant, STORE=stored is not None)
