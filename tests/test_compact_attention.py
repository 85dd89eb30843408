"""CompactAttention: selection, unions and page lists keep exactly what was selected, and the
executed result equals dense attention restricted to the kept blocks (dense when all kept)."""

import math

import numpy as np
import pytest
import torch

from operators.block_selector import pool_query_blocks, select_blocks_flashprefill, topk_group_blocks
from operators.block_union import (build_page_lists, every_page_lists, execution_groups, union_groups,
                                   union_query_blocks)
from operators.compact_attention import CompactAttention, CompactParams
from tests.settings import compact_settings, flashprefill_settings
from operators.dense_attention import dense_attention
from operators.paged_attention_reference import paged_attention_reference
from operators.xattention_selector import select_blocks_xattention
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.prefill import LayerMajorPrefill
from tests.tiny_gguf import TinySpec, tiny_model

B = 16


def setup(num_heads=8, num_kv=2, dim=16, start=10 * B, chunk=3 * B + 5, seed=0, capacity_blocks=20):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_kv, capacity_blocks, B, dim, generator=g)
    v = torch.randn(num_kv, capacity_blocks, B, dim, generator=g)
    q = torch.randn(chunk, num_heads, dim, generator=g) * 2
    pooled = k.mean(2)
    return q, k, v, pooled, start, start + chunk


