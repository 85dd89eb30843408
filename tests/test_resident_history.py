"""Layers' history kept on the device between turns: follow-ups read it there and bring it up to
date, and give what a session that moves every layer from DRAM gives, bit for bit."""

import numpy as np
import pytest
import torch

from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import RESIDENT_MARGIN, LongContextSession
from tests.settings import few_shares, selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model

GB = 10 ** 9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # head_dim 32: one q8_0 block per row
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=3, hidden=128, head_dim=32), seed=17)


def session(lm, kv_type, resident_history, headroom, prefill_headroom=None, context_attention="cpu"):
    c = lm.config
    device_part = {"block_scoring": "device"} if context_attention == "gpu" else {}  # the device selects too
    chosen = selection(second_select_num=1000, preselect_block=False, context_attention=context_attention,
                       **device_part)
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 400, kv_type, page_type="fp32"),
                          chosen)
    return LongContextSession(lm.model, layout, chunk_size=32, backend="torch", hidden_on_device=True, compact=None,
                              selection=chosen, local_windows_len=24, use_cuda_graph=False,
                              follow_up_headroom=headroom, prefill_headroom=prefill_headroom,
                              resident_history=resident_history)


# where decode reads (context_attention) once: by the first answer both ways of filling the
# copies (at the prefill, or at the first follow-up's load) hold the same rows
@pytest.mark.parametrize("kv_type, context_attention, room_at_prefill", [
    ("fp32", "cpu", True), ("fp32", "cpu", False), ("q8_0", "cpu", True), ("q8_0", "cpu", False),
    ("q8_0", "gpu", False)])
def test_follow_ups_over_resident_layers_equal_follow_ups_over_dram(tiny, kv_type, context_attention, room_at_prefill,
                                                                    monkeypatch):
    """Two of three layers fit the room (each counted as 1 GB here). Their copies are filled as
    the document is prefilled (when the plan leaves room beside a prefill) or else by the first
    follow-up's load, and take every prefilled row after; a follow-up then moves only the rows
    decode added (the answer). A decoded answer, an edited conversation and a new prompt keep
    the copies honest: logits and decoded steps equal the other session's exactly. With
    `context_attention: gpu` decode reads the selected blocks of those two layers from the
    copies too, as far as they hold them (the kernel's Triton interpreter here)."""
    import ktlong.kv.resident as resident_module

    monkeypatch.setattr(resident_module, "resident_layer_bytes", lambda layout: GB)
    if context_attention == "gpu":
        few_shares(monkeypatch)
    rng = np.random.default_rng(5)
    tokens = lambda n: [int(t) for t in rng.integers(0, 300, size=n)]
    headroom = int(2.5 * GB) + RESIDENT_MARGIN  # two layers and a half beside the margin
    at_prefill = headroom if room_at_prefill else None
    a = session(tiny, kv_type, True, headroom, at_prefill, context_attention)
    b = session(tiny, kv_type, False, headroom, at_prefill, context_attention)
    assert a.resident is not None and b.resident is None
    row = a.layout.stored_row_bytes * a.layout.num_kv_heads * 2  # K and V of one token, one layer

    def both(fn):
        x, y = fn(a), fn(b)
        assert torch.equal(x, y)
        return x

    doc = tokens(150)
    both(lambda s: s.prefill(doc))
    assert a.resident.valid == ({0: 150, 1: 150} if room_at_prefill else {})
    conversation = doc + tokens(20)
    both(lambda s: s.prefill(conversation))
    assert a.resident.layers == [0, 1] and a.resident.valid == {0: 170, 1: 170}
    first_crossed = b.last_stats.bytes_to_device - a.last_stats.bytes_to_device
    assert first_crossed == (2 * 150 * row if room_at_prefill else 0)
    for t in range(5):  # an answer: DRAM gains rows the copies do not have
        both(lambda s: s.step(7 + t))
        conversation.append(7 + t)
    if context_attention == "gpu":  # two of three layers read on the device, none by b
        times = a.decoder.times
        assert 0 < times.near_read < times.device_read == times.selected and b.decoder.times.near_read == 0
        assert 3 * times.near_read == 2 * times.device_read
    follow = conversation + tokens(9)
    both(lambda s: s.prefill(follow))
    assert a.resident.valid == {0: 184, 1: 184}
    assert b.last_stats.bytes_to_device - a.last_stats.bytes_to_device == 2 * 170 * row  # only the answer crossed
    edited = follow[:60] + tokens(30)  # diverges inside the document: the copies are cut there
    both(lambda s: s.prefill(edited))
    assert a.resident.valid == {0: 90, 1: 90}
    both(lambda s: s.step(3))
    other = tokens(120)  # a new prompt, then a follow-up over it
    both(lambda s: s.prefill(other))
    assert a.resident.valid == ({0: 120, 1: 120} if room_at_prefill else {})
    again = other + tokens(4)
    both(lambda s: s.prefill(again))
    assert a.resident.valid == {0: 124, 1: 124}


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


