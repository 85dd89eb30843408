"""Layers' history kept on the device between turns: follow-ups read it there and bring it up to
date, and give what a session that moves every layer from DRAM gives, bit for bit."""

import numpy as np
import pytest
import torch

from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import RESIDENT_MARGIN, LongContextSession
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model

GB = 10 ** 9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # head_dim 32: one q8_0 block per row
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=3, hidden=128, head_dim=32), seed=17)


def session(lm, kv_type, resident_history, headroom):
    c = lm.config
    chosen = selection(second_select_num=1000, preselect_block=False)
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 400, kv_type, page_type="fp32"),
                          chosen)
    return LongContextSession(lm.model, layout, chunk_size=32, backend="torch", hidden_on_device=True, compact=None,
                              selection=chosen, local_windows_len=24, use_cuda_graph=False,
                              follow_up_headroom=headroom, resident_history=resident_history)


@pytest.mark.parametrize("kv_type", ["fp32", "q8_0"])
def test_follow_ups_over_resident_layers_equal_follow_ups_over_dram(tiny, kv_type, monkeypatch):
    """Two of three layers fit the room (each counted as 1 GB here): they are filled by the first
    follow-up, and later ones move only the tokens added since (the answer, the question) for
    them. A decoded answer, an edited conversation and a new prompt keep the copies honest:
    logits and decoded steps equal the other session's exactly."""
    import ktlong.kv.resident as resident_module

    monkeypatch.setattr(resident_module, "resident_layer_bytes", lambda layout: GB)
    rng = np.random.default_rng(5)
    tokens = lambda n: [int(t) for t in rng.integers(0, 300, size=n)]
    headroom = int(2.5 * GB) + RESIDENT_MARGIN  # two layers and a half beside the margin
    a = session(tiny, kv_type, True, headroom=headroom)
    b = session(tiny, kv_type, False, headroom=headroom)
    assert a.resident is not None and b.resident is None

    def both(fn):
        x, y = fn(a), fn(b)
        assert torch.equal(x, y)
        return x

    doc = tokens(150)
    both(lambda s: s.prefill(doc))
    assert a.resident.layers == []  # a new prompt's prefill keeps nothing back
    conversation = doc + tokens(20)
    both(lambda s: s.prefill(conversation))  # fills layers 0 and 1 with the document
    assert a.resident.layers == [0, 1] and a.resident.valid == {0: 150, 1: 150}
    for t in range(5):  # an answer: DRAM gains rows the copies do not have
        both(lambda s: s.step(7 + t))
        conversation.append(7 + t)
    follow = conversation + tokens(9)
    both(lambda s: s.prefill(follow))
    crossed_a, crossed_b = a.last_stats.bytes_to_device, b.last_stats.bytes_to_device
    assert a.resident.valid == {0: len(conversation), 1: len(conversation)}
    row = a.layout.stored_row_bytes * a.layout.num_kv_heads * 2
    assert crossed_b - crossed_a == 2 * 150 * row  # the document's rows stayed on the device for two layers
    edited = follow[:60] + tokens(30)  # diverges inside the document: the copies are cut there
    both(lambda s: s.prefill(edited))
    assert a.resident.valid == {0: 60, 1: 60}
    both(lambda s: s.step(3))
    other = tokens(120)  # a new prompt, then a follow-up over it
    both(lambda s: s.prefill(other))
    assert a.resident.layers == [] and all(v == 0 for v in a.resident.valid.values())
    again = other + tokens(4)
    both(lambda s: s.prefill(again))
    assert a.resident.valid == {0: 120, 1: 120}


def test_the_room_left_decides_how_many_layers_stay(tiny, monkeypatch):
    """Every layer when the room allows, none when a follow-up needs the memory itself, and the
    copies are freed before a new prompt's prefill."""
    import ktlong.kv.resident as resident_module

    monkeypatch.setattr(resident_module, "resident_layer_bytes", lambda layout: GB)
    s = session(tiny, "fp32", True, headroom=10 * GB)
    ids = list(range(100))
    s.prefill(ids)
    s.prefill(ids + [1, 2])
    assert s.resident.layers == [0, 1, 2]
    s.follow_up_headroom = GB // 2 + RESIDENT_MARGIN  # less than one layer beside the follow-up
    s.prefill(ids + [1, 2, 3])
    assert s.resident.layers == []
