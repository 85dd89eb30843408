"""On the GPU: a gemma3 model's sliding-window layers run through FlashInfer with window_left
in prefill and on the device window in decode, and the whole long-context path follows the
float32 dense reference within bf16 noise."""

import numpy as np
import pytest
import torch

from tests.settings import flashprefill_settings, selection, with_anchors
from ktlong.session.dense import DenseSession
from ktlong.kv.layout import model_kv_layout
from ktlong.models.loader import load_model
from ktlong.session.long_context import LongContextSession
from operators.chunk_attention import chunk_attention, flashinfer_available
from operators.compact_attention import CompactParams
from tests.tiny_gguf import TinySpec, write_tiny_gguf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not flashinfer_available(), reason="needs FlashInfer")]

# Gemma-3-270M's attention shapes: 4 query heads on 1 kv head of dim 256
SPEC = TinySpec(arch="gemma3", num_layers=6, hidden=256, intermediate=256, num_heads=4, num_kv_heads=1,
                head_dim=256, vocab=300, context=2048, tied=True, sliding_window=96)


def test_flashinfer_window_left_equals_the_torch_window():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(200, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 500, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = chunk_attention(q.float(), k.float(), v.float(), 0.1, "torch", 96)
    out = chunk_attention(q, k, v, 0.1, "fa2", 96)
    assert float((out.float() - ref).abs().max()) < 2e-2


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("start,chunk", [(0, 8192), (4096, 1000)])
def test_paged_execution_at_gemma_shapes_equals_dense(backend, start, chunk):
    """Every page kept: FlashInfer's paged path equals dense attention at head_dim 256, one chunk
    of a long prompt and a chunk with history."""
    from operators.compact_attention import CompactAttention
    from operators.dense_attention import dense_attention

    if backend == "fa3" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fa3 needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(3)
    blocks = -(-(start + chunk) // 128)
    k, v = (torch.randn(1, blocks, 128, 256, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(chunk, 4, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    op = CompactAttention(CompactParams.keep_all(), 4, 1, 128, 256 ** -0.5, backend, torch.device("cuda"))
    pooled = torch.zeros(1, blocks, 256, device="cuda")
    out, _ = op(q, k, v, pooled, start, start + chunk)
    keys, values = k.view(1, -1, 256)[:, :start + chunk], v.view(1, -1, 256)[:, :start + chunk]
    ref = dense_attention(q.float(), keys.float(), values.float(), 256 ** -0.5)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("prefill_attention, context_attention", [("dense", "cpu"), ("compact", "cpu"),
                                                                     ("dense", "gpu")])
def test_gemma3_long_context_on_gpu_follows_dense(tmp_path, prefill_attention, context_attention):
    path = tmp_path / "g.gguf"
    write_tiny_gguf(path, SPEC, seed=7)
    gpu = load_model(str(path), "cuda", torch.bfloat16)
    cpu = load_model(str(path), "cpu", torch.float32)
    ids = [int(t) for t in np.random.default_rng(8).integers(0, 300, size=700)]
    chosen = selection("cuda", second_select_num=1000, preselect_block=False, context_attention=context_attention)
    layout = with_anchors(model_kv_layout(gpu.config, 64, 800, "bf16", local_windows_len=128), chosen)
    compact = flashprefill_settings(alpha=0.0) if prefill_attention == "compact" else None  # alpha 0 keeps every block
    session = LongContextSession(gpu.model, layout, chunk_size=128, backend="fa2", hidden_on_device=True,
                                 compact=compact, selection=chosen,
                                 local_windows_len=128, use_cuda_graph=False)
    dense = DenseSession(cpu.model, 800, 128)
    a, b = session.prefill(ids), dense.prefill(ids)
    assert [t.shape[1] for t in session.host.k] == [4] * 5 + [13]  # sliding layers: DRAM tail only
    agree = 0
    for _ in range(20):
        rel = float((a.float().cpu() - b).norm() / b.norm())
        assert rel < 5e-2, rel
        agree += int(a.argmax().item() == b.argmax().item())
        token = int(b.argmax())
        a, b = session.step(token), dense.step(token)
    assert agree >= 18
    assert (session.decoder.times.cpu_attention > 0) == (context_attention == "cpu")


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_dram_copies_wait_for_the_compute_stream(tmp_path, arch, monkeypatch):
    """Every layer's K/V in DRAM equals the dense cache after a GPU prefill even when the compute
    stream runs far behind the host (a sleep kernel before each layer's q/k/v): the copies to DRAM
    are on their own stream and must wait for the values they copy. They once waited on the copy
    stream itself, so Gemma-3-270M's sliding layers 2-4 held other layers' keys."""
    spec = SPEC if arch == "gemma3" else TinySpec(num_layers=4, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                                  context=2048)
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=5)
    lm = load_model(str(tmp_path / "m.gguf"), "cuda", torch.bfloat16)
    model = lm.model
    qkv = model.qkv

    def slow_qkv(*args, **kwargs):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time queued ahead of this layer's work
        return qkv(*args, **kwargs)

    ids = list(np.random.default_rng(0).integers(0, 300, 700))
    dense = DenseSession(model, 800, 2048)
    dense.prefill(ids)
    layout = with_anchors(model_kv_layout(model.config, 64, 800, "bf16", 256), selection("cuda"))
    session = LongContextSession(model, layout, chunk_size=256, backend="fa2", hidden_on_device=True, compact=None,
                                 selection=selection("cuda"), local_windows_len=256, use_cuda_graph=False)
    monkeypatch.setattr(model, "qkv", slow_qkv)
    session.prefill(ids)
    host = session.host
    for layer in range(model.config.num_layers):
        start = host.first_token(layer)
        for which, cache in (("k", dense.cache.k), ("v", dense.cache.v)):
            got = host.tokens(layer, which, start, len(ids)).float()
            ref = cache[layer, :, start:len(ids)].float().cpu()
            assert float((got - ref).norm() / ref.norm()) < 0.1, (layer, which)  # garbage is >= 1
