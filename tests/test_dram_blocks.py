"""context_attention: gpu — the device attends to the selected blocks where they lie in DRAM
(ktlong/decode/dram_blocks.py) — against the CPU operator reading the same blocks. On the CPU the
kernel runs in Triton's interpreter over the same host tables (tests/conftest.py)."""

import numpy as np
import pytest
import torch

from ktlong.errors import KtlongError
from ktlong.kv.layout import model_kv_layout
from ktlong.session.long_context import LongContextSession
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model


def session(lm, context_attention, kv_type, **settings):
    chosen = selection(preselect_block=False, dense_layer_num=0, second_select_num=4, **settings)
    layout = with_anchors(model_kv_layout(lm.config, 16, 512, kv_type, local_windows_len=48,
                                          page_type="fp32" if kv_type == "q8_0" else None), chosen)
    return LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True, compact=None,
                              selection=chosen, local_windows_len=48, use_cuda_graph=False,
                              context_attention=context_attention)


@pytest.mark.parametrize("kv_type, settings", [("fp32", {}), ("q8_0", {"head_select_mode": "SEPARATE"})])
def test_decode_with_the_gpu_reading_dram_equals_the_cpu_operator(tmp_path, kv_type, settings):
    wide = kv_type == "q8_0"  # q8_0 rows are 32 values
    spec = TinySpec(num_layers=2, hidden=128 if wide else 64, num_heads=4, num_kv_heads=2, head_dim=32 if wide else 16)
    lm = tiny_model(tmp_path, spec, seed=5)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 298, size=200)]
    cpu, gpu = session(lm, "cpu", kv_type, **settings), session(lm, "gpu", kv_type, **settings)
    a, b = cpu.prefill(prompt), gpu.prefill(prompt)
    for _ in range(12):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a.argmax())
        a, b = cpu.step(token), gpu.step(token)
    times = gpu.decoder.times
    assert times.selected == cpu.decoder.times.selected > 0
    assert times.cached == times.selected and times.kv_bytes == 0  # the CPU read nothing


def test_formats_the_gpu_cannot_read_are_refused(tmp_path):
    lm = tiny_model(tmp_path, TinySpec(num_layers=2, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32), seed=5)
    with pytest.raises(KtlongError, match="set context_attention=cpu"):
        session(lm, "gpu", "q4_0").prefill(list(range(100)))