def test_handed_over_conversations_keep_their_resident_history_while_room_allows(tiny, monkeypatch):
    """The server's swaps (exchange): each conversation keeps its own device copies while it is
    held outside the session, so that its follow-up after a swap moves no history, and gives
    the logits of a session without copies. With less room, the session's own conversation keeps
    its copies first, then the most recently parked one."""
    import ktlong.kv.resident as resident_module
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.session.long_context import HeldConversation

    monkeypatch.setattr(resident_module, "resident_layer_bytes", lambda layout: GB)
    rng = np.random.default_rng(9)
    tokens = lambda n: [int(t) for t in rng.integers(0, 300, size=n)]
    room = 20 * GB + RESIDENT_MARGIN
    a, b = session(tiny, "q8_0", True, room, room), session(tiny, "q8_0", False, room, room)
    docs = [tokens(n) for n in (150, 170, 130)]
    held = {a: [], b: []}
    for i, doc in enumerate(docs):  # three conversations, the first two handed over
        for s in (a, b):
            if i:
                held[s].append(s.exchange(HeldConversation.empty(s.layout, HostKVCache(s.layout, pin=False))))
        assert torch.equal(a.prefill(doc), b.prefill(doc))
    assert [h.resident.layers for h in held[a]] == [[0, 1, 2]] * 2
    for i in (0, 1, 0):  # back to a handed-over conversation: its follow-up reads its own copies
        for s in (a, b):
            back = next(h for h in held[s] if h.ids[:len(docs[i])] == docs[i])
            held[s].remove(back)
            held[s].append(s.exchange(back))
        follow = a.ids + tokens(10)
        assert torch.equal(a.prefill(follow), b.prefill(follow))
        assert a.last_stats.bytes_to_device == 0 < b.last_stats.bytes_to_device
        assert a.resident.valid == {layer: len(follow) for layer in range(3)}
    a.prefill_headroom = 6 * GB + 2 * RESIDENT_MARGIN  # a new prompt leaves room for two conversations' copies
    a.prefill(tokens(100))
    newest, oldest = held[a][-1], held[a][0]
    assert a.resident.layers == [0, 1, 2] and newest.resident.layers == [0, 1, 2] and oldest.resident.layers == []


def test_the_selected_blocks_follow_the_copies_and_their_memory():
    """`context_attention: gpu` reads a layer's leading blocks from its device copy as far as the
    copy holds whole blocks; a change of the copies' memory (a layer added or freed) tells the
    decoder to capture its graphs again, a copy that only grows does not."""
    from ktlong.decode.dram_blocks import DramBlocks
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.resident import ResidentHistory

    layout = kv_layout(3, 2, 32, 16, 400, "q8_0", page_type="fp32")
    cpu = torch.device("cpu")
    blocks = DramBlocks(HostKVCache(layout, pin=False), [0, 1, 2], 4, 0.125, cpu)
    resident = ResidentHistory(layout, cpu)
    resident.fit(2 * 2 * 2 * layout.capacity * layout.stored_row_bytes)  # layers 0 and 1
    assert resident.layers == [0, 1]
    def moved():  # whether use_resident found the copies' memory elsewhere (captured parts must go)
        seen = blocks.near_addresses
        blocks.use_resident(resident)
        return blocks.near_addresses != seen

    assert moved()  # new memory
    assert blocks.near_counts == [0, 0, 0]
    resident.extend(0, 0, 40)
    resident.extend(1, 0, 40)
    assert not moved()  # the same memory, holding more
    assert blocks.near_counts == [2, 2, 0] and blocks.near_blocks.tolist() == [2, 2, 0]  # whole blocks of 16
    assert blocks.covers(0, 2) and not blocks.covers(0, 3) and not blocks.covers(2, 1)
    resident.truncate(20)
    assert not moved() and blocks.near_counts == [1, 1, 0]
    resident.fit(0)
    assert moved() and blocks.near_counts == [0, 0, 0]
