"""Hybrid decode equals dense decode when every block is selected, and every selection option
does what it says."""

import dataclasses

import numpy as np
import pytest

from cpu_ops.anchors import stored_anchors
from tests.anchors_reference import build_anchors_reference
from cpu_ops.bf16 import from_bf16
from tests.settings import selection, with_anchors
from ktlong.session.dense import DenseSession
from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import LongContextSession
from tests.tiny_gguf import TinySpec, tiny_model

B = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=4), seed=31)


def session(lm, settings, local=32, max_seq_len=512):
    c = lm.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, B, max_seq_len, "fp32"), settings)
    return LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True, compact=None,
                              selection=settings, local_windows_len=local, use_cuda_graph=False)


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 298, size=n)]


def test_selecting_every_block_equals_dense_decode_for_50_tokens(tiny):
    ids = prompt(150)
    settings = selection(second_select_num=1000, dense_layer_num=1, preselect_block=False)
    hybrid, dense = session(tiny, settings), DenseSession(tiny.model, 512, 64)
    a, b = hybrid.prefill(ids), dense.prefill(ids)
    assert hybrid.decoder.window.context_blocks[1] > 1  # the CPU part has blocks to read
    for i in range(50):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4, i
        token = int(b.argmax())
        a, b = hybrid.step(token), dense.step(token)
    assert hybrid.decoder.times.cpu_attention > 0


class Calls(list):
    """(layer, step, first, last, per-head block lists, blocks array) per select call, and the
    query each layer was last selected with."""

    def __init__(self):
        super().__init__()
        self.queries = {}


def spy(decoder):
    calls = Calls()
    original = decoder.selector.select

    def record(layer, step, q, first, last, device_scores=None):
        blocks, counts = original(layer, step, q, first, last, device_scores)
        calls.queries[layer] = q.copy()
        calls.append((layer, step, first, last, [list(blocks[h, :counts[h]]) for h in range(len(counts))], blocks))
        return blocks, counts

    decoder.selector.select = record
    return calls


def run(lm, steps=3, **kw):
    settings = dataclasses.replace(selection(preselect_block=False, dense_layer_num=0), **kw)
    s = session(lm, settings)
    s.prefill(prompt(200, seed=1))
    calls = spy(s.decoder)
    for t in range(steps):
        s.step(5 + t)
    return s, calls


def test_second_select_num_and_local_window_bound_the_cpu_blocks(tiny):
    s, calls = run(tiny, second_select_num=3)
    first, last = s.decoder.window.context_blocks
    assert first == 1 and last == (200 - 32) // B  # one sink block; window covers >= 32 tokens
    for _, _, _, _, lists, _ in calls:
        assert all(len(l) == 3 and l == sorted(l) and all(first <= b < last for b in l) for l in lists)


def test_dense_layers_read_every_context_block(tiny):
    _, calls = run(tiny, second_select_num=2, dense_layer_num=2)
    for layer, _, first, last, lists, _ in calls:
        expected = list(range(first, last)) if layer < 2 else None
        assert (lists[0] == expected) if layer < 2 else len(lists[0]) == 2


def test_shared_mode_selects_one_list_for_all_heads_separate_may_differ(tiny):
    _, shared = run(tiny, second_select_num=2, head_select_mode="SHARED")
    assert all(lists[0] == lists[1] for *_, lists, _ in shared)
    _, separate = run(tiny, second_select_num=2, head_select_mode="SEPARATE")
    assert any(lists[0] != lists[1] for *_, lists, _ in separate)


def test_layer_step_reuses_the_last_selected_layers_blocks(tiny):
    _, calls = run(tiny, steps=1, second_select_num=2, layer_step=2)
    by_layer = {layer: arr for layer, _, _, _, _, arr in calls}
    assert by_layer[1] is by_layer[0] and by_layer[3] is by_layer[2] and by_layer[2] is not by_layer[0]


def test_token_step_reuses_selection_between_reselections(tiny):
    _, calls = run(tiny, steps=3, second_select_num=2, token_step=2)
    per_step = {(layer, step): arr for layer, step, _, _, _, arr in calls}
    assert per_step[(2, 1)] is per_step[(2, 0)]  # step 1 reuses step 0
    assert per_step[(2, 2)] is not per_step[(2, 0)]  # step 2 reselects


