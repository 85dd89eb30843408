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


def session(lm, kv_type="fp32", context_attention="cpu", **settings):
    chosen = selection(**{"preselect_block": False, "dense_layer_num": 0, "context_attention": context_attention,
                          **settings})
    layout = with_anchors(model_kv_layout(lm.config, 16, 512, kv_type, local_windows_len=48,
                                          page_type="fp32" if kv_type in ("q8_0", "q4_0") else None), chosen)
    return LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True, compact=None,
                              selection=chosen, local_windows_len=48, use_cuda_graph=False)


@pytest.mark.parametrize("kv_type, settings", [("fp32", {}), ("q8_0", {"head_select_mode": "SEPARATE"})])
def test_decode_with_the_gpu_reading_dram_equals_the_cpu_operator(tmp_path, kv_type, settings):
    wide = kv_type == "q8_0"  # q8_0 rows are 32 values
    spec = TinySpec(num_layers=2, hidden=128 if wide else 64, num_heads=4, num_kv_heads=2, head_dim=32 if wide else 16)
    lm = tiny_model(tmp_path, spec, seed=5)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 298, size=200)]
    cpu, gpu = (session(lm, kv_type, where, second_select_num=4, **settings) for where in ("cpu", "gpu"))
    a, b = cpu.prefill(prompt), gpu.prefill(prompt)
    for _ in range(12):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a.argmax())
        a, b = cpu.step(token), gpu.step(token)
    times = gpu.decoder.times
    assert times.selected == cpu.decoder.times.selected > 0
    assert times.device_read == times.selected and times.kv_bytes == 0  # the CPU read nothing
    # the memory plan counts the kept blocks' slots as the decoder makes them
    from ktlong.kv.memory_plan import decode_kept_bytes

    slots = [t for kept in gpu.decoder.dram_blocks.kept for t in kept[:4] if t is not None]
    assert sum(t.nbytes for t in slots) == decode_kept_bytes(gpu.layout, 4) > 0


def test_formats_the_gpu_cannot_read_are_refused(tmp_path):
    lm = tiny_model(tmp_path, TinySpec(num_layers=2, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32), seed=5)
    with pytest.raises(KtlongError, match="set context_attention=cpu"):
        session(lm, "q4_0", "gpu", second_select_num=4).prefill(list(range(100)))


def _host_blocks(decoder, layer: int) -> list[list[int]]:
    """The blocks the host's selector read at its last step, per kv head, ascending."""
    blocks, counts = decoder.selector.cache[layer][:2]
    return [sorted(blocks[h, :counts[h]].tolist()) for h in range(len(counts))]


def _device_blocks(decoder, j: int) -> list[list[int]]:
    """The blocks the device's selection read at its last step, per kv head, ascending."""
    selection = decoder.selection
    index = selection.index[selection.role[j] if isinstance(selection.role[j], int) else j]
    valid = selection.valid[j] // selection.block_size
    return [sorted((index[h, :valid[h]] - h * selection.num_blocks).tolist()) for h in range(len(valid))]


@pytest.mark.slow  # seconds on the 2-core machine: the full suite runs it, the fast lane does not
@pytest.mark.parametrize("kv_type, length, settings", [
    ("fp32", 300, {}),
    ("fp32", 300, {"preselect_block": True, "preselect_block_count": 6, "dense_layer_num": 1}),
    ("fp32", 300, {"token_step": 3, "layer_step": 2, "anchor_type": "QUEST"}),
    # 4 context blocks (as many as are selected: all read) until the window slides at the 18th
    # step, a step that would reuse its selection with token_step 3 had there been one
    ("fp32", 143, {"token_step": 3, "preselect_block": True, "preselect_block_count": 2}),
    ("q8_0", 300, {"head_select_mode": "SEPARATE", "preselect_block": True, "preselect_block_count": 5})])
