"""Long-context mode (layer-major prefill, DRAM cache, decode over it) generates what dense does."""

import dataclasses
import os

import numba
import numpy as np
import pytest
import torch

from ktlong.session.dense import DenseSession
from ktlong.chat.generate import generate
from ktlong.kv.layout import kv_layout, model_kv_layout
from ktlong.session.long_context import LongContextSession
from ktlong.chat.sampling import Sampler
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model
from tests.no_text import NO_TEXT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=2), seed=21)


def session_for(lm, max_seq_len, block_size=16, chunk_size=32):
    c = lm.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, max_seq_len, "fp32"),
                          selection())
    return LongContextSession(lm.model, layout, chunk_size=chunk_size, backend="torch", hidden_on_device=True,
                              compact=None, selection=selection(), local_windows_len=4096, use_cuda_graph=False)


def test_generation_equals_dense_session(tiny):
    prompt = list(np.random.default_rng(3).integers(0, 300, size=45))
    dense = generate(DenseSession(tiny.model, 128, 32), prompt, 40, Sampler(), frozenset(), NO_TEXT)
    long = generate(session_for(tiny, 128), prompt, 40, Sampler(), frozenset(), NO_TEXT)
    assert long.token_ids == dense.token_ids and len(long.token_ids) == 40


def every_block(lm, max_seq_len, block_size=16, chunk_size=32, compact=None):
    """A session whose decode reads every block, so generated K/V are what prefill would compute."""
    c = lm.config
    chosen = selection(second_select_num=1000, preselect_block=False)
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, max_seq_len, "fp32"),
                          chosen)
    return LongContextSession(lm.model, layout, chunk_size=chunk_size, backend="torch", hidden_on_device=True,
                              compact=compact, selection=chosen, local_windows_len=24, use_cuda_graph=False)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("follow_up", [3, 1, 61, 150])  # within a block, one token, past a chunk, many chunks