def masked_dense(q, k, v, start, end, group_keep_per_head, scale):
    """Dense attention where head h sees history block j only if group_keep_per_head[h, j]."""
    num_kv, _, _, dim = k.shape
    keys = k.reshape(num_kv, -1, dim)[:, :end].double()
    values = v.reshape(num_kv, -1, dim)[:, :end].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // num_kv
    for h in range(q.shape[1]):
        kv = h // group
        for i in range(q.shape[0]):
            pos = start + i
            visible = torch.zeros(end, dtype=torch.bool)
            visible[start:pos + 1] = True
            for j in range(start // B):
                if group_keep_per_head[h, j]:
                    visible[j * B:(j + 1) * B] = True
            s = (keys[kv, visible] @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(s, 0) @ values[kv, visible]
    return out


@pytest.mark.parametrize("subgroup", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_page_lists_cover_every_selected_block_and_nothing_else(subgroup, seed):
    rng = np.random.default_rng(seed)
    num_heads, num_kv, nqb, num_hist, nb = 8, 2, 3, 11, 20
    keep = torch.from_numpy(rng.random((num_heads, nqb, num_hist)) < 0.2)
    groups = execution_groups(num_heads, num_kv, subgroup)
    pages = build_page_lists(union_groups(union_query_blocks(keep), groups), groups, num_heads, num_kv,
                             nb, num_hist, 2 * B + 3, B)
    indptr = pages.indptr.tolist()
    for g, heads in enumerate(groups.tolist()):
        kv = heads[0] // (num_heads // num_kv)
        assert all(h // (num_heads // num_kv) == kv for h in heads)
        listed = pages.indices[indptr[g]:indptr[g + 1]].tolist()
        expected_hist = [j for j in range(num_hist) if keep[heads, :, j].any()]
        chunk_pages = [kv * nb + num_hist + t for t in range(3)]  # the chunk is always all there
        assert listed == [kv * nb + j for j in expected_hist] + chunk_pages
    assert pages.last_page_len == 3


@pytest.mark.parametrize("num_heads,num_kv,subgroup,num_hist,chunk", [(8, 2, 8, 11, 2 * B + 3), (8, 2, 2, 0, B),
                                                                     (4, 4, 1, 7, 1), (8, 1, 4, 5, 3 * B)])
def test_every_page_lists_equal_the_page_lists_of_an_all_true_selection(num_heads, num_kv, subgroup, num_hist, chunk):
    groups = execution_groups(num_heads, num_kv, subgroup)
    expected = build_page_lists(torch.ones((groups.shape[0], num_hist), dtype=torch.bool), groups, num_heads,
                                num_kv, 20, num_hist, chunk, B)
    got = every_page_lists(groups.shape[0], num_kv, 20, num_hist, chunk, B, torch.device("cpu"))
    assert torch.equal(got.indptr, expected.indptr) and got.indptr.dtype == expected.indptr.dtype
    assert torch.equal(got.indices, expected.indices) and got.indices.dtype == expected.indices.dtype
    assert torch.equal(got.num_hist_kept, expected.num_hist_kept)
    assert (got.last_page_len, got.num_hist, got.density) == (expected.last_page_len, expected.num_hist,
                                                               expected.density)


def test_subgroups_split_large_groups():
    assert execution_groups(32, 8, 4).shape == (8, 4)
    assert execution_groups(32, 4, 4).shape == (8, 4)
    assert execution_groups(14, 2, 4).shape == (2, 7)  # 7 heads do not split into 4s: whole group


@pytest.mark.parametrize("selector", ["flashprefill", "xattention", "topk", "all"])
def test_keeping_everything_equals_dense_attention(selector):
    q, k, v, pooled, start, end = setup()
    params = (CompactParams.keep_all() if selector == "all" else
              compact_settings(selector=selector, alpha=0.0, threshold=1.0, keep_blocks=1 << 20, stride=4))
    op = CompactAttention(params, 8, 2, B, 0.25, "torch", torch.device("cpu"))
    out, pages = op(q, k, v, pooled, start, end)
    keys = k.reshape(2, -1, 16)[:, :end]
    values = v.reshape(2, -1, 16)[:, :end]
    expected = dense_attention(q, keys, values, 0.25)
    assert pages.density == 1.0
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-5


@pytest.mark.parametrize("subgroup", [2, 4])
def test_result_equals_dense_restricted_to_kept_blocks(subgroup):
    q, k, v, pooled, start, end = setup(seed=3, chunk=B + 5)
    strength = torch.linspace(0.2, 3.0, 20)[torch.randperm(20, generator=torch.Generator().manual_seed(9))]
    k = k * strength[None, :, None, None]  # some history blocks matter far more than others
    pooled = k.mean(2)
    op = CompactAttention(flashprefill_settings(alpha=0.9, sink_blocks=1, window_blocks=1, subgroup_size=subgroup),
                          8, 2, B, 0.25, "torch", torch.device("cpu"))
    out, pages = op(q, k, v, pooled, start, end)
    assert 0 < pages.density < 1
    expected = masked_dense(q, k, v, start, end, kept_per_head(op, pages, start // B, k.shape[1]), 0.25)
    assert float((out.double() - expected).abs().max() / expected.abs().max()) < 1e-5


@pytest.mark.parametrize("dense_tail,prompt_end", [(7, None), (7, 0), (12, 3)])
def test_the_prompts_last_queries_attend_to_every_block(dense_tail, prompt_end):
    """dense_tail: the prompt's last queries (here the chunk's last 7, or the last 9 when the
    prompt ends 3 queries after this chunk) equal dense attention over the whole history; the
    others equal dense attention restricted to the kept blocks. No prompt end: nothing changes."""
    q, k, v, pooled, start, end = setup(seed=3, chunk=B + 5)
    strength = torch.linspace(0.2, 3.0, 20)[torch.randperm(20, generator=torch.Generator().manual_seed(9))]
    k = k * strength[None, :, None, None]
    pooled = k.mean(2)
    settings = dict(selector="flashprefill", alpha=0.9, sink_blocks=1, window_blocks=1, subgroup_size=8)
    plain = CompactAttention(compact_settings(dense_tail=0, **settings), 8, 2, B, 0.25, "torch", torch.device("cpu"))
    op = CompactAttention(compact_settings(dense_tail=dense_tail, **settings), 8, 2, B, 0.25, "torch",
                          torch.device("cpu"))
    expected_sparse, pages = plain(q, k, v, pooled, start, end)
    assert 0 < pages.density < 1
    out, _ = op(q, k, v, pooled, start, end, None if prompt_end is None else end + prompt_end)
    rows = 0 if prompt_end is None else dense_tail - prompt_end
    dense = dense_attention(q, k.reshape(2, -1, 16)[:, :end], v.reshape(2, -1, 16)[:, :end], 0.25)
    n = q.shape[0] - rows
    assert torch.equal(out[:n], expected_sparse[:n])
    if rows:
        assert float((out[n:] - dense[n:]).abs().max() / dense.abs().max()) < 1e-5
        assert float((expected_sparse[n:] - dense[n:]).abs().max()) > 1e-3  # the selection did change them


def test_prompt_tail_counts_the_chunks_queries_among_the_prompts_last():
    from operators.compact_attention import prompt_tail

    assert prompt_tail(64, 128, 200, 24) == 0  # the prompt's last 24 are 176..199
    assert prompt_tail(128, 192, 200, 24) == 16 and prompt_tail(192, 200, 200, 24) == 8
    assert prompt_tail(192, 200, 200, 100) == 8 and prompt_tail(192, 200, 200, 0) == 0
    assert prompt_tail(192, 200, None, 24) == 0


def test_flashprefill_keeps_blocks_within_alpha_of_the_best():
    q, k, v, pooled, start, end = setup(seed=5)
    alpha = 0.3
    keep = select_blocks_flashprefill(q, pooled[:, :10], B, alpha, 0.25, 0, 0, tile_blocks=3)
    qb = pool_query_blocks(q, B)  # [H, nqb, D]
    for h in range(8):
        s = qb[h] @ pooled[h // 4, :10].T * 0.25  # [nqb, 10]
        expected = s >= s.max(-1, keepdim=True).values + math.log(alpha)
        assert torch.equal(keep[h], expected)


def test_flashprefill_always_keeps_sinks_and_window():
    q, k, v, pooled, start, end = setup(seed=6)
    keep = select_blocks_flashprefill(q, pooled[:, :10], B, 1.0, 0.25, 2, 3)
    assert keep[:, :, :2].all() and keep[:, :, 7:].all()


def test_xattention_mass_matches_direct_softmax_and_tiling():
    q, k, v, pooled, start, end = setup(seed=7)
    keys = k.reshape(2, -1, 16)[:, :start]
    a = select_blocks_xattention(q, keys, B, 4, 0.8, 0.25, 0, 0, tile_tokens=B)  # many tiles
    b = select_blocks_xattention(q, keys, B, 4, 0.8, 0.25, 0, 0, tile_tokens=1 << 20)  # one tile
    assert torch.equal(a, b)
    # reference: antidiagonal sums of each 4x4 tile, softmax over history, summed per block
    h, i = 5, 1
    rows = list(range(i * B, min((i + 1) * B, q.shape[0])))
    qs, ks = q[:, h].double(), keys[h // 4].double()
    anti = torch.zeros(math.ceil(q.shape[0] / 4), start // 4, dtype=torch.float64)
    for r in range(anti.shape[0]):
        for c in range(anti.shape[1]):
            anti[r, c] = sum(float(qs[4 * r + 3 - t] @ ks[4 * c + t]) for t in range(4)
                             if 4 * r + 3 - t < q.shape[0])
    p = torch.softmax(anti * 0.25 / 4, -1)
    mass = p[rows[0] // 4:rows[-1] // 4 + 1].sum(0).view(-1, B // 4).sum(-1)
    ordered, order = mass.sort(descending=True)
    before = ordered.cumsum(0) - ordered
    expected = torch.zeros(10, dtype=torch.bool)
    expected[order[before < 0.8 * ordered.sum()]] = True
    assert torch.equal(a[h, i], expected)


def test_tail_queries_keep_the_block_one_query_asks_for():
    """A block mean dilutes one query's question and one key's answer: 15 queries like every
    token alike, the last asks for one token of block 7, the other 15 tokens of which look like
    every other block. Pooled, block 7 scores below the margin and is dropped; with the last
    query scoring tokens, it is kept. Tail scoring only adds blocks."""
    B, D = 16, 16
    e0, e1 = torch.eye(D)[0], torch.eye(D)[1]
    keys = e0.repeat(1, 10 * B, 1)  # [KV=1, 10 blocks of B tokens, D]
    keys[0, 7 * B + 5] = 3 * e1
    pooled = keys.view(1, 10, B, D).mean(2)
    q = (20 * e0).repeat(B, 1, 1)  # [T=16, H=1, D]
    q[-1, 0] = 4 * e1
    plain = select_blocks_flashprefill(q, pooled, B, 0.5, 1.0, 0, 0)
    assert not plain[0, 0, 7] and plain[0, 0, :7].all()
    for tail in (1, 4, 16):
        with_tail = select_blocks_flashprefill(q, pooled, B, 0.5, 1.0, 0, 0, tail_queries=tail, keys=keys)
        assert with_tail[0, 0, 7] and (with_tail | ~plain).all()


def test_tail_block_keep_equals_a_direct_computation():
    """Each tail query's best token per block against its best outside sinks and window, in
    float64 by loops; tiles of any size give the same blocks, and the sinks and window never set
    the bar: a sink token far above every other token does not drop the blocks."""
    from operators.block_selector import tail_block_keep

    g = torch.Generator().manual_seed(3)
    num_kv, group, dim, nh, t = 2, 3, 8, 9, 5
    keys = torch.randn(num_kv, nh * B, dim, generator=g)
    keys[:, 2] = 40.0  # a sink token every query attends to
    tail = torch.randn(t, num_kv * group, dim, generator=g).abs()
    scale, alpha, sink, window = 0.5, 0.2, 1, 2
    expected = torch.zeros(num_kv * group, nh, dtype=torch.bool)
    for h in range(num_kv * group):
        for i in range(t):
            s = (keys[h // group].double() @ tail[i, h].double()).view(nh, B).amax(1) * scale
            best = s[sink:nh - window].max()
            for j in range(sink, nh - window):
                expected[h, j] |= bool(s[j] >= best + math.log(alpha))
    for tile in (B, 3 * B, 0):
        got = tail_block_keep(tail, keys, B, scale, math.log(alpha), sink, window, tile_tokens=tile)
        assert torch.equal(got, expected)
    assert 0 < int(expected.sum()) < expected.numel()  # some kept, some dropped
    assert not expected[:, :sink].any() and not expected[:, nh - window:].any()


@pytest.mark.parametrize("subgroup,tail,sink,window,tile,chunk", [
    (1, 0, 0, 0, 4096, 3 * B + 5), (2, 0, 1, 2, 3, 3 * B), (4, 2, 2, 3, 4096, 2 * B + 1), (8, 1, 0, 1, 4, 3 * B + 5)])
def test_fused_group_selection_equals_selection_then_unions(subgroup, tail, sink, window, tile, chunk):
    """flashprefill_group_keep (what CompactAttention runs) is select_blocks_flashprefill
    followed by the Q-block union and the union over each group's heads, exactly."""
    from operators.block_selector import flashprefill_group_keep

    selective = False
    for seed in range(3):
        q, k, v, pooled, start, end = setup(seed=10 + seed, chunk=chunk)
        groups = execution_groups(8, 2, subgroup)
        alpha = (0.3, 0.8, 0.99)[seed]
        keys = k.reshape(2, -1, 16)[:, :start]
        expected = union_groups(union_query_blocks(select_blocks_flashprefill(
            q, pooled[:, :10], B, alpha, 4.0, sink, window, tile_blocks=tile, tail_queries=tail, keys=keys)), groups)
        got = flashprefill_group_keep(q, pooled[:, :10], B, alpha, 4.0, sink, window, groups.shape[1],
                                      tail_queries=tail, keys=keys, tile_blocks=tile)
        assert torch.equal(got, expected)
        selective |= 0 < int(got.sum()) < got.numel()
    assert selective  # some blocks dropped, some kept: the comparison means something


def test_the_prompts_last_queries_score_tokens_wherever_their_chunks_end(monkeypatch):
    """The engine tells CompactAttention where the prompt ends; the last tail_queries queries
    score tokens, also where they straddle two chunks."""
    import operators.compact_attention as ca
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.layout import kv_layout
    from ktlong.models.random_model import random_model
    from ktlong.prefill import LayerMajorPrefill

    seen = []
    original = ca.flashprefill_group_keep
    monkeypatch.setattr(ca, "flashprefill_group_keep",
                        lambda *a, **kw: seen.append(kw["tail_queries"]) or original(*a, **kw))
    model = random_model("tiny", torch.device("cpu"), torch.float32)
    c = model.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 200, "fp32")
    engine = LayerMajorPrefill(model, layout, 64, "torch", True, compact=flashprefill_settings(tail_queries=24))
    engine.run(list(range(200)), HostKVCache(layout, pin=False))  # chunks 0-64 (no history), 64-128, 128-192, 192-200
    assert seen == [0, 16, 8] * c.num_layers  # queries 176-199: 16 in the third chunk, 8 in the last


class _RecordingExecutor:
    """Stands in for FlashInfer: run() executes the page lists of the last plan() with the torch
    reference, so a plan reused for lists it was not made for gives a wrong result."""

    def __init__(self, op):
        self.op, self.plans, self.planned = op, 0, None

    def plan(self, num_tokens, groups, pages, head_dim, block_size, scale, dtype):
        self.plans += 1
        self.planned = (num_tokens, pages)

    def reads_indices_from(self, indices):  # as FlashInfer: the planned lists' own indices tensor
        return self.planned[1].indices.data_ptr() == indices.data_ptr()

    def run(self, q, k_pages, v_pages, groups):
        assert self.planned[0] == q.shape[0]
        return paged_attention_reference(q, k_pages, v_pages, groups, self.planned[1], self.op.scale)


def recorded(op) -> dict[bool, list]:
    """op's executors replaced by _RecordingExecutors as op makes them, by kind (short: True)."""
    made = {False: [], True: []}
    op.make_executor = lambda short: made[short].append(_RecordingExecutor(op)) or made[short][-1]
    return made


def plans_made(made) -> int:
    return sum(e.plans for executors in made.values() for e in executors)


def test_every_block_lists_are_planned_once_per_chunk_and_the_plan_serves_every_layer():
    op = CompactAttention(CompactParams.keep_all(), 8, 2, B, 0.25, "torch", torch.device("cpu"))
    made = recorded(op)
    chunks = [(0, 2 * B), (2 * B, 4 * B + 5), (4 * B + 5 - 5, 4 * B + 5)]  # the last: a follow-up's token tail
    for c, (start, end) in enumerate(chunks):
        start = start // B * B
        for layer in range(3):  # layer after layer: other keys, same lists
            q, k, v, pooled, _, _ = setup(seed=10 * c + layer, start=start, chunk=end - start)
            out, _ = op(q, k, v, pooled, start, end)
            expected = dense_attention(q, k.reshape(2, -1, 16)[:, :end], v.reshape(2, -1, 16)[:, :end], 0.25)
            assert float((out - expected).abs().max() / expected.abs().max()) < 1e-5
        assert plans_made(made) == c + 1  # one plan per chunk, not per layer


def test_a_plan_keeps_its_executor_until_plans_of_other_lists_take_every_slot():
    """PLAN_SLOTS executors per kind keep as many plans (a prompt's first chunk, its full chunks
    and its last, shorter one, layer after layer): a selective plan in between leaves the
    every-block plan in place; once other keyed plans took every executor, those lists are
    planned again, and each run gives the dense result (a stale plan would not)."""
    from operators.compact_attention import PLAN_SLOTS

    params = flashprefill_settings(alpha=0.0)  # flashprefill keeping every block, through its own page lists
    op = CompactAttention(params, 8, 2, B, 0.25, "torch", torch.device("cpu"))
    made = recorded(op)
    first = setup(seed=1, start=0, chunk=2 * B)

    def run(q, k, v, pooled, start, end):
        out, _ = op(q, k, v, pooled, start, end)
        expected = dense_attention(q, k.reshape(2, -1, 16)[:, :end], v.reshape(2, -1, 16)[:, :end], 0.25)
        assert float((out - expected).abs().max() / expected.abs().max()) < 1e-5

    run(*first[:4], 0, 2 * B)  # no history: the every-block lists, keyed
    q1, k1, v1, pooled1, start, end = setup(seed=2)
    run(q1, k1, v1, pooled1, start, end)  # history: selected lists, planned anew on another executor
    run(*first[:4], 0, 2 * B)
    assert plans_made(made) == 2 and len(made[True]) == 2  # chunks of at most SHORT_CHUNK
    others = [B + 4 * i for i in range(PLAN_SLOTS)]  # other every-block lists (no history) take every executor
    for chunk in others:
        run(*setup(seed=chunk, start=0, chunk=chunk)[:4], 0, chunk)
    run(*first[:4], 0, 2 * B)
    assert plans_made(made) == 2 + PLAN_SLOTS + 1 and len(made[True]) == PLAN_SLOTS


def test_a_prefill_plans_its_chunks_once_not_once_per_layer(tmp_path):
    """Layer after layer, a compact prefill's first chunk (no history), its full topk chunks and
    its last, shorter one reuse their plans: three plans for the whole prefill."""
    lm = tiny_model(tmp_path, TinySpec(num_layers=4), seed=11)
    c = lm.config
    ids = list(range(1, 16 * 16 + 7))
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, len(ids), "fp32")
    params = compact_settings(selector="topk", keep_blocks=2, dense_above=1.0, prefill_dense_layer_num=1,
                              sink_blocks=1, window_blocks=1)
    engine = LayerMajorPrefill(lm.model, layout, 32, "torch", hidden_on_device=True, compact=params)
    made = recorded(engine.compact)
    engine.run(ids, HostKVCache(layout, pin=False))
    assert plans_made(made) == 3  # 3 selecting layers x (1 + 7 full + 1 short chunks) runs


def test_short_chunks_run_on_the_short_chunk_executor_and_long_ones_on_the_main_one():
    from operators.compact_attention import SHORT_CHUNK

    op = CompactAttention(CompactParams.keep_all(), 8, 2, B, 0.25, "torch", torch.device("cpu"))
    made = recorded(op)
    for chunk in (SHORT_CHUNK, SHORT_CHUNK + 1, 1):
        q, k, v, pooled, start, end = setup(seed=chunk, start=2 * B, chunk=chunk, capacity_blocks=12)
        out, _ = op(q, k, v, pooled, start, end)
        expected = dense_attention(q, k.reshape(2, -1, 16)[:, :end], v.reshape(2, -1, 16)[:, :end], 0.25)
        assert float((out - expected).abs().max() / expected.abs().max()) < 1e-5
    assert [e.plans for e in made[True]] == [1, 1] and [e.plans for e in made[False]] == [1]


def reference_topk_margins(q, pooled, block_size, scale, group_size):
    """[G, num_hist] float64, with loops: a block's score minus its row's best, maximised over
    the group's heads and pooled query blocks (what topk ranks by)."""
    num_q, num_heads, _ = q.shape
    num_kv, num_hist, _ = pooled.shape
    margins = np.full((num_heads // group_size, num_hist), -np.inf)
    for g in range(num_heads // group_size):
        for h in range(g * group_size, (g + 1) * group_size):
            for b0 in range(0, num_q, block_size):
                qb = q[b0:b0 + block_size, h].double().mean(0)
                scores = (pooled[h // (num_heads // num_kv)].double() @ qb * scale).numpy()
                margins[g] = np.maximum(margins[g], scores - scores.max())
    return margins


def assert_a_topk_of(kept: set, margins, num_keep: int, forced: set):
    """kept holds the forced blocks and num_keep in all, and no dropped block ranks above a kept
    one (ties, several rows' best blocks at margin 0, may go either way)."""
    assert forced <= kept and len(kept) == num_keep
    chosen = [margins[j] for j in kept - forced]
    dropped = [margins[j] for j in set(range(len(margins))) - kept]
    if chosen and dropped:
        assert min(chosen) >= max(dropped) - 1e-6


def kept_per_head(op, pages, num_hist, blocks_per_head):
    keep = torch.zeros(op.num_heads, num_hist, dtype=torch.bool)
    indptr = pages.indptr.tolist()
    for g, heads in enumerate(op.groups.tolist()):
        kv = heads[0] // (op.num_heads // op.num_kv_heads)
        for page in pages.indices[indptr[g]:indptr[g + 1]].tolist():
            j = page - kv * blocks_per_head
            if j < num_hist:
                keep[heads, j] = True
    return keep


@pytest.mark.parametrize("subgroup,keep_blocks,sink,window,chunk", [(2, 5, 1, 2, 2 * B + 5), (4, 5, 0, 0, B),
                                                                     (1, 1, 1, 1, 3 * B)])
def test_topk_keeps_each_groups_best_blocks_and_the_same_count_in_every_group(subgroup, keep_blocks, sink, window,
                                                                              chunk):
    q, k, v, pooled, start, end = setup(seed=5, chunk=chunk)
    strength = torch.linspace(0.2, 3.0, 20)[torch.randperm(20, generator=torch.Generator().manual_seed(4))]
    k = k * strength[None, :, None, None]
    pooled = k.mean(2)
    op = CompactAttention(compact_settings(selector="topk", keep_blocks=keep_blocks, sink_blocks=sink,
                                           window_blocks=window, subgroup_size=subgroup),
                          8, 2, B, 0.25, "torch", torch.device("cpu"))
    out, pages = op(q, k, v, pooled, start, end)
    num_hist = start // B
    num_keep = max(keep_blocks, sink + window)
    chunk_blocks = -(-chunk // B)
    assert pages.indptr.tolist() == [g * (num_keep + chunk_blocks) for g in range(op.groups.shape[0] + 1)]
    assert pages.density == pytest.approx(num_keep / num_hist)
    keep = kept_per_head(op, pages, num_hist, k.shape[1])
    margins = reference_topk_margins(q, pooled[:, :num_hist], B, 0.25, op.groups.shape[1])
    forced = set(range(sink)) | set(range(num_hist - window, num_hist))
    for g, heads in enumerate(op.groups.tolist()):
        assert_a_topk_of(set(torch.nonzero(keep[heads[0]]).view(-1).tolist()), margins[g], num_keep, forced)
    expected = masked_dense(q, k, v, start, end, keep, 0.25)
    assert float((out.double() - expected).abs().max() / expected.abs().max()) < 1e-5


def test_topk_plans_once_and_each_layer_and_chunk_reads_its_own_blocks():
    """Equal counts share one plan across layers and across chunks of the same length (the
    prefill's order: every chunk of a layer, then the next layer); the indices it reads are
    rewritten in place, so each call attends to its own selection, not the first one's."""
    op = CompactAttention(compact_settings(selector="topk", keep_blocks=6), 8, 2, B, 0.25, "torch",
                          torch.device("cpu"))
    made = recorded(op)
    selections = []
    for layer in range(2):
        for c, start in enumerate((10 * B, 12 * B)):
            q, k, v, pooled, start, end = setup(seed=20 + 2 * layer + c, start=start)
            out, pages = op(q, k, v, pooled, start, end)
            assert pages.num_hist == start // B and pages.density == pytest.approx(6 / (start // B))
            keep = kept_per_head(op, pages, start // B, k.shape[1])
            selections.append(keep[:, :10])  # the blocks both chunks can choose from
            expected = masked_dense(q, k, v, start, end, keep, 0.25)
            assert float((out.double() - expected).abs().max() / expected.abs().max()) < 1e-5
            ids = topk_group_blocks(q, pooled[:, :start // B], B, 0.25, 6, 1, 2, 4)
            for g, heads in enumerate(op.groups.tolist()):
                assert set(torch.nonzero(keep[heads[0]]).view(-1).tolist()) == set(ids[g].tolist())
    assert plans_made(made) == 1
    assert not all(torch.equal(selections[0], s) for s in selections[1:])  # the calls did select differently
