"""A batch's members' tensors of one kind gathered into rows of one tensor, in one launch: each
member's tensor found by its offset in the batch's table (operators/member_tables.py), so a CUDA
graph that reads them serves whichever members the table names (a decode step's reports of how
many blocks each member read: ktlong/decode/step.py)."""

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
