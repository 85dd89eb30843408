"""Decoders' device anchors follow their conversation's length, in one pool of device bytes: a
request is admitted only when its anchors fit beside the running answers', parked decoders go
to make room, and what cannot fit is refused in one sentence before any prefill work."""

import numpy as np
import pytest

from ktlong.errors import KtlongError
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import HeldConversation, LongContextSession
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model

B, MAX = 16, 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=2), seed=5)


def session_with_pool(lm, pool_tokens):
    """A session scoring blocks on the device (here the CPU) whose anchors' pool holds those of
    conversations reaching pool_tokens tokens in all."""
    c = lm.config
    settings = selection(second_select_num=2, preselect_block=False, block_scoring="device")
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, B, MAX, "fp32"), settings)
    probe = LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True,
                               compact=None, selection=settings, local_windows_len=32, use_cuda_graph=False)
    return LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True,
                              compact=None, selection=settings, local_windows_len=32, use_cuda_graph=False,
                              anchors_pool=probe.anchors.bytes_for(pool_tokens), max_seq_len=MAX)


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 300, size=n)]


def test_a_decoder_s_anchors_follow_its_prompt_and_answer_and_decode_the_same(tiny):
    session = session_with_pool(tiny, MAX)
    first = session.prefill(prompt(150, 1), answer_room=20)
    sized = session.decoder
    assert sized.reach_tokens == 170 and sized.device_anchors.num_blocks == -(-170 // B)
    assert sized.anchor_bytes == session.anchors.bytes_for(170) < session.anchors.bytes_for(MAX)
    steps = [session.step(t) for t in prompt(20, 2)]
    full = session_with_pool(tiny, MAX)  # the reference: anchors for max_seq_len
    assert float((full.prefill(prompt(150, 1)) - first).abs().max()) == 0
    assert full.decoder.device_anchors.num_blocks == MAX // B
    for a, t in zip(steps, prompt(20, 2)):
        assert float((full.step(t) - a).abs().max()) == 0  # the same blocks scored, the same sums


def test_admission_counts_the_running_answers_anchors_and_parked_decoders_make_room(tiny):
    session = session_with_pool(tiny, MAX)  # one conversation of max_seq_len's anchors
    session.prefill(prompt(200, 3), answer_room=24)  # 224 tokens: 14 of the pool's 32 blocks
    running = session.conversation
    # beside it as a running answer: 288 tokens (18 blocks) fit, 289 (19 blocks) do not
    assert session.decoder_fits(288, [running]) and not session.decoder_fits(289, [running])
    assert session.decoder_fits(MAX, [])  # nothing running: parked and idle decoders make room
    # parked (its answer done, held elsewhere): a conversation of max_seq_len's takes its room
    session.exchange(HeldConversation.empty(session.layout, HostKVCache(session.layout, pin=False)))
    assert running.decoder is not None
    session.prefill(prompt(300, 4))  # reaches max_seq_len
    assert running.decoder is None and session.decoder.reach_tokens == MAX
    assert session.anchors.in_use() == session.anchors.bytes_for(MAX)


def test_what_the_running_answers_leave_no_room_for_is_refused_before_any_prefill(tiny):
    session = session_with_pool(tiny, MAX)
    session.prefill(prompt(200, 5), answer_room=24)
    running = session.detach(HostKVCache(session.layout, pin=False))  # it decodes on beside the next prefill
    with pytest.raises(KtlongError, match=r"^The decoders running hold 0\.00 GiB of the 0\.00 GiB of device "
                                          r"anchors, and this conversation's 0\.00 GiB do not fit beside them; lower "
                                          r"max_num_seqs or max_seq_len, or raise gpu_memory_budget_gb\.$"):
        session.prefill(prompt(300, 6))
    assert session.ids == [] and session.host.num_tokens == 0 and running.decoder is not None
    session.prefill(prompt(100, 6), answer_room=100)  # 200 tokens: 13 blocks beside its 14
    assert session.anchors.in_use() == session.anchors.bytes_for(224) + session.anchors.bytes_for(200)


def test_a_batch_of_parked_conversations_lets_its_anchors_go_when_a_new_decoder_needs_them(tiny):
    """Two conversations decoded together, then parked: the batch's body still holds their
    decoders; a conversation of max_seq_len's needs their room, so the parked decoders go and the
    batch with them (where it stayed, the prefill was refused for want of anchors)."""
    session = session_with_pool(tiny, MAX)
    held = []
    for seed in (7, 8):
        session.prefill(prompt(150, seed), answer_room=16)
        held.append(session.detach(HostKVCache(session.layout, pin=False)))
    session.step_batch(held, [5, 6])  # their batch: one body over both
    assert session._batches.batch is not None
    for conversation in held:
        session.park(conversation)
    assert session.anchors.in_use() == 2 * session.anchors.bytes_for(166)
    session.prefill(prompt(300, 9))  # reaches max_seq_len: the pool's whole
    assert session._batches.batch is None and all(c.decoder is None for c in held)
    assert session.anchors.in_use() == session.anchors.bytes_for(MAX)
