"""context_attention: gpu — the device attends to the selected blocks where they lie in DRAM
(ktlong/decode/dram_blocks.py) — against the CPU operator reading the same blocks. On the CPU the
kernel runs in Triton's interpreter over the same host tables (tests/conftest.py)."""

import numpy as np
import pytest
import torch

from ktlong.errors import KtlongError
from tests.test_block_cache import session
from tests.tiny_gguf import TinySpec, tiny_model


@pytest.mark.parametrize("kv_type, settings", [("fp32", {}), ("q8_0", {"head_select_mode": "SEPARATE"})])
def test_decode_with_the_gpu_reading_dram_equals_the_cpu_operator(tmp_path, kv_type, settings):
    wide = kv_type == "q8_0"  # q8_0 rows are 32 values
    spec = TinySpec(num_layers=2, hidden=128 if wide else 64, num_heads=4, num_kv_heads=2, head_dim=32 if wide else 16)
    lm = tiny_model(tmp_path, spec, seed=5)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 298, size=200)]
    cpu, gpu = (session(lm, 0, kv_type, where, second_select_num=4, **settings) for where in ("cpu", "gpu"))
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
        session(lm, 0, "q4_0", "gpu", second_select_num=4).prefill(list(range(100)))
