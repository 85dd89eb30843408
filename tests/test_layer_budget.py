"""layer_budget attention: each layer's topk count from its own sampled attention, against the
other layers' (operators/layer_budget.py), checked against float64 references and hand counts."""

import numpy as np
import pytest
import torch

import operators.layer_budget as layer_budget
from operators.compact_attention import CompactAttention
from operators.layer_budget import LayerBudgets, blocks_to_hold, sampled_share
from operators.paged_attention_reference import paged_attention_reference
from tests.settings import compact_settings

B = 16


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile_tokens", [B, 3 * B, 8192])
@pytest.mark.parametrize("num_heads,num_kv,group", [(8, 2, 4), (8, 2, 2), (4, 4, 1)])
def test_the_sampled_share_is_each_blocks_softmax_share_averaged_over_a_group(monkeypatch, tile_tokens, num_heads,
                                                                               num_kv, group, causal):
    """Per row, softmax over the keys it sees (every key, or causal: the history and the chunk's
    keys up to its position), summed per history block; averaged over the rows and the group's
    heads. Tiles of the keys (down to one block) give the same shares."""
    monkeypatch.setattr(layer_budget, "TILE_TOKENS", tile_tokens)
    g = torch.Generator().manual_seed(num_heads * 7 + group + tile_tokens + causal)
    num_hist, dim, rows, chunk = 10, 16, 5, 3 * B if causal else 0
    q = torch.randn(rows, num_heads, dim, generator=g)
    keys = torch.randn(num_kv, num_hist * B + chunk, dim, generator=g) * 2
    positions = num_hist * B + torch.tensor([0, 7, 16, 30, 47]) if causal else None
    share = sampled_share(q, keys, num_hist, B, 0.3, group, positions)
    qd, kd = q.double().numpy(), keys.double().numpy()
    per_kv = num_heads // num_kv
    expected = np.zeros((num_heads, num_hist))
    for h in range(num_heads):
        s = np.einsum("rd,td->rt", qd[:, h], kd[h // per_kv]) * 0.3
        if causal:
            s[np.arange(s.shape[1])[None, :] > positions.numpy()[:, None]] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        expected[h] = p[:, :num_hist * B].reshape(rows, num_hist, B).sum(-1).mean(0)
    expected = expected.reshape(num_heads // group, group, num_hist).mean(1)
    np.testing.assert_allclose(share.double().numpy(), expected, rtol=1e-5, atol=1e-7)
    if not causal:  # each row's whole softmax is over the history
        np.testing.assert_allclose(share.sum(1).numpy(), 1.0, rtol=1e-5)


def test_blocks_to_hold_counts_in_rank_order_until_the_mass_is_held():
    """Group 0 ranks its heavy blocks first: two hold 0.8; group 1 ranks them last: it needs all
    four; 0.45 takes group 0 one block, group 1 three (0.1, 0.1, 0.3)."""
    share = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.5, 0.3, 0.1, 0.1]])
    rank = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    assert blocks_to_hold(share, rank, 0.8).tolist() == [2, 4]
    assert blocks_to_hold(share, rank, 0.45).tolist() == [1, 3]
    assert blocks_to_hold(share, rank, 1.0).tolist() == [4, 4]


def test_a_layers_count_is_keep_blocks_scaled_by_its_need_over_the_mean_need():
    """keep 128: equal needs keep 128; a need 1.5x the mean so far 192 (200 against 133.3);
    a tiny need is held at keep_blocks, a huge one at twice that; counts step by 16."""
    budgets = LayerBudgets(128, 3)
    assert [budgets.decide(layer, need) for layer, need in enumerate([100, 100, 200])] == [128, 128, 192]
    assert budgets.decide(3, 10) == 128  # 128 * 10 / 102.5: 12, held at 128
    assert budgets.decide(4, 10_000) == 256
    assert budgets.decide(5, 240) == 128  # 128 * 240 / 1,775 (the mean of six): 17, held at 128
    assert budgets.counts == {0: 128, 1: 128, 2: 192, 3: 128, 4: 256, 5: 128}
    budgets.reset()
    assert budgets.decide(7, 5) == 128 and budgets.counts == {7: 128}  # a new prompt starts over


