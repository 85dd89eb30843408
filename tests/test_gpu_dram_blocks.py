"""On the GPU: decode replayed from CUDA graphs with the device reading the selected blocks from
pinned DRAM itself (`context_attention: gpu`, zero-copy over PCIe) follows eager decode where the
CPU operator reads them, bf16 and q8_0."""

import pytest
import torch

from ktlong.models.random_model import random_model
from tests.test_gpu_decode_graph import session

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_replayed_decode_reading_dram_on_the_gpu_follows_the_cpu_operator(kv_type):
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(7)).tolist()
    cpu = session(model, False, kv_type, second_select_num=3)
    gpu = session(model, True, kv_type, second_select_num=3, context_attention="gpu")
    a, b = cpu.prefill(ids), gpu.prefill(ids)
    assert type(gpu.decoder.cache).__name__ == "DramBlocks" and gpu.decoder.body.cached_graphs
    for i in range(100):  # past a window slide
        assert float((b - a).norm() / a.norm()) < 3e-2, i
        token = int(a.argmax())
        a, b = cpu.step(token), gpu.step(token)
    times = gpu.decoder.times
    assert times.selected == cpu.decoder.times.selected > 0 and times.kv_bytes == 0