def test_follow_up_prefills_only_its_new_tokens_and_equals_a_re_prefill(tiny, follow_up):
    rng = np.random.default_rng(follow_up)
    session = every_block(tiny, 400)
    first = [int(t) for t in rng.integers(0, 300, size=37)]  # ends mid-block and mid-chunk
    gen = generate(session, first, 6, Sampler(), frozenset(), NO_TEXT)
    conversation = first + gen.token_ids[:-1]  # the last sampled token was never fed: not in the cache
    follow = conversation + [int(t) for t in rng.integers(0, 300, size=follow_up)]
    extended = session.prefill(follow)
    assert session.last_stats.num_tokens == follow_up and session.host.num_tokens == len(follow)
    fresh = every_block(tiny, 400)
    expected = fresh.prefill(follow)
    assert rel(extended, expected) < 1e-4
    # the cache now holds what a re-prefill holds: K/V and the key tables of every block. DYNAMIC
    # anchors rank a block's keys by the attention of its chunk's last queries, and the chunk the
    # history ended in is a shorter one in a follow-up: blocks from there on may pick other keys
    n, kept = len(follow), len(conversation) // 16
    for layer in range(tiny.config.num_layers):
        h, f = session.host, fresh.host
        for a, b in ((h.tokens(layer, "k", 0, n), f.tokens(layer, "k", 0, n)),
                     (h.tokens(layer, "v", 0, n), f.tokens(layer, "v", 0, n)),
                     (h.key_max[layer][:, :-(-n // 16)], f.key_max[layer][:, :-(-n // 16)]),
                     (h.key_min[layer][:, :-(-n // 16)], f.key_min[layer][:, :-(-n // 16)]),
                     (h.key_mean[layer][:, :-(-n // 16)], f.key_mean[layer][:, :-(-n // 16)]),
                     (h.anchor_keys[layer][:, :kept], f.anchor_keys[layer][:, :kept])):
            assert rel(a, b) < 1e-4
    # and decodes on from it as a re-prefilled session does
    assert rel(session.step(5), fresh.step(5)) < 1e-4


@pytest.mark.parametrize("block_scoring,preselect,context_attention", [
    ("cpu", True, "cpu"), ("device", False, "cpu"),
    pytest.param("cpu", True, "gpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason=(
        "CPU tensors through Triton's interpreter, which tests/conftest.py sets only without CUDA")))])
def test_a_follow_up_keeps_the_decoder_and_decodes_as_a_new_one_would(tiny, block_scoring, preselect,
                                                                      context_attention):
    """The decoder (device window, anchors, graphs on a GPU, its DRAM reads) stays across a follow-up
    and goes on exactly as one built after it: sparse selection with preselection, a selection
    kept for two tokens, anchors scored where the model runs, blocks filling during decode."""
    c = tiny.config
    chosen = selection(second_select_num=2, preselect_block=preselect, preselect_block_count=3, token_step=2,
                       anchor_type="MAX", block_scoring=block_scoring, context_attention=context_attention)
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 400, "fp32", anchor_type="MAX")

    def new_session():
        return LongContextSession(tiny.model, layout, chunk_size=32, backend="torch", hidden_on_device=True,
                                  compact=None, selection=chosen, local_windows_len=24, use_cuda_graph=False)

    rng = np.random.default_rng(7)
    first = [int(t) for t in rng.integers(0, 300, size=150)]
    kept, rebuilt = new_session(), new_session()
    answers = [generate(s, first, 9, Sampler(), frozenset(), NO_TEXT).token_ids for s in (kept, rebuilt)]
    assert answers[0] == answers[1]
    follow = first + answers[0][:-1] + [int(t) for t in rng.integers(0, 300, size=105)]  # 263 tokens
    decoder = kept.decoder
    rebuilt.decoder = None  # as if the follow-up had not fitted beside it: built anew after prefill
    assert kept.prefill(follow).equal(rebuilt.prefill(follow))
    assert kept.decoder is decoder and rebuilt.decoder is not decoder
    assert kept.decoder.window.context_blocks == (1, 14)
    for t in range(19):  # the window slides at the 17th step: a block joins the selection in both
        assert kept.step(10 + t).equal(rebuilt.step(10 + t)), t
    assert kept.decoder.window.context_blocks == rebuilt.decoder.window.context_blocks == (1, 15)
    assert kept.decoder.selector.cache.keys() == rebuilt.decoder.selector.cache.keys()
    assert (kept.decoder.times.device_read > 0) == (context_attention == "gpu")  # the device read the blocks


@pytest.mark.parametrize("first_len", [9, 40])  # a follow-up that rewrites rows inside the sink block, and one after it
def test_a_kept_decoders_sink_is_loaded_again_only_where_the_follow_up_rewrote_it(tiny, first_len):
    chosen = selection(second_select_num=1000, preselect_block=False)
    c = tiny.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 400, "fp32"), chosen)

    def new_session():
        return LongContextSession(tiny.model, layout, chunk_size=32, backend="torch", hidden_on_device=True,
                                  compact=None, selection=chosen, local_windows_len=24, use_cuda_graph=False)

    rng = np.random.default_rng(first_len)
    first = [int(t) for t in rng.integers(0, 300, size=first_len)]
    kept, rebuilt = new_session(), new_session()
    for s in (kept, rebuilt):
        s.prefill(first)
        for t in (4, 5):
            s.step(t)
    follow = first + [4, 5] + [int(t) for t in rng.integers(0, 300, size=30)]
    decoder = kept.decoder
    rebuilt.decoder = None
    assert kept.prefill(follow).equal(rebuilt.prefill(follow)) and kept.decoder is decoder
    for t in range(12):
        assert kept.step(10 + t).equal(rebuilt.step(10 + t)), t
    assert kept.decoder.window.buf_k.equal(rebuilt.decoder.window.buf_k)


def test_a_conversation_handed_over_and_back_keeps_its_decoder_and_decodes_as_a_new_one_would(tiny):
    """The server's swaps (exchange): each conversation takes its decoder along while it is held
    outside the session, and its next follow-up goes on with it exactly as a session that never
    swapped and built its decoder anew after the follow-up."""
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.session.long_context import HeldConversation

    c = tiny.config
    chosen = selection(second_select_num=2, preselect_block=True, preselect_block_count=3, token_step=2,
                       anchor_type="MAX")
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 400, "fp32", anchor_type="MAX")

    def new_session():
        return LongContextSession(tiny.model, layout, chunk_size=32, backend="torch", hidden_on_device=True,
                                  compact=None, selection=chosen, local_windows_len=24, use_cuda_graph=False)

    rng = np.random.default_rng(8)
    docs = [[int(t) for t in rng.integers(0, 300, size=n)] for n in (150, 170)]
    swapping, alone = new_session(), [new_session(), new_session()]
    answers, decoders, held = [], [], None
    for i, doc in enumerate(docs):  # A, handed over for B in a second host cache
        if i:
            held = swapping.exchange(HeldConversation.empty(layout, HostKVCache(layout, pin=False)))
        answers.append(generate(swapping, doc, 5, Sampler(), frozenset(), NO_TEXT).token_ids)
        assert generate(alone[i], doc, 5, Sampler(), frozenset(), NO_TEXT).token_ids == answers[-1]
        decoders.append(swapping.decoder)
    for i in (0, 1):  # back to A (B handed over), then to B
        assert held.decoder is decoders[i] and swapping.parked.held() == [held]
        held = swapping.exchange(held)
        follow = docs[i] + answers[i][:-1] + [int(t) for t in rng.integers(0, 300, size=40)]
        alone[i].decoder = None  # built anew after the follow-up
        assert swapping.prefill(follow).equal(alone[i].prefill(follow))
        assert swapping.decoder is decoders[i] and swapping.last_prefill_tokens == 40
        for t in range(20):  # across a block boundary
            assert swapping.step(10 + t).equal(alone[i].step(10 + t)), (i, t)


def test_parked_decoders_keep_what_fits_beside_a_prefill_the_most_recent_first(tiny):
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.session.long_context import RESIDENT_MARGIN, HeldConversation

    session = every_block(tiny, 400)
    session.parked.decoder_bytes = 1000
    session.follow_up_headroom = session.prefill_headroom = 1 << 40
    hosts = [HostKVCache(session.layout, pin=False) for _ in range(3)]
    held = []
    for i, host in enumerate(hosts):  # three conversations with decoders handed over, oldest first
        session.prefill(list(range(i, 100 + i)))
        held.append(session.exchange(HeldConversation.empty(session.layout, host)))
    assert session.parked.held() == held and all(h.decoder is not None for h in held)
    session.prefill_headroom = RESIDENT_MARGIN + 2500  # a new prompt's prefill leaves room for two
    session.prefill(list(range(50)))
    assert held[0].decoder is None and session.parked.held() == held[1:]
    assert all(h.decoder is not None for h in held[1:])
    del held[1]  # the cache store forgot it: its decoder went with it
    assert session.parked.held() == [held[1]]


def test_the_decoder_stays_only_when_the_follow_up_fits_the_plans_headroom(tiny):
    from ktlong.kv.memory_plan import workspace_bytes

    session = every_block(tiny, 400)
    first = list(range(100))
    session.prefill(first)
    need = workspace_bytes(tiny.config, 20, session.layout, 4) + 20 * tiny.config.hidden_size * 4
    for headroom, stays in ((need - 1, False), (need, True)):
        session.follow_up_headroom = headroom
        decoder = session.decoder
        first = first + list(range(20))
        session.prefill(first)
        assert (session.decoder is decoder) == stays and session.last_prefill_tokens == 20


def test_a_follow_up_that_diverges_reuses_the_common_prefix(tiny):
    session = every_block(tiny, 400)
    first = list(range(100))
    session.prefill(first)
    edited = first[:70] + [3] * 45  # an edited conversation: the first 70 tokens still hold
    extended = session.prefill(edited)
    assert session.last_stats.num_tokens == 45
    assert rel(extended, every_block(tiny, 400).prefill(edited)) < 1e-4
    same = session.prefill(edited)  # asked again: only its last token is prefilled, for its logits
    assert session.last_stats.num_tokens == 1 and rel(same, extended) < 1e-5


def test_compact_follow_up_keeping_every_block_equals_a_re_prefill(tiny):
    from tests.settings import compact_settings

    keep_all = compact_settings(alpha=0.0)
    session = every_block(tiny, 400, compact=keep_all)
    first = list(np.random.default_rng(5).integers(0, 300, size=53))
    session.prefill(first)
    follow = first + list(np.random.default_rng(6).integers(0, 300, size=90))
    extended = session.prefill(follow)
    assert session.last_stats.num_tokens == 90
    assert rel(extended, every_block(tiny, 400, compact=keep_all).prefill(follow)) < 1e-4


def test_blocks_filled_during_decode_get_side_tables(tiny):
    session = session_for(tiny, 64, block_size=16)
    session.prefill(list(range(10)))
    for t in range(10):  # crosses into the second block: block 0 fills at position 15
        session.step(t)
    k = session.host.k[0][0, 0].numpy()  # layer 0, kv head 0, block 0: [16, D]
    np.testing.assert_array_equal(session.host.key_max[0][0, 0].numpy(), k.max(0))
    np.testing.assert_allclose(session.host.key_mean[0][0, 0].numpy(), k.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_local_chat_long_context_mode_answers(tmp_path, monkeypatch, capsys):
    import io

    import local_chat

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    assert local_chat.main(["--mode", "long_context", "--max_new_tokens", "24", "--set", "chunk_size=1024",
                            "--set", "kv_type=fp32"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "[plan for max_seq_len" in captured.err and "decode: top 32 blocks" in captured.err


def test_gemma3_sliding_layers_generate_like_dense_and_skip_offload(tmp_path):
    """Sliding layers: windowed prefill, only the device window's tail offloaded, decode on the
    device window only; global layers: the DRAM path. Everything kept -> equals dense."""

    lm = tiny_model(tmp_path, TinySpec(arch="gemma3", num_layers=6, num_kv_heads=1, tied=True, sliding_window=24),
                    seed=4)
    prompt = list(np.random.default_rng(5).integers(0, 298, size=150))
    c = lm.config
    layout = with_anchors(model_kv_layout(c, 16, 256, "fp32", local_windows_len=32), selection())
    session = LongContextSession(lm.model, layout, chunk_size=32, backend="torch", hidden_on_device=True,
                                 compact=None, selection=selection(second_select_num=1000, preselect_block=False),
                                 local_windows_len=32, use_cuda_graph=False)
    dense_session = DenseSession(lm.model, 256, 32)
    dense = generate(dense_session, prompt, 30, Sampler(), frozenset(), NO_TEXT)
    long = generate(session, prompt, 30, Sampler(), frozenset(), NO_TEXT)
    assert long.token_ids == dense.token_ids
    # DRAM: sliding layers hold a 4-block tail (32 local tokens / 16 + 2) and no side tables;
    # the global layer holds every block
    host = session.host
    assert layout.sliding == (True,) * 5 + (False,) and layout.sliding_blocks == 4
    assert [t.shape[1] for t in host.k] == [4] * 5 + [16]
    assert [t.shape[1] for t in host.key_max] == [0] * 5 + [16]
    assert host.first_block[0] == -(-150 // 16) - 4  # the tail ends with the prompt's last block
    # the tail holds the prompt's K exactly (the dense session's cache after the prompt)
    session.prefill(prompt)
    dense_session.prefill(prompt)
    start = host.first_token(0)
    expected = dense_session.cache.k[0][:, start:150].numpy()
    np.testing.assert_allclose(host.tokens(0, "k", start, 150).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_sliding_models_plan_says_its_follow_ups_prefill_again_and_they_do(tmp_path):
    """gemma3's sliding-window layers keep only the prompt's tail in DRAM: the plan says a
    follow-up prefills the whole conversation again, and a follow-up does (a llama's plan does
    not say so, and its follow-up prefills its new tokens only)."""
    from ktlong.config import default_config
    from ktlong.session.plan import plan_session

    config = default_config(local_windows_len=32, block_size=16, chunk_size=32, max_num_seqs=1)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 298, size=150)]
    for arch, sliding in (("gemma3", 24), ("llama", 0)):
        (tmp_path / arch).mkdir()
        lm = tiny_model(tmp_path / arch, TinySpec(arch=arch, num_layers=6, num_kv_heads=1, tied=True,
                                                  sliding_window=sliding), seed=4)
        plan = plan_session(config, lm.config, 0, 256, lm.model.device, lm.model.dtype)
        said = "the sliding-window layers keep only the prompt's last 64 tokens, so a follow-up prefills the whole"
        assert (said in plan.describe()) == bool(sliding)
        session = LongContextSession.from_plan(lm.model, plan)
        session.prefill(prompt)
        session.prefill(prompt + [7, 8, 9])
        assert session.last_prefill_tokens == (153 if sliding else 3)


def test_local_window_must_cover_the_sliding_window(tmp_path):
    from ktlong.errors import ConfigError

    lm = tiny_model(tmp_path, TinySpec(arch="gemma3", num_layers=6, num_kv_heads=1, tied=True, sliding_window=64))
    from ktlong.config import default_config
    from ktlong.session.plan import plan_session

    config = default_config(local_windows_len=32, block_size=16, chunk_size=32)
    with pytest.raises(ConfigError, match="at least 64"):
        plan_session(config, lm.config, 0, 256, lm.model.device, lm.model.dtype)


def test_config_options_reach_prefill_and_decode_settings(tmp_path, monkeypatch):
    from ktlong.config import load_config, parse_set
    from ktlong.session.settings import compact_params, selection_settings

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    config = load_config(overrides=parse_set(["prefill_attention=compact", "alpha=0.3", "second_select_num=7",
                                              "anchor_type=QUEST", "token_step=3", "head_select_mode=SEPARATE"]))
    p, s = compact_params(config), selection_settings(config, 12)
    assert (p.alpha, s.second_select_num, s.anchor_type, s.token_step, s.head_select_mode) == \
        (0.3, 7, "QUEST", 3, "SEPARATE")
    assert compact_params(config, "dense") is None
    assert selection_settings(config, 12, "dense").dense_layer_num == 12
    dense_prefill = load_config(overrides=parse_set(["prefill_attention=dense"]))
    assert compact_params(dense_prefill) is None  # local_chat follows the config
    assert compact_params(dense_prefill, "sparse") is not None  # the evaluation's sparse arm is compact


@pytest.mark.slow
def test_local_chat_builds_its_session_from_the_config(tmp_path, monkeypatch):
    import io

    import local_chat
    from ktlong.session.long_context import LongContextSession

    seen = {}
    original = LongContextSession.__init__

    def record(self, *args, **kwargs):
        seen.update(kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(LongContextSession, "__init__", record)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert local_chat.main(["--mode", "long_context", "--set", "second_select_num=5", "--set",
                            "local_windows_len=2048", "--set", "prefill_attention=compact"]) == 0
    selection, local, compact, graphs = (seen[k] for k in ("selection", "local_windows_len", "compact", "use_cuda_graph"))
    assert selection.second_select_num == 5 and local == 2048 and compact is not None and not graphs


@pytest.mark.parametrize("kind", ["long_context", "dense"])
def test_progress_into_a_log_is_lines_not_a_redrawn_bar(tiny, kind, capsys, monkeypatch):
    """With stderr a file or a pipe (as under pytest), a prefill's progress is whole lines that
    count up the prompt's tokens, with no carriage return (tqdm's redraws piled into one line)."""
    import re

    import ktlong.session.progress

    monkeypatch.setattr(ktlong.session.progress, "LINE_SECONDS", 0.0)  # a line every update
    session = every_block(tiny, 400) if kind == "long_context" else DenseSession(tiny.model, 400, 32)
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 300, size=150)]  # five chunks
    session.prefill(prompt, show_progress=True)
    err = capsys.readouterr().err
    counts = [int(n) for n in re.findall(r"^\[prefill: (\d+) of 150 tokens, [\d,]+ tok/s, about [\d,]+ s left\]$",
                                          err, re.MULTILINE)]
    assert "\r" not in err and len(counts) >= 3
    assert counts == sorted(counts) and 0 < counts[0] and counts[-1] < 150


@pytest.mark.parametrize("kind", ["long_context", "dense"])
def test_a_stopped_prefill_leaves_a_cache_the_next_prefill_can_trust(tiny, kind):
    """should_stop (a server client that went away) ends a prefill between chunks; the next
    prefill of the same prompt still gives a fresh session's logits."""
    from ktlong.errors import Cancelled

    make = (lambda: every_block(tiny, 400)) if kind == "long_context" else (lambda: DenseSession(tiny.model, 400, 32))
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 300, size=150)]  # five chunks
    session, asked = make(), []
    with pytest.raises(Cancelled):
        session.prefill(prompt, should_stop=lambda: asked.append(1) or len(asked) > 2)
    if kind == "long_context":  # layer-major: every chunk of a layer is half the answer; forgotten
        assert session.ids == [] and session.host.num_tokens == 0
    else:  # the chunks done are whole and kept
        assert session.ids == prompt[:64]
    again = session.prefill(prompt)
    assert session.last_prefill_tokens == (150 if kind == "long_context" else 150 - 64)
    assert rel(again, make().prefill(prompt)) < 1e-5
    gen = generate(session, prompt, 5, Sampler(), frozenset(), NO_TEXT, should_stop=lambda: True)
    assert gen.finish_reason == "cancelled" and gen.token_ids == []


def test_a_prefill_pauses_and_can_stop_inside_its_decoders_setup(tiny):
    """The decoder's setup after the last chunk (seconds over a 1M cache) asks should_stop too,
    between its parts and after each global layer's anchors, so a prefill beside decoding
    answers gives the host back there; a stop there forgets the cache as one between chunks does."""
    from ktlong.errors import Cancelled

    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 300, size=150)]
    session, in_setup = every_block(tiny, 400), []
    session.prefill(prompt, should_stop=lambda: in_setup.append(session.ids == prompt) or False)
    layers = len(session.decoder.global_layers)
    assert sum(in_setup) >= layers and in_setup[-1]  # after every layer's anchors, up to the setup's end
    session = every_block(tiny, 400)
    with pytest.raises(Cancelled):
        session.prefill(prompt, should_stop=lambda: session.ids == prompt)
    assert session.ids == [] and session.host.num_tokens == 0 and session.decoder is None
    again = session.prefill(prompt)
    assert session.last_prefill_tokens == 150 and rel(again, every_block(tiny, 400).prefill(prompt)) < 1e-5


@pytest.mark.parametrize("arm, sparse_prefill, sparse_decode", [
    ("dense", False, False), ("sparse", True, True), ("sparse-prefill", True, False), ("sparse-decode", False, True)])
def test_evaluation_arms_make_each_stage_sparse_or_dense(tiny, tmp_path, arm, sparse_prefill, sparse_decode):
    """The mixed arms tell which stage loses an answer: each makes one stage sparse."""
    import torch

    from ktlong.config import default_config
    from ktlong.session.plan import plan_session

    config = default_config(block_size=16, chunk_size=32, local_windows_len=32)
    plan = plan_session(config, tiny.config, tiny.weight_bytes, 256, torch.device("cpu"), torch.float32,
                        attention=arm)
    session = LongContextSession.from_plan(tiny.model, plan)
    assert session.engine.is_sparse == sparse_prefill
    assert (session.selection.second_select_num == config.second_select_num) == sparse_decode
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 300, size=200)]
    session.prefill(prompt)
    assert bool(session.last_stats.density_per_layer) == sparse_prefill