@pytest.mark.parametrize("anchor_type", ["MAX", "MEAN", "QUEST", "DYNAMIC", "FIX"])
def test_selection_is_top_k_by_reference_anchor_scores(tiny, anchor_type):
    s, calls = run(tiny, steps=1, second_select_num=3, anchor_type=anchor_type, anchor_num=2,
                   head_select_mode="SEPARATE")
    layout = s.layout
    layer, _, first, last, lists, _ = calls[2]
    keys = s.host.k[layer].numpy()
    if anchor_type == "DYNAMIC":  # picked by prefill's importance (tests/test_prefill.py): keys of their block
        anchors = s.host.anchor_keys[layer].numpy()
        for h, b in np.ndindex(*anchors.shape[:2]):
            assert all((keys[h, b] == a).all(1).any() for a in anchors[h, b])
    else:
        anchors = build_anchors_reference(keys, 200, anchor_type, 2)
    anchors = from_bf16(stored_anchors(anchors, anchor_type))  # the bfloat16 values decode scores with
    assert len(lists) == layout.num_kv_heads
    for h in range(layout.num_kv_heads):
        assert len(lists[h]) == 3 and all(first <= b < last for b in lists[h])
    # every chosen block scores at least as high as every unchosen context block
    qh = calls.queries[layer]
    group = qh.shape[0] // layout.num_kv_heads
    for h in range(layout.num_kv_heads):
        def score(b):
            a = anchors[h, b]
            if anchor_type == "QUEST":
                return sum(np.maximum(qh[h * group + g] * a[0], qh[h * group + g] * a[1]).sum() for g in range(group))
            return sum((a @ qh[h * group + g]).max() for g in range(group))
        chosen = [score(b) for b in lists[h]]
        others = [score(b) for b in range(first, last) if b not in lists[h]]
        assert min(chosen) >= max(others) - 1e-4


def test_preselection_restricts_candidates_to_the_top_blocks_of_the_last_prompt_queries(tiny):
    settings = selection(preselect_block=True, preselect_block_count=4, second_select_num=2,
                                 dense_layer_num=0)
    s = session(tiny, settings)
    s.prefill(prompt(200, seed=2))
    cand = s.decoder.selector.candidates
    first, last = s.decoder.window.context_blocks
    assert all(c is not None and (c.sum(1) == 4).all() for c in cand)
    assert all(not c[:, :first].any() and not c[:, last:].any() for c in cand)  # context blocks only
    for layer, c in enumerate(cand):  # SHARED: the 4 context blocks with most prompt attention mass
        mass = s.block_mass[layer][:, first:last].sum(0)
        assert set(np.flatnonzero(c[0])) == set(first + np.argsort(-mass)[:4])
    calls = spy(s.decoder)
    s.step(7)
    for layer, _, _, _, lists, _ in calls:
        for h, l in enumerate(lists):
            assert all(cand[layer][h, b] for b in l)


def test_blocks_filled_while_generating_become_selectable(tiny):
    settings = selection(preselect_block=True, preselect_block_count=2, second_select_num=3,
                                 dense_layer_num=0, anchor_type="MAX")
    s = session(tiny, settings, local=16)
    s.prefill(prompt(64, seed=3))  # 4 prompt blocks
    for t in range(80):  # 5 more blocks fill; the window slides past them
        s.step(10 + t % 50)
    h = s.host
    block = 6  # filled during generation
    k = h.k[0][:, block].numpy()
    np.testing.assert_array_equal(h.key_max[0][:, block].numpy(), k.max(1))
    np.testing.assert_allclose(from_bf16(s.decoder.selector.anchors[0][:, block, 0]), k.max(1), rtol=2 ** -8)
    first, last = s.decoder.window.context_blocks
    assert last > 5
    blocks, counts = s.decoder.selector.select(0, 999, np.ones((4, 16), np.float32), first, last)
    assert counts[0] == 3  # 2 preselected prompt blocks compete with every generated block
