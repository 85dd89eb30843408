"""The call-site counter of the benchmarks counts each torch call once, by the project line that
made it, and skips metadata reads."""

import inspect

import torch

from ktlong.bench.call_sites import CallSites


def test_each_torch_call_is_counted_once_by_the_line_that_made_it():
    x = torch.ones(3)
    with CallSites() as sites:
        line = inspect.currentframe().f_lineno + 2
        for _ in range(4):
            y = torch.exp(x + 1)  # two calls: add, exp
        assert x.shape == (3,) and x.dim() == 1 and x.stride() == (1,)  # metadata: not counted
    assert dict(sites.counts) == {f"tests/test_call_sites.py:{line}": 8}
    assert torch.allclose(y, torch.full((3,), 2.0).exp())