@pytest.mark.parametrize("cached,prompt,expected", [
    ([1, 2, 3], [1, 2, 3, 4, 5], 3),  # a follow-up: the whole cache
    ([1, 2, 3, 4], [1, 2, 9, 4, 5], 2),  # an edited conversation: up to the first difference
    ([1, 2, 3], [1, 2, 3], 2),  # asked again: the last token is computed anew for its logits
    ([1, 2, 3, 4], [1, 2], 1),  # shorter than the cache
    ([], [7, 8], 0), ([5], [6], 0), ([], [], 0)])
def test_the_cached_prefix_leaves_the_prompts_last_token_to_compute(cached, prompt, expected):
    from ktlong.session.prefix import cached_prefix

    assert cached_prefix(cached, prompt) == expected


def test_a_document_shorter_than_the_local_window_runs_from_the_config(tiny):
    """The default 4096-token window and a 128-token max_seq_len: the plan's window holds the
    whole document, and the answer is the dense session's."""
    import torch

    from ktlong.config import default_config
    from ktlong.session.plan import plan_session

    config = default_config(block_size=16, chunk_size=32, mode="long_context")
    plan = plan_session(config, tiny.config, tiny.weight_bytes, 128, torch.device("cpu"), torch.float32)
    assert plan.local_windows_len == 128 < config.local_windows_len
    session = LongContextSession.from_plan(tiny.model, plan)
    prompt = list(np.random.default_rng(3).integers(0, 300, size=45))
    dense = generate(DenseSession(tiny.model, 128, 32), prompt, 40, Sampler(), frozenset(), NO_TEXT)
    long = generate(session, prompt, 40, Sampler(), frozenset(), NO_TEXT)
    assert long.token_ids == dense.token_ids and len(long.token_ids) == 40


