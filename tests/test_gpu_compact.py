"""On the GPU: FlashInfer's paged execution of per-group page lists equals the torch reference."""

import pytest
import torch

from operators.block_union import build_page_lists, execution_groups
from operators.chunk_attention import flashinfer_available
from operators.compact_attention import CompactAttention
from tests.settings import compact_settings, flashprefill_settings
from operators.dense_attention import dense_attention
from operators.paged_attention_reference import paged_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not flashinfer_available(), reason="needs FlashInfer")]
B = 128


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def data(start, chunk, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = (start + chunk) // B + 2
    k = torch.randn(8, nb, B, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(8, nb, B, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(chunk, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    return q, k, v


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("subgroup", [2, 4])
def test_flashinfer_paged_equals_reference_on_random_page_lists(backend, subgroup):
    if backend == "fa3" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fa3 needs Hopper")
    start, chunk = 40 * B, 3 * B + 17
    q, k, v = data(start, chunk)
    groups = execution_groups(32, 8, subgroup)
    keep = torch.rand(groups.shape[0], 40, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) < 0.3
    pages = build_page_lists(keep, groups, 32, 8, k.shape[1], 40, chunk, B)
    op = CompactAttention(compact_settings(subgroup_size=subgroup), 32, 8, B, 128 ** -0.5, backend, torch.device("cuda"))
    got = op.execute(q, k, v, pages)
    expected = paged_attention_reference(q.double(), k.double(), v.double(), groups, pages, 128 ** -0.5)
    assert rel(got, expected) < 2e-2


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_compact_with_alpha_zero_equals_dense_in_bf16(backend):
    if backend == "fa3" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fa3 needs Hopper")
    start, chunk = 64 * B, 1024
    q, k, v = data(start, chunk, seed=2)
    op = CompactAttention(flashprefill_settings(alpha=0.0), 32, 8, B, 128 ** -0.5, backend, torch.device("cuda"))
    out, pages = op(q, k, v, k.float().mean(2), start, start + chunk)
    keys = k.view(8, -1, 128)[:, :start + chunk].double()
    values = v.view(8, -1, 128)[:, :start + chunk].double()
    expected = dense_attention(q.double(), keys, values, 128 ** -0.5)
    assert pages.density == 1.0 and rel(out, expected) < 2e-2


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_topk_plan_serves_every_layer_of_a_chunk_and_each_layer_reads_its_own_pages(backend):
    """Three layers of one 1024-token chunk over 64 history blocks through FlashInfer: one plan,
    the page indices rewritten in place for each layer, each output equal to the torch reference
    over that layer's own page lists (a stale plan would attend to the first layer's)."""
    if backend == "fa3" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fa3 needs Hopper")
    start, chunk = 64 * B, 1024
    params = compact_settings(selector="topk", keep_blocks=16)
    op = CompactAttention(params, 32, 8, B, 128 ** -0.5, backend, torch.device("cuda"))
    plans = []
    make = op.make_executor

    def counting(short):
        executor = make(short)
        plan = executor.plan
        executor.plan = lambda *a, **kw: (plans.append(1), plan(*a, **kw))[1]
        return executor

    op.make_executor = counting
    selected = []
    for layer in range(3):
        q, k, v = data(start, chunk, seed=10 + layer)
        out, pages = op(q, k, v, k.float().mean(2), start, start + chunk)
        selected.append(pages.indices.clone())
        expected = paged_attention_reference(q.double(), k.double(), v.double(), op.groups, pages, 128 ** -0.5)
        assert pages.density == 16 / 64 and rel(out, expected) < 2e-2
    assert len(plans) == 1
    assert not torch.equal(selected[0], selected[1])
