"""kv_type q8_0 / q4_0 end to end in long-context mode on the CPU: prefill stores GGML blocks
within the format's error of the dense forward's K/V, the side tables come from the unquantised
keys, tokens written during decode are quantised the same way, and generation follows the
dense model within the quantisation's error."""

import numpy as np
import pytest
import torch

from ktlong.config import default_config
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.session.dense import DenseSession
from ktlong.session.long_context import LongContextSession
from ktlong.session.plan import plan_session
from operators.dense_attention import dense_attention
from operators.kv_quant import dequantize_kv
from tests.tiny_gguf import TinySpec, tiny_model

ERROR = {"q8_0": 1 / 254 + 2 ** -10, "q4_0": 1 / 8 + 2 ** -10}  # of each block's largest magnitude


def session(lm, kv_type, max_seq_len=512, **options):
    config = default_config(kv_type=kv_type, block_size=16, chunk_size=64, local_windows_len=48,
                            second_select_num=1000, preselect_block=False, **options)
    plan = plan_session(config, lm.config, 0, max_seq_len, lm.model.device, lm.model.dtype)
    assert plan.layout.kv_type == kv_type and plan.layout.dtype == torch.float32  # pages stay unquantised
    return LongContextSession(lm.model, plan.layout, chunk_size=64, backend="torch", hidden_on_device=True,
                              compact=None, selection=plan.selection, local_windows_len=48, use_cuda_graph=False)


def float32_bound(config, num_positions, logits):
    """How far two float32 computations of the same logits from the same stored K/V may differ
    when they sum in different orders (Numba's fastmath operator against torch's attention):
    Higham's bound for an n-term sum, gamma_n = n u / (1 - n u), with n the longest sum (the
    attended positions or the hidden width), once per layer on each side, relative to the
    logits' magnitude. It holds for any order of summation, so on any CPU."""
    n, u = max(num_positions, config.hidden_size), 2.0 ** -24
    return 2 * config.num_layers * n * u / (1 - n * u) * float(logits.abs().max())


def dense_kv(lm, ids):
    c = lm.config
    cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), lm.model.device, torch.float32)
    lm.model.forward(torch.tensor(ids), cache, 0)
    return cache


def assert_within_format_error(stored_keys, exact, kv_type):
    """stored_keys, exact: [KV, T, D]"""
    blocks = exact.reshape(*exact.shape[:-1], -1, 32)
    bound = blocks.abs().amax(-1, keepdim=True) * ERROR[kv_type] * 1.01 + 1e-6
    assert ((stored_keys - exact).reshape(blocks.shape).abs() <= bound).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = TinySpec(num_layers=3, hidden=128, head_dim=32, num_heads=4, num_kv_heads=2)
    return tiny_model(tmp_path_factory.mktemp("m"), spec, seed=21)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_prefill_stores_quantised_kv_and_side_tables_of_the_exact_keys(tiny, kv_type):
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 300, size=150)]
    s = session(tiny, kv_type)
    s.prefill(ids)
    cache, host = dense_kv(tiny, ids), s.host
    assert host.k[0].dtype == (torch.int8 if kv_type == "q8_0" else torch.uint8)
    for layer in range(tiny.config.num_layers):
        for which, exact in (("k", cache.k[layer, :, :150]), ("v", cache.v[layer, :, :150])):
            stored = host.unquantized(layer, which, 0, 150, torch.float32)
            assert_within_format_error(stored, exact, kv_type)
        # side tables summarise the unquantised keys: far closer than the quantisation error
        keys = cache.k[layer, :, :144].reshape(2, 9, 16, 32)
        torch.testing.assert_close(host.key_max[layer][:, :9], keys.amax(2), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(host.key_mean[layer][:, :9], keys.mean(2), rtol=1e-4, atol=1e-5)


def reference_step(lm, cache, host, token, pos, exact_from):
    """Plain dense decode of one token over K/V as the session's cache holds them: positions
    before exact_from are read back from DRAM as stored, later ones are still exact on the
    device. cache: per layer [k, v] lists of exact [KV, D] rows, extended here."""
    model = lm.model
    x = model.embed(torch.tensor([token]))
    for layer in range(lm.config.num_layers):
        q, k, v = model.qkv(layer, x, torch.tensor([pos]))
        cache[layer][0].append(k[0])
        cache[layer][1].append(v[0])
        keys, values = (torch.cat([host.unquantized(layer, which, 0, exact_from, torch.float32),
                                   torch.stack(rows[exact_from:], 1)], 1)
                        for which, rows in zip("kv", cache[layer]))  # [KV, pos + 1, D]
        x = model.residual_block(layer, x, dense_attention(q, keys, values, model.scale))
    return model.logits(x)[0]


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_decode_equals_dense_attention_over_the_cache_as_stored(tiny, kv_type):
    """The CPU reads quantised blocks, the device window holds the prompt's tail as loaded from
    DRAM and the generated tokens exactly, and tokens that slide out are read back quantised."""
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 300, size=120)]
    s = session(tiny, kv_type)
    b = s.prefill(ids)
    exact = dense_kv(tiny, ids)
    cache = [[list(exact.k[layer, :, :120].unbind(1)), list(exact.v[layer, :, :120].unbind(1))]
             for layer in range(tiny.config.num_layers)]
    token = int(b.argmax())
    for pos in range(120, 190):  # the 48-token window slides; blocks fill and join selection
        exact_from = max(len(ids), s.decoder.window.window_start)
        a, b = reference_step(tiny, cache, s.host, token, pos, exact_from), s.step(token)
        torch.testing.assert_close(b, a, rtol=0, atol=float32_bound(tiny.config, pos + 1, a))
        token = int(a.argmax())
    for layer in range(tiny.config.num_layers):  # decode's write-through quantised the same way
        generated = torch.stack(cache[layer][0][120:189], 1)
        assert_within_format_error(s.host.unquantized(layer, "k", 120, 189, torch.float32), generated, kv_type)
        # a block filled while generating is summarised from its unquantised keys
        torch.testing.assert_close(s.host.key_max[layer][:, 8], generated[:, 8:24].amax(1), rtol=1e-4, atol=1e-5)