def _chunk(seed, num_hist, concentrated, num_heads=8, num_kv=2, dim=16, chunk=256):
    """q, k pages, v pages, pooled keys and the chunk's start for one layer: the queries match
    block 5's keys strongly (concentrated) or nothing in particular."""
    g = torch.Generator().manual_seed(seed)
    total = num_hist * B + chunk
    k = torch.randn(num_kv, total // B, B, dim, generator=g) * 0.1
    v = torch.randn(num_kv, total // B, B, dim, generator=g)
    q = torch.randn(chunk, num_heads, dim, generator=g) * 0.1
    if concentrated:
        direction = torch.randn(dim, generator=g)
        k[:, 5] += 3 * direction
        q += direction
    pooled = k.float().mean(2)
    return q, k, v, pooled, num_hist * B


def test_each_layer_keeps_its_own_count_and_attends_to_it():
    """A layer whose queries all look at one block needs few blocks; one that looks everywhere
    needs many: against the mean, the second layer gets more than keep_blocks, the third (a
    concentrated one again) keep_blocks, never fewer. Every group's page list has the layer's
    count, the attention over it is the reference's, and the fixed setting keeps keep_blocks in
    every layer."""
    op = CompactAttention(compact_settings(selector="topk", keep_blocks=32, layer_budget="attention"), 8, 2, B,
                          0.25, "torch", torch.device("cpu"))
    fixed = CompactAttention(compact_settings(selector="topk", keep_blocks=32), 8, 2, B, 0.25, "torch",
                             torch.device("cpu"))
    counts = []
    for layer, concentrated in enumerate([True, False, True]):
        q, k, v, pooled, start = _chunk(10 + layer, 96, concentrated)
        end = start + q.shape[0]
        out, pages = op(q, k, v, pooled, start, end, layer=layer)
        count = op.budgets.counts[layer]
        counts.append(count)
        assert pages.density == pytest.approx(count / 96)
        expected = paged_attention_reference(q, k, v, op.groups, pages, 0.25)
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
        _, fixed_pages = fixed(q, k, v, pooled, start, end, layer=layer)
        assert fixed_pages.density == pytest.approx(32 / 96)
    assert counts[0] == 32 and counts[1] > 32 and counts[2] == 32
    # the next chunk of a layer keeps the count measured at its first
    q, k, v, pooled, start = _chunk(20, 104, False)
    _, pages = op(q, k, v, pooled, start, start + q.shape[0], layer=0)
    assert pages.density == pytest.approx(counts[0] / 104)
    op.new_prompt()
    assert op.budgets.counts == {}


def test_flat_attention_keeps_keep_blocks_in_every_layer():
    """Random weights' attention is flat in every layer: each layer's need is the mean need, so
    the counts stay keep_blocks and the page lists are the fixed setting's."""
    op = CompactAttention(compact_settings(selector="topk", keep_blocks=32, layer_budget="attention"), 8, 2, B,
                          0.25, "torch", torch.device("cpu"))
    fixed = CompactAttention(compact_settings(selector="topk", keep_blocks=32), 8, 2, B, 0.25, "torch",
                             torch.device("cpu"))
    for layer in range(4):
        q, k, v, pooled, start = _chunk(30 + layer, 96, False)
        q, k = q * 0, k * 0  # every score equal: flat
        pages, _ = op.select(q, k, pooled * 0, start, start + q.shape[0], layer=layer)
        expected, _ = fixed.select(q, k, pooled * 0, start, start + q.shape[0], layer=layer)
        assert op.budgets.counts[layer] == 32 and torch.equal(pages.indices, expected.indices)


def test_a_prefill_measures_each_selecting_layer_once_per_prompt(tmp_path):
    """The engine tells CompactAttention each chunk's layer: the layers past
    prefill_dense_layer_num get a count at their first selecting chunk, every later chunk of
    theirs keeps it (each layer's reported density is its chunks' min(count, history) over
    history, or 1 where the chunk ran dense), and the next prompt measures again."""
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.layout import kv_layout
    from ktlong.prefill import LayerMajorPrefill
    from tests.tiny_gguf import TinySpec, tiny_model

    lm = tiny_model(tmp_path, TinySpec(num_layers=4), seed=11)
    c = lm.config
    ids = [1 + i % 290 for i in range(16 * 40 + 7)]
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, len(ids), "fp32")
    params = compact_settings(selector="topk", keep_blocks=16, dense_above=0.9, prefill_dense_layer_num=1,
                              layer_budget="attention")
    engine = LayerMajorPrefill(lm.model, layout, 64, "torch", hidden_on_device=True, compact=params)
    seen = []
    decide = engine.compact.budgets.decide
    engine.compact.budgets.decide = lambda layer, need: seen.append(layer) or decide(layer, need)
    _, stats = engine.run(ids, HostKVCache(layout, pin=False))
    counts = dict(engine.compact.budgets.counts)
    assert seen == [1, 2, 3] and set(counts.values()) <= {16, 32}
    for layer in (1, 2, 3):
        per_chunk = []
        for s in range(64, len(ids), 64):
            num_hist = s // 16
            fixed_selects = params.keep_blocks <= 0.9 * num_hist
            per_chunk.append(counts[layer] / num_hist if fixed_selects and counts[layer] <= 0.9 * num_hist else 1.0)
        assert stats.density_per_layer[layer] == pytest.approx(sum(per_chunk) / len(per_chunk))
    assert stats.density_per_layer[0] == 1.0
    engine.run(ids, HostKVCache(layout, pin=False))
    assert seen[3:] == [1, 2, 3]


@pytest.mark.gpu
def test_on_the_gpu_the_counts_follow_the_cpus():
    """On a GPU the ranks come from the topk Triton kernels: each layer's count is the CPU
    path's on the same chunk, or one step of BUDGET_STEP from it where float32 sums in another
    order reorder near-tied blocks at the mass's edge; the page lists hold the GPU's count."""
    settings = compact_settings(selector="topk", keep_blocks=32, layer_budget="attention")
    cpu = CompactAttention(settings, 8, 2, B, 0.25, "torch", torch.device("cpu"))
    gpu = CompactAttention(settings, 8, 2, B, 0.25, "torch", torch.device("cuda"))
    for layer, concentrated in enumerate([True, False, True, False]):
        q, k, v, pooled, start = _chunk(40 + layer, 96, concentrated, dim=64)
        end = start + q.shape[0]
        cpu.select(q, k, pooled, start, end, layer=layer)
        gpu_pages, _ = gpu.select(q.cuda(), k.cuda(), pooled.cuda(), start, end, layer=layer)
        assert abs(gpu.budgets.counts[layer] - cpu.budgets.counts[layer]) <= layer_budget.BUDGET_STEP
        assert gpu_pages.density == pytest.approx(gpu.budgets.counts[layer] / 96)
    assert gpu.budgets.counts[0] == 32 and gpu.budgets.counts[1] > 32