def test_selection_on_the_device_reads_the_blocks_the_host_selects(tmp_path, kv_type, length, settings):
    """With block scores on the device, context_attention: gpu selects there too (one piece of
    device work a token): the same blocks as the host's selector and the CPU operator at every
    step, and the same logits."""
    wide = kv_type == "q8_0"
    spec = TinySpec(num_layers=3, hidden=128 if wide else 64, num_heads=4, num_kv_heads=2, head_dim=32 if wide else 16)
    lm = tiny_model(tmp_path, spec, seed=7)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 298, size=length)]
    cpu = session(lm, kv_type, "cpu", second_select_num=4, block_scoring="device", **settings)
    gpu = session(lm, kv_type, "gpu", second_select_num=4, block_scoring="device", **settings)
    a, b = cpu.prefill(prompt), gpu.prefill(prompt)
    assert gpu.decoder.selection is not None and cpu.decoder.selection is None
    layers = gpu.decoder.global_layers
    # the selections repeat (token_step 3); the 143-token prompt's window slides at its 18th step
    # (the window holds local_windows_len plus up to two blocks: 17 to 32 steps after a prefill)
    for step in range(8 if length == 300 else 20):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a.argmax())
        first, last = cpu.decoder.window.context_blocks  # the step's DRAM context
        a, b = cpu.step(token), gpu.step(token)
        for j, layer in enumerate(layers):
            if last - first <= 4 or layer < settings.get("dense_layer_num", 0):  # every context block
                expected = [list(range(first, last))] * 2
            else:  # what the host selected (or kept from an earlier step)
                expected = _host_blocks(cpu.decoder, layer)
            assert _device_blocks(gpu.decoder, j) == expected, (step, layer)
    first, last = cpu.decoder.window.context_blocks
    assert length == 300 or last - first == 5  # the window did slide: a fifth context block
    assert gpu.decoder.times.selected == cpu.decoder.times.selected > 0
    assert gpu.decoder.times.kv_bytes == 0


def test_auto_puts_context_attention_on_the_gpu_where_it_can():
    from ktlong.decode.dram_blocks import resolve_context_attention
    from ktlong.kv.layout import kv_layout

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    bf16, q4 = kv_layout(2, 2, 64, 16, 512, "bf16"), kv_layout(2, 2, 64, 16, 512, "q4_0")
    assert resolve_context_attention("auto", gpu, bf16) == "gpu"  # with tensor parallelism too: each rank its own heads
    assert resolve_context_attention("auto", gpu, q4) == "cpu"  # a format the kernel does not read
    assert resolve_context_attention("cpu", gpu, bf16) == "cpu"
    assert resolve_context_attention("gpu", cpu, bf16) == resolve_context_attention("auto", cpu, bf16) == "cpu"


@pytest.mark.parametrize("settings", [dict(second_select_num=1000), dict(second_select_num=1 << 30, dense_layer_num=2)])
def test_selecting_more_blocks_than_the_cache_holds_reads_them_all(tmp_path, settings):
    """second_select_num above the cache's block count, and the evaluation's dense arm (every
    layer dense, ktlong/session/settings.selection_settings): the device reads every context
    block, as the CPU operator does."""
    lm = tiny_model(tmp_path, TinySpec(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16), seed=5)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 298, size=200)]
    cpu, gpu = (session(lm, "fp32", where, block_scoring="device", **settings) for where in ("cpu", "gpu"))
    a, b = cpu.prefill(prompt), gpu.prefill(prompt)
    assert gpu.decoder.selection is not None
    for _ in range(6):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a.argmax())
        a, b = cpu.step(token), gpu.step(token)
    assert gpu.decoder.times.selected == cpu.decoder.times.selected > 0


def test_the_dense_arm_reads_on_the_device_where_context_attention_does():
    """The evaluation's dense arm (ktlong/session/settings.ARMS) reads every block of every layer
    where the session's context_attention reads: on a GPU the device (its step one graph, as the
    test above reads them all), on the CPU the operator; its plan keeps no slots for the last
    tokens' blocks, which the decoder makes for sparse layers only."""
    from ktlong.config import default_config
    from ktlong.kv.layout import kv_layout
    from ktlong.session.plan import kept_blocks, resolve_selection
    from ktlong.session.settings import selection_settings

    layout = kv_layout(4, 2, 64, 16, 512, "bf16")
    for device, where in ((torch.device("cuda"), "gpu"), (torch.device("cpu"), "cpu")):
        dense = resolve_selection(selection_settings(default_config(), 4, "dense"), device, layout)
        assert dense.context_attention == where and dense.dense_layer_num == 4 and not dense.preselect_block
        assert dense.second_select_num >= layout.num_blocks and kept_blocks(dense, 4) == 0
    sparse = resolve_selection(selection_settings(default_config(), 4), torch.device("cuda"), layout)
    assert kept_blocks(sparse, 4) == sparse.second_select_num > 0
