"""Block scores computed with torch from a device copy of the anchors (`block_scoring: device`)
equal the CPU kernel's, and decode selects the same blocks either way."""


import numpy as np
import pytest
import torch

from cpu_ops.anchors import stored_anchors
from tests.anchors_reference import build_anchors_reference
from cpu_ops.bf16 import from_bf16, to_bf16
from cpu_ops.block_select import QUEST, block_scores
from tests.settings import selection, with_anchors
from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import LongContextSession
from operators.block_scores import device_block_scores
from tests.tiny_gguf import TinySpec, tiny_model

KV, H, D, B, NB = 2, 8, 32, 16, 40


def reference_scores(q, anchors, quest):
    """float64, straight from the definitions in cpu_ops/anchors.py -> [KV, NB]."""
    group = H // KV
    out = np.zeros((KV, anchors.shape[1]))
    for h in range(KV):
        for b in range(anchors.shape[1]):
            for g in range(group):
                qh = q[h * group + g].astype(np.float64)
                a = anchors[h, b].astype(np.float64)
                out[h, b] += np.maximum(qh * a[0], qh * a[1]).sum() if quest else (a @ qh).max()
    return out


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("anchor_type, anchor_num", [("MAX", 1), ("MEAN", 1), ("QUEST", 1), ("FIX", 3),
                                                     ("DYNAMIC", 2), ("DYNAMIC", 1)])
def test_device_scores_equal_the_definition_and_the_cpu_kernel(anchor_type, anchor_num, shared):
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((KV, NB, B, D)).astype(np.float32)
    q = rng.standard_normal((H, D)).astype(np.float32)
    stored = stored_anchors(build_anchors_reference(keys, NB * B, anchor_type, anchor_num, rng.random((KV, NB, B))),
                            anchor_type)
    quest = anchor_type == "QUEST"
    words = torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16)
    got = device_block_scores(torch.from_numpy(q).bfloat16().float(), words, quest, shared).numpy()
    qb = torch.from_numpy(q).bfloat16().float().numpy()  # decode's q is the model's bf16 q
    expected = reference_scores(qb, from_bf16(stored), quest)
    expected = expected.sum(0, keepdims=True) if shared else expected
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    cpu = block_scores(qb, stored, np.arange(NB, dtype=np.int32), QUEST if quest else 0, shared)
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=3), seed=17)


def selections(lm, scoring, graphs, **kw):
    """Blocks selected per (step, layer) and the logits of 60 steps after a 200-token prompt."""
    c = lm.config
    settings = selection(dense_layer_num=0, second_select_num=3, block_scoring=scoring, **kw)
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, B, 512, "fp32"), settings)
    s = LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True, compact=None,
                           selection=settings, local_windows_len=32,
                           use_cuda_graph=graphs)  # on the CPU, graph segments run eagerly
    s.prefill([int(t) for t in np.random.default_rng(2).integers(0, 298, size=200)])
    picked, logits = [], []
    original = s.decoder.selector.select

    def record(layer, step, q, first, last, device_scores=None):
        blocks, counts = original(layer, step, q, first, last, device_scores)
        picked.append([sorted(blocks[h, :counts[h]]) for h in range(len(counts))])
        return blocks, counts

    s.decoder.selector.select = record
    token = 3
    for _ in range(60):  # 3+ blocks fill while generating; the device copy must follow
        logits.append(s.step(token))
        token = int(logits[-1].argmax())
    return s.decoder, picked, torch.stack(logits)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode, preselect", [("SHARED", False), ("SEPARATE", True)])
def test_decode_selects_the_same_blocks_with_device_scores(tiny, graphs, mode, preselect, monkeypatch):
    kw = dict(head_select_mode=mode, preselect_block=preselect, preselect_block_count=5, anchor_type="QUEST")
    with monkeypatch.context() as m:  # the CPU kernel must not be asked
        m.setattr("ktlong.decode.selection.block_scores", None)
        device, picked, logits = selections(tiny, "device", graphs, **kw)
    cpu, cpu_picked, cpu_logits = selections(tiny, "cpu", graphs, **kw)
    assert device.device_anchors is not None and cpu.device_anchors is None
    assert len(picked) == 60 * len(device.global_layers) and picked == cpu_picked
    torch.testing.assert_close(logits, cpu_logits, rtol=1e-5, atol=1e-5)
    # the device rounded the side tables' anchors as the host rounds them (QUEST: min down, max
    # up), and followed them as blocks filled; the host keeps none of its own
    held = -(-device.host.num_tokens // B)
    for layer in device.global_layers:
        words = device.device_anchors.anchors[layer].view(torch.int16).numpy().view(np.uint16)
        low, high = device.host.key_min[layer][:, :held].numpy(), device.host.key_max[layer][:, :held].numpy()
        np.testing.assert_array_equal(words[:, :held, 0], to_bf16(low, "down"))
        np.testing.assert_array_equal(words[:, :held, 1], to_bf16(high, "up"))
        assert not words[:, held:].any() and device.selector.anchors[layer].size == 0
    assert device.host.num_tokens // B > 200 // B + 2


@pytest.mark.parametrize("scoring, on_device", [("auto", False), ("cpu", False), ("device", True)])
def test_where_blocks_are_scored_without_a_gpu(tiny, monkeypatch, scoring, on_device):
    """auto scores with the Numba kernel on a CPU-only machine (on a GPU it keeps a device copy:
    tests/test_gpu_decode_graph.py); device scores with torch wherever the model is."""
    import ktlong.decode.selection as selection_module

    calls = []
    kernel = selection_module.block_scores
    monkeypatch.setattr(selection_module, "block_scores", lambda *a: calls.append(1) or kernel(*a))
    decoder, picked, _ = selections(tiny, scoring, False)
    assert picked and (decoder.device_anchors is not None) == on_device
    assert (len(calls) == 0) == on_device


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_the_device_rounds_anchors_to_bfloat16_as_the_host_does(rounding):
    """Ties (half way between two bfloat16 values, to even), exact values, both signs, tiny and
    large magnitudes: the torch rounding gives the host's words (cpu_ops/bf16.to_bf16)."""
    from ktlong.decode.device_anchors import rounded_bf16

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(np.float32)
    bits = x.view(np.uint32)
    ties = ((bits[:512] & 0xFFFF0000) | 0x8000).view(np.float32)  # exactly half way
    exact = (bits[512:1024] & 0xFFFF0000).view(np.float32)
    values = np.concatenate([ties, exact, x[1024:], -ties, [0.0, -0.0]]).astype(np.float32)
    words = rounded_bf16(torch.from_numpy(values), rounding).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(words, to_bf16(values, rounding))
