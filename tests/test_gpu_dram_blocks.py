"""On the GPU: decode replayed from CUDA graphs with the device reading the selected blocks from
pinned DRAM itself (`context_attention: gpu`, zero-copy over PCIe) follows eager decode where the
CPU operator reads them, bf16 and q8_0: with the selection on the device too (block scores there,
one graph a token), and with the host selecting between per-layer graphs (scores on the CPU)."""

import pytest
import torch

from ktlong.models.random_model import random_model
from tests.test_dram_blocks import _device_blocks, _host_blocks
from tests.test_gpu_decode_graph import session

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block_scoring", ["auto", "cpu"])
@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_replayed_decode_reading_dram_on_the_gpu_follows_the_cpu_operator(kv_type, block_scoring):
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(7)).tolist()
    cpu = session(model, False, kv_type, second_select_num=3, block_scoring=block_scoring)
    gpu = session(model, True, kv_type, second_select_num=3, block_scoring=block_scoring, context_attention="gpu")
    a, b = cpu.prefill(ids), gpu.prefill(ids)
    decoder = gpu.decoder
    assert type(decoder.dram_blocks).__name__ == "DramBlocks"
    on_device = block_scoring == "auto"
    assert (decoder.selection is not None) == on_device
    assert len(decoder.body.graphs) == 1 if on_device else decoder.body.dram_graphs
    same = compared = 0
    for i in range(100):  # past a window slide
        assert float((b - a).norm() / a.norm()) < 3e-2, i
        token = int(a.argmax())
        a, b = cpu.step(token), gpu.step(token)
        for j, layer in enumerate(decoder.global_layers):
            if on_device and layer in cpu.decoder.selector.cache:
                same += _device_blocks(decoder, j) == _host_blocks(cpu.decoder, layer)
                compared += 1
    # bf16 rounding (the eager and the replayed sums) may reorder near-tied blocks, rarely
    assert same >= 0.95 * compared, (same, compared)
    times = decoder.times
    assert times.selected == cpu.decoder.times.selected > 0 and times.kv_bytes == 0


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_the_dense_arm_on_the_device_follows_the_cpu_operator(kv_type):
    """The evaluation's dense arm (every layer reads every block: ktlong/session/settings) with the
    device reading DRAM, replayed from one graph a token, against the CPU operator reading all
    of them eagerly: the same logits within bf16 rounding, past a window slide."""
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    dense = dict(second_select_num=1 << 30, dense_layer_num=model.config.num_layers)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(9)).tolist()
    cpu = session(model, False, kv_type, **dense)
    gpu = session(model, True, kv_type, block_scoring="auto", context_attention="gpu", **dense)
    a, b = cpu.prefill(ids), gpu.prefill(ids)
    assert gpu.decoder.selection is not None and len(gpu.decoder.body.graphs) == 1
    for i in range(60):
        assert float((b - a).norm() / a.norm()) < 3e-2, i
        token = int(a.argmax())
        a, b = cpu.step(token), gpu.step(token)
