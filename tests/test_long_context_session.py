"""Long-context mode (layer-major prefill, DRAM cache, decode over it) generates what dense does."""

import numpy as np
import pytest

from ktlong.session.dense import DenseSession
from ktlong.chat.generate import generate
from ktlong.kv.layout import kv_layout, model_kv_layout
from ktlong.session.long_context import LongContextSession
from ktlong.chat.sampling import Sampler
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model


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
    dense = generate(DenseSession(tiny.model, 128, 32), prompt, 40, Sampler(), frozenset(), lambda i: "")
    long = generate(session_for(tiny, 128), prompt, 40, Sampler(), frozenset(), lambda i: "")
    assert long.token_ids == dense.token_ids and len(long.token_ids) == 40


def test_follow_up_turn_extends_the_cache(tiny):
    session = session_for(tiny, 128)
    first = list(range(20))
    session.prefill(first)
    follow = first + [7, 8, 9]
    stepped = session.prefill(follow)
    fresh = session_for(tiny, 128).prefill(follow)
    assert float((stepped - fresh).abs().max() / fresh.abs().max()) < 1e-5
    assert session.host.num_tokens == len(follow)


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
    assert "Paris" in captured.out and "memory plan" in captured.err


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
    dense = generate(dense_session, prompt, 30, Sampler(), frozenset(), lambda i: "")
    long = generate(session, prompt, 30, Sampler(), frozenset(), lambda i: "")
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
