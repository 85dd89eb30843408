"""On the GPU: FlashInfer's merge_state equals the torch merge, and hybrid decode with every
block selected follows dense decode within bf16 noise."""

import pytest
import torch

from ktlong.session.dense import DenseSession
from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import LongContextSession
from tests.settings import gpu_backend, selection, with_anchors
from ktlong.models.random_model import random_model
from operators.chunk_attention import flashinfer_available
from operators.merge_state import merge_states, merge_states_flashinfer

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not flashinfer_available(), reason="needs FlashInfer")
def test_flashinfer_merge_state_equals_torch_merge():
    g = torch.Generator(device="cuda").manual_seed(0)
    o_a, o_b = (torch.randn(32, 128, generator=g, device="cuda") for _ in range(2))
    lse_a, lse_b = (torch.randn(32, generator=g, device="cuda") * 3 for _ in range(2))
    lse_b[:4] = float("-inf")  # an empty part
    ref_o, ref_lse = merge_states(o_a, lse_a, o_b, lse_b)
    o, lse = merge_states_flashinfer(o_a, lse_a, o_b, lse_b)
    assert torch.allclose(o, ref_o, atol=2e-2, rtol=2e-2) and torch.allclose(lse, ref_lse, atol=1e-3)


@pytest.mark.parametrize("context_attention", ["cpu", "gpu"])
def test_hybrid_decode_on_gpu_follows_dense_decode(context_attention):
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    c = model.config
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(2)).tolist()
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 800, "bf16"), selection("cuda"))
    hybrid = LongContextSession(model, layout, chunk_size=256, backend=gpu_backend(model), hidden_on_device=True, compact=None,
                                selection=selection("cuda", second_select_num=1000, preselect_block=False,
                                                    context_attention=context_attention),
                                local_windows_len=128, use_cuda_graph=False)
    dense = DenseSession(model, 800, 256)
    a, b = hybrid.prefill(ids), dense.prefill(ids)
    agree = 0
    for _ in range(20):
        rel = float((a - b).norm() / b.norm())
        assert rel < 5e-2, rel
        agree += int(a.argmax() == b.argmax())
        token = int(b.argmax())
        a, b = hybrid.step(token), dense.step(token)
    assert agree >= 18
    if context_attention == "cpu":
        assert hybrid.decoder.times.cpu_attention > 0
    else:  # every context block read by the GPU, selected on the device
        assert hybrid.decoder.selection is not None and hybrid.decoder.times.kv_bytes == 0


@pytest.mark.parametrize("kv_type,compact", [("bf16", False), ("q8_0", False), ("bf16", True)])
def test_follow_up_on_gpu_follows_a_re_prefill(kv_type, compact):
    """A follow-up prefilled over the cache (history widened on the device, FlashInfer over it,
    CUDA graphs rebuilt after) gives the logits a re-prefill of the conversation gives."""
    from tests.settings import flashprefill_settings

    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    c = model.config
    chosen = selection("cuda", second_select_num=1000, preselect_block=False)
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1600, kv_type), chosen)

    def session():
        return LongContextSession(model, layout, chunk_size=256, backend=gpu_backend(model), hidden_on_device=True,
                                  compact=flashprefill_settings(alpha=0.0) if compact else None, selection=chosen,
                                  local_windows_len=128, use_cuda_graph=True)

    g = torch.Generator().manual_seed(3)
    doc = torch.randint(0, 1000, (700,), generator=g).tolist()
    question = torch.randint(0, 1000, (300,), generator=g).tolist()
    s = session()
    s.prefill(doc)
    for t in (1, 2, 3):
        s.step(t)
    follow = doc + [1, 2, 3] + question
    extended = s.prefill(follow)
    assert s.last_stats.num_tokens == 300
    fresh = session().prefill(follow)
    rel = float((extended - fresh).norm() / fresh.norm())
    assert rel < (5e-2 if kv_type == "bf16" else 1e-1), rel  # q8_0: the history is read back rounded


@pytest.mark.parametrize("context_attention", ["cpu", "gpu"])
def test_graphs_kept_across_a_follow_up_decode_as_graphs_captured_after_it(context_attention):
    """The decoder, its device anchors and its CUDA graphs stay across a follow-up (sparse
    selection, device scoring; with gpu, selected on the device) and decode as a decoder built and
    captured after it."""
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    c = model.config
    chosen = selection("cuda", second_select_num=2, preselect_block=False, anchor_type="MAX", block_scoring="device",
                       context_attention=context_attention)
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1600, "bf16", anchor_type="MAX")

    def session():
        return LongContextSession(model, layout, chunk_size=256, backend=gpu_backend(model), hidden_on_device=True, compact=None,
                                  selection=chosen, local_windows_len=128, use_cuda_graph=True)

    g = torch.Generator().manual_seed(4)
    doc = torch.randint(0, 1000, (700,), generator=g).tolist()
    question = torch.randint(0, 1000, (300,), generator=g).tolist()
    kept, rebuilt = session(), session()
    for s in (kept, rebuilt):
        s.prefill(doc)
        for t in (1, 2, 3):
            s.step(t)
    graphs = kept.decoder.body.graphs
    rebuilt.decoder = None  # built and captured anew after the follow-up
    follow = doc + [1, 2, 3] + question
    assert torch.equal(kept.prefill(follow), rebuilt.prefill(follow))
    assert kept.decoder.body.graphs is graphs and graphs
    for t in range(80):  # past a block boundary and a window slide
        a, b = kept.step(10 + t), rebuilt.step(10 + t)
        assert torch.equal(a, b), t


@pytest.mark.parametrize("kv_type,room_at_prefill", [("bf16", True), ("q8_0", True), ("q8_0", False)])
def test_follow_ups_over_resident_history_on_gpu_equal_follow_ups_over_dram(kv_type, room_at_prefill):
    """On the GPU, with prefetching and CUDA graphs: a session that keeps every layer's history
    on the device gives, follow-up after follow-up (a decoded answer between them), exactly the
    logits of one that moves every layer from DRAM, while fewer bytes cross."""
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    c = model.config
    chosen = selection("cuda", second_select_num=1000, preselect_block=False)
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1600, kv_type), chosen)

    def session(resident):
        return LongContextSession(model, layout, chunk_size=256, backend=gpu_backend(model), hidden_on_device=True,
                                  compact=None, selection=chosen, local_windows_len=128, use_cuda_graph=True,
                                  follow_up_headroom=8 << 30, prefill_headroom=(8 << 30) if room_at_prefill else None,
                                  resident_history=resident)

    g = torch.Generator().manual_seed(4)
    doc, q1, q2 = (torch.randint(0, 1000, (n,), generator=g).tolist() for n in (700, 40, 70))
    a, b = session(True), session(False)
    conversation = doc + q1
    for s in (a, b):
        s.prefill(doc)
    assert torch.equal(a.prefill(conversation), b.prefill(conversation))
    assert a.resident.layers == list(range(c.num_layers)) and a.last_follow_up == (True, True)
    for t in (5, 6, 7):
        assert torch.equal(a.step(t), b.step(t))
        conversation.append(t)
    assert torch.equal(a.prefill(conversation + q2), b.prefill(conversation + q2))
    assert a.last_stats.bytes_to_device < b.last_stats.bytes_to_device