def _autos(value, where="plan") -> list[str]:
    """Where an 'auto' is left in a plan: its fields, and the fields of the settings it holds."""
    import dataclasses

    if isinstance(value, str):
        return [where] if value == "auto" else []
    if dataclasses.is_dataclass(value):
        return [a for f in dataclasses.fields(value) for a in _autos(getattr(value, f.name), f"{where}.{f.name}")]
    return []


@pytest.mark.parametrize("arm", [None, "dense", "sparse"])
def test_the_plan_resolves_every_auto_and_its_consumers_refuse_one(tiny, arm):
    """Every option is 'auto' here, and none is left in the plan; the prefill and the decoder,
    which take the plan's values, refuse an unresolved one rather than resolve it themselves."""
    import torch

    from ktlong.config import default_config
    from ktlong.decode.decoder import Decoder
    from ktlong.prefill import LayerMajorPrefill
    from ktlong.session.plan import plan_session

    config = default_config(block_size=16, chunk_size=32, kv_type="auto", context_attention="auto",
                            block_scoring="auto", use_cuda_graph="auto", attention_backend="auto", threads_num=0)
    plan = plan_session(config, tiny.config, tiny.weight_bytes, 256, torch.device("cpu"), torch.float32,
                        attention=arm)
    assert _autos(plan) == []
    assert (plan.kv_type, plan.attention_backend, plan.use_cuda_graph) == ("fp32", "torch", False)
    assert (plan.selection.block_scoring, plan.selection.context_attention) == ("cpu", "cpu")
    # on the CPU alone no thread drives a GPU beside the decode operator: every core it may use
    assert plan.threads == min(len(os.sched_getaffinity(0)), numba.config.NUMBA_NUM_THREADS)
    with pytest.raises(AssertionError, match="resolve_backend"):
        LayerMajorPrefill(tiny.model, plan.layout, 32, "auto", True)
    session = LongContextSession.from_plan(tiny.model, plan)
    session.prefill(list(range(100)))
    unresolved = dataclasses.replace(plan.selection, context_attention="auto")
    with pytest.raises(AssertionError, match="resolve_selection"):
        Decoder(tiny.model, session.host, unresolved, plan.local_windows_len)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):  # q8_0 rows: head_dim 32
    return tiny_model(tmp_path_factory.mktemp("m32"), TinySpec(num_layers=2, hidden=128, head_dim=32), seed=21)


