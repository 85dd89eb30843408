"""A batch's members' tensors of one kind read for the host in one launch (a decode step's
reports of how many blocks each member read: ktlong/decode/step.py): gathered into rows of one
tensor, or counted. Each member's tensor is found by its offset in the batch's table
(operators/member_tables.py), so a CUDA graph that reads them serves whichever members the
table names."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect
from operators.member_tables import MemberTables, member_table

BLOCK = 1024  # elements a program copies


@triton.jit
def _gather(source_ptr, members_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Member b's n elements, at members[b] elements from source_ptr -> row b of out."""
    b, part = tl.program_id(0), tl.program_id(1)
    at = part * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    source_ptr += tl.load(members_ptr + b)
    tl.store(out_ptr + b * n + at, tl.load(source_ptr + at, mask=inside), mask=inside)


def gather_members(tensors: list[torch.Tensor], out: torch.Tensor, tables: MemberTables | None = None) -> torch.Tensor:
    """tensors: each member's, contiguous, of one shape and dtype -> out [B, numel] (contiguous,
    that dtype) holding tensor b in row b. tables: the batch's store, needed to capture a CUDA
    graph. One launch; fixed shapes, no sync."""
    first = tensors[0]
    n = first.numel()
    expect("out", out, shape=(len(tensors), n), dtype=first.dtype, device=first.device)
    for t in tensors:
        expect("each member's tensor", t, shape=tuple(first.shape), dtype=first.dtype, device=first.device)
        if not t.is_contiguous():
            raise ValueError("each member's tensor must be contiguous")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    (source,), members = member_table(tables, "gather", [(tensors, 1, "each member's tensor")], [], out.device,
                                      (n, first.dtype))
    _gather[(len(tensors), triton.cdiv(max(n, 1), BLOCK))](source, members, out, n, BLOCK=BLOCK)
    return out


@triton.jit
def _kept_reads(plans_ptr, members_ptr, out_ptr, BLOCK: tl.constexpr):
    """Member b's plans (its numel n, `inner` = kv heads x slots elements a half): the entries of
    the first halves (each selected block's slot) that are not -1 -> out[b]."""
    b = tl.program_id(0)
    row = members_ptr + b * 3
    plans_ptr += tl.load(row)
    n, inner = tl.load(row + 1), tl.load(row + 2)
    total = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        plan = tl.load(plans_ptr + at, mask=at < n, other=-1)
        total += ((plan != -1) & ((at // inner) % 2 == 0)).to(tl.int64)
    tl.store(out_ptr + b, tl.sum(total, 0))


def kept_reads(plans: list[torch.Tensor], out: torch.Tensor, tables: MemberTables | None = None) -> torch.Tensor:
    """Each member's kept slots' plans [layers, 2, KV, slots_b] int32 (contiguous; slots_b its own
    top-k width: a short conversation selects fewer) -> out [B] int64: the (kv head, block) pairs
    its step read from kept slots (its own, or another's: plan[:, 0] != -1). One launch; fixed
    shapes, no sync."""
    expect("out", out, shape=(len(plans),), dtype=torch.int64)
    for p in plans:
        expect("plans", p, shape=(plans[0].shape[0], 2, plans[0].shape[2], None), dtype=torch.int32,
               device=out.device)
        if not p.is_contiguous():
            raise ValueError("each member's plans must be contiguous")
    (source,), members = member_table(tables, "kept reads", [(plans, 1, "each member's plans")],
                                      [[p.numel() for p in plans], [p.shape[2] * p.shape[3] for p in plans]],
                                      out.device, ())
    _kept_reads[(len(plans),)](source, members, out, BLOCK=BLOCK)
    return out
