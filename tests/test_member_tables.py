"""A batch's kernel tables (operators/member_tables.py) and the reports read through them
(operators/member_gather_kernel.py): each member's tensor found by its offset from the base of
its column, and a table rewritten in place for other members, from the same bases (Triton's
interpreter here, where there is no GPU)."""

import numpy as np
import pytest
import torch

from operators.member_gather_kernel import gather_members, kept_reads
from operators.member_tables import Bases, MemberTables, member_table

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter")


def test_a_site_keeps_its_table_for_the_same_members_and_rewrites_it_for_others():
    a, b, c = (torch.zeros(64, dtype=torch.bfloat16) for _ in range(3))
    tables = MemberTables(Bases())
    gap = lambda t, base: (t.data_ptr() - base.data_ptr()) // 32  # noqa: E731 (in units of 16 bfloat16s)
    tables.start()
    (base,), first = member_table(tables, "k", [([a, b], 16, "k")], [[7, 9]], torch.device("cpu"), ("shape",))
    assert base is tables.bases.like(a) and base.dtype == torch.bfloat16  # the step's own, not a member's
    assert first.tolist() == [[gap(a, base), 7], [gap(b, base), 9]]
    tables.start()  # the same members: the same table and base
    (again,), same = member_table(tables, "k", [([a, b], 16, "k")], [[7, 9]], torch.device("cpu"), ("shape",))
    assert same is first and again is base
    tables.start(rebinding=True)  # other members: written into the same table, from the same base
    (rebound,), table = member_table(tables, "k", [([c, a], 16, "k")], [[5, 7]], torch.device("cpu"), ("shape",))
    assert table is first and tables.matches and rebound is base
    assert table.tolist() == [[gap(c, base), 5], [gap(a, base), 7]]
    tables.start(rebinding=True)  # a launch that bakes in another shape: the graphs do not fit
    _, other = member_table(tables, "k", [([b, c], 16, "k")], [[1, 2]], torch.device("cpu"), ("another shape",))
    assert other is not first and not tables.matches


def test_reports_through_the_tables_equal_each_members_own():
    rng = np.random.default_rng(0)
    valid = [torch.from_numpy(rng.integers(0, 99, size=(3, 2))) for _ in range(3)]
    # plans [layers, 2, kv heads, slots]: slots differ by member (a short conversation selects fewer)
    plans = [torch.from_numpy(rng.integers(-3, 4, size=(3, 2, 2, s)).astype(np.int32)) for s in (4, 2, 4)]
    tables = MemberTables(Bases())
    for rebinding, order in ((False, [0, 1, 2]), (False, [0, 1, 2]), (True, [2, 0, 1])):
        tables.start(rebinding)
        out = gather_members([valid[i] for i in order], torch.zeros((3, 6), dtype=torch.int64), tables)
        assert [out[b].tolist() for b in range(3)] == [valid[i].flatten().tolist() for i in order]
        kept = kept_reads([plans[i] for i in order], torch.zeros(3, dtype=torch.int64), tables)
        assert kept.tolist() == [int((plans[i][:, 0] != -1).sum()) for i in order]
    assert tables.matches and len(tables.sites) == 2
