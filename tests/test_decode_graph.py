"""The decode body (device segments, CPU part between them) equals the dense forward through
window slides and the sink's filling. On the CPU the segments run eagerly;
tests/test_gpu_decode_graph.py replays them from captured graphs."""

import numpy as np
import pytest
import torch

from ktlong.session.dense import DenseSession
from tests.settings import selection, with_anchors
from ktlong.kv.layout import model_kv_layout
from ktlong.session.long_context import LongContextSession
from operators.window_attention import attention_with_lse, masked_window_attention
from tests.tiny_gguf import TinySpec, tiny_model


def test_masked_window_attention_equals_attention_over_the_valid_range():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 16, generator=g), torch.randn(2, 50, 16, generator=g), torch.randn(2, 50, 16, generator=g)
    out, lse = masked_window_attention(q, k, v, torch.tensor(7), torch.tensor(31), 0.25)
    ref_out, ref_lse = attention_with_lse(q, k[:, 7:31], v[:, 7:31], 0.25)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)


def sessions(lm, use_graph, **settings):
    chosen = selection(preselect_block=False, dense_layer_num=0, **settings)
    layout = with_anchors(model_kv_layout(lm.config, 16, 512, "fp32", local_windows_len=48), chosen)
    return LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True, compact=None,
                              selection=chosen, local_windows_len=48,
                              use_cuda_graph=use_graph)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_body_equals_dense_through_window_slides(tmp_path, arch):
    spec = TinySpec(arch=arch, num_layers=6 if arch == "gemma3" else 3, num_kv_heads=1 if arch == "gemma3" else 2,
                    tied=True, sliding_window=24 if arch == "gemma3" else 0)
    lm = tiny_model(tmp_path, spec, seed=9)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 298, size=120)]
    hybrid, dense = sessions(lm, False, second_select_num=1000), DenseSession(lm.model, 512, 64)  # every block
    a, b = dense.prefill(prompt), hybrid.prefill(prompt)
    for i in range(60):  # 60 tokens: the 48-token window slides several blocks
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a.argmax())
        a, b = dense.step(token), hybrid.step(token)
    layers = len(hybrid.decoder.global_layers)
    assert hybrid.decoder.body.replays == 60 * (layers + 1)  # every segment ran once per step


def test_decode_body_from_a_short_prompt_fills_the_sink(tmp_path):
    lm = tiny_model(tmp_path, TinySpec(num_layers=2), seed=3)
    hybrid, dense = sessions(lm, False, second_select_num=1000), DenseSession(lm.model, 512, 64)
    a, b = dense.prefill([5, 6, 7]), hybrid.prefill([5, 6, 7])
    for _ in range(90):  # positions 3..92 pass through the sink block and out of the window
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a.argmax())
        a, b = dense.step(token), hybrid.step(token)