def test_gemma3_sliding_layers_keep_a_quantised_tail(tmp_path):
    spec = TinySpec(arch="gemma3", num_layers=6, hidden=64, num_heads=2, num_kv_heads=1, head_dim=32, tied=True,
                    sliding_window=24)
    lm = tiny_model(tmp_path, spec, seed=5)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 298, size=100)]
    s, dense = session(lm, "q8_0"), DenseSession(lm.model, 512, 64)
    a, b = dense.prefill(ids), s.prefill(ids)
    for _ in range(30):
        assert float((b - a).norm() / a.norm()) < 0.02
        token = int(a.argmax())
        a, b = dense.step(token), s.step(token)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_the_plan_counts_the_bytes_the_quantised_cache_allocates(kv_type):
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.layout import kv_layout
    from ktlong.kv.memory_plan import plan_memory
    from ktlong.models.random_model import random_config

    c = random_config("llama-3.1-8b")
    layout = kv_layout(4, 2, 128, 16, 1000, kv_type)
    plan = plan_memory(c, 0, 2, layout, 64, 1 << 40, True, local_windows_len=64)
    host = HostKVCache(layout, pin=False)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    assert nbytes(host.k + host.v + host.k_scales + host.v_scales) == plan.dram_kv
    # GGML's sizes: 34 bytes per 32 values (q8_0), 18 (q4_0)
    assert plan.dram_kv == 2 * 4 * 2 * layout.capacity * 128 // 32 * (34 if kv_type == "q8_0" else 18)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_history_crossing_in_staged_pieces_widens_to_the_rows_as_stored(monkeypatch, kv_type):
    """A follow-up's quantised history crosses to the device STAGED_TOKENS at a time into one
    staging buffer reused piece after piece (on a GPU): every piece, the partial last one too,
    widens to what the rows in DRAM widen to at once."""
    from ktlong.bench.decode import fill_random
    from ktlong.kv import history_load
    from ktlong.kv.device_pages import DevicePages
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.layout import kv_layout

    layout = kv_layout(2, 2, 64, 16, 256, kv_type, page_type="fp32")
    host = HostKVCache(layout, pin=False)
    fill_random(host, 256, seed=3)
    history, layer = 150, 1
    monkeypatch.setattr(history_load, "STAGED_TOKENS", 48)  # three whole pieces and a partial one
    staging = history_load.Staging(layout, history, torch.device("cpu"))
    assert staging.data.shape[1] == 48
    pages, pooled = DevicePages(layout, torch.device("cpu")), torch.zeros(2, layout.num_blocks, 64)
    moved = history_load.load_history(layout, host, layer, history, pages, pooled, staging)
    assert moved == 2 * history * 2 * layout.stored_row_bytes
    for which, buf in (("k", pages.k), ("v", pages.v)):
        rows = dequantize_kv(host.tokens(layer, which, 0, history).contiguous(),
                             host.scale_tokens(layer, which, 0, history).contiguous(), kv_type, torch.float32)
        assert torch.equal(pages.tokens(buf)[:, :history], rows)
        assert not pages.tokens(buf)[:, history:].any()
    assert torch.equal(pooled[:, :10], host.key_mean[layer][:, :10]) and not pooled[:, 10:].any()