@pytest.mark.parametrize("kv_type", ["fp32", "q8_0"])
def test_the_blocks_an_answer_fills_get_the_tables_and_device_anchors_a_prefill_gives_them(tiny32, kv_type):
    """Decoder._block_filled: the keys of a block the answer filled cross in one copy for every
    layer (q8_0: from the device window, which holds them unquantised; fp32: from DRAM), and its
    device anchors go back in one: each layer's tables are its keys' max, min and mean, and its
    QUEST anchors those rounded outwards to bf16."""
    chosen = selection(second_select_num=1000, preselect_block=False, anchor_type="QUEST", block_scoring="device")
    c = tiny32.config

    def make():
        layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 128, kv_type), chosen)
        return LongContextSession(tiny32.model, layout, chunk_size=32, backend="torch", hidden_on_device=True,
                                  compact=None, selection=chosen, local_windows_len=24, use_cuda_graph=False)

    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 300, size=37)]
    answering = make()
    gen = generate(answering, prompt, 30, Sampler(), frozenset(), NO_TEXT)
    tokens = prompt + gen.token_ids[:-1]  # the last sampled token was never fed
    assert answering.host.num_tokens == len(tokens) == 66  # blocks 2 and 3 filled while it answered
    d = answering.decoder
    assert d.device_anchors is not None and d.times.block_filled > 0
    start = d.window.window_start
    assert start <= 32  # the window holds both blocks' keys (in bf16 where DRAM holds q8_0)
    for layer in range(c.num_layers):
        keys = d.window.k[layer, :, 32 - start:64 - start].float().view(c.num_kv_heads, 2, 16, c.head_dim)
        h = d.host
        assert torch.allclose(h.key_max[layer][:, 2:4], keys.amax(2), rtol=1e-6, atol=1e-6)
        assert torch.allclose(h.key_min[layer][:, 2:4], keys.amin(2), rtol=1e-6, atol=1e-6)
        assert torch.allclose(h.key_mean[layer][:, 2:4], keys.mean(2), rtol=1e-5, atol=1e-5)
        # QUEST's device anchors: the minima rounded down to bf16, the maxima up, within one step
        anchors = d.device_anchors.anchors[layer][:, 2:4].float()
        low, high = anchors[:, :, 0], anchors[:, :, 1]
        step = 2 ** -7 * keys.abs().amax(2)
        assert (low <= keys.amin(2)).all() and (keys.amin(2) - low <= step).all()
        assert (high >= keys.amax(2)).all() and (high - keys.amax(2) <= step).all()


def test_the_blocks_an_answer_fills_get_the_dynamic_anchors_of_their_longest_keys(tiny32):
    """Decoder._block_filled with DYNAMIC anchors (every layer's blocks summarised at once): a
    generated block's anchors are its anchor_num keys of the largest norm (within float32's
    rounding of the norms: near ties may go either way), per layer and kv head, from the DRAM
    cache's own keys (fp32), and its tables their max, min and mean."""
    chosen = selection(second_select_num=1000, preselect_block=False, anchor_type="DYNAMIC", anchor_num=2,
                       block_scoring="cpu")
    c = tiny32.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 128, "fp32"), chosen)
    session = LongContextSession(tiny32.model, layout, chunk_size=32, backend="torch", hidden_on_device=True,
                                 compact=None, selection=chosen, local_windows_len=24, use_cuda_graph=False)
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 300, size=37)]
    generate(session, prompt, 30, Sampler(), frozenset(), NO_TEXT)
    h = session.decoder.host
    assert h.num_tokens == 66 and session.decoder.times.block_filled > 0  # blocks 2 and 3 filled while it answered
    for layer in range(c.num_layers):
        keys = h.k[layer][:, 2:4].double().numpy()  # [KV, 2 blocks, 16, D]
        norms = np.linalg.norm(keys, axis=-1)
        second = np.sort(norms, axis=-1)[..., -2]  # the second largest norm of each block
        anchors = h.anchor_keys[layer][:, 2:4].double().numpy()  # [KV, 2 blocks, 2, D]
        for kv, b in np.ndindex(*keys.shape[:2]):
            picked = [next(i for i in range(16) if np.array_equal(keys[kv, b, i], a)) for a in anchors[kv, b]]
            assert len(set(picked)) == 2, (layer, kv, b)  # two of the block's keys, as stored
            assert (norms[kv, b, picked] >= second[kv, b] * (1 - 1e-6)).all(), (layer, kv, b)
        np.testing.assert_array_equal(h.key_max[layer][:, 2:4].numpy(), keys.max(2))
        np.testing.assert_array_equal(h.key_min[layer][:, 2:4].numpy(), keys.min(2))
        np.testing.assert_allclose(h.key_mean[layer][:, 2:4].numpy(), keys.mean(2), rtol=1e-6, atol=1e-6)
