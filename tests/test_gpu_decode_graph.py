"""On the GPU: the decode step replayed from CUDA graphs, captured once, follows the eager
step, and every counter advances under replay (a frozen counter is KTransformers' bug)."""

import pytest
import torch

from tests.settings import gpu_backend, selection, with_anchors
from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import LongContextSession
from ktlong.models.random_model import random_model

pytestmark = pytest.mark.gpu


def session(model, use_graph, kv_type="bf16", **settings):
    c = model.config
    chosen = selection("cuda", preselect_block=False, **settings)
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1200, kv_type), chosen)
    return LongContextSession(model, layout, chunk_size=256, backend=gpu_backend(model), hidden_on_device=True, compact=None,
                              selection=chosen, local_windows_len=128,
                              use_cuda_graph=use_graph)


def spy_steps(decoder):
    steps = []
    original = decoder.selector.select

    def record(layer, step, q, first, last, device_scores=None):
        blocks, counts = original(layer, step, q, first, last, device_scores)
        steps.append((layer, step, blocks.tobytes()))
        return blocks, counts

    decoder.selector.select = record
    return steps


def test_replayed_decode_follows_eager_decode_and_counters_advance():
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(4)).tolist()
    eager = session(model, False, second_select_num=3, token_step=2, layer_step=2)
    graphed = session(model, True, second_select_num=3, token_step=2, layer_step=2)
    a, b = eager.prefill(ids), graphed.prefill(ids)
    eager_steps, graph_steps = spy_steps(eager.decoder), spy_steps(graphed.decoder)
    agree = 0
    for i in range(150):  # past two window slides (block 64, window 128)
        rel = float((b - a).norm() / a.norm())
        assert rel < 3e-2, (i, rel)
        agree += int(a.argmax() == b.argmax())
        token = int(a.argmax())
        a, b = eager.step(token), graphed.step(token)
    graphs = graphed.decoder.body
    assert len(graphs.graphs) == len(graphed.decoder.global_layers) + 1  # captured once
    assert graphs.replays == 150 * len(graphs.graphs)
    # the position read at replay advanced with every token: RoPE and the window slot moved
    assert int(graphs.position) == 700 + 149 and graphed.decoder.window.window_start > 0
    # the host-side token_step / layer_step counters drove the same selection schedule
    assert [s[:2] for s in graph_steps] == [s[:2] for s in eager_steps]
    assert sorted({s[1] for s in graph_steps}) == list(range(150))
    assert agree >= 140


@pytest.mark.parametrize("anchor_type, anchor_num", [("MAX", 1), ("QUEST", 1), ("DYNAMIC", 3)])
def test_device_scores_on_the_gpu_equal_the_cpu_kernel(anchor_type, anchor_num):
    import numpy as np

    from cpu_ops.bf16 import to_bf16
    from cpu_ops.block_select import QUEST, block_scores
    from operators.block_scores import device_block_scores

    rng = np.random.default_rng(3)
    num_anchors = 2 if anchor_type == "QUEST" else anchor_num
    values = rng.standard_normal((8, 2000, num_anchors, 128), dtype=np.float32)
    words = to_bf16(np.sort(values, axis=2))  # QUEST: min before max
    q = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    anchors = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    quest = anchor_type == "QUEST"
    for shared in (False, True):
        got = device_block_scores(q.cuda(), anchors.cuda(), quest, shared).cpu().numpy()
        cpu = block_scores(q.numpy(), words, np.arange(2000, dtype=np.int32), QUEST if quest else 0, shared)
        np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-3)


def test_graphs_with_device_scores_select_the_blocks_cpu_scores_select():
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    device = session(model, True, second_select_num=3, block_scoring="auto")  # auto: the device on a GPU
    cpu = session(model, True, second_select_num=3, block_scoring="cpu")
    a, b = device.prefill(ids), cpu.prefill(ids)
    assert device.decoder.device_anchors is not None and cpu.decoder.device_anchors is None
    device_steps, cpu_steps = spy_steps(device.decoder), spy_steps(cpu.decoder)
    for i in range(100):  # past a window slide: blocks fill, the device anchors follow
        assert float((b - a).norm() / a.norm()) < 3e-2, i
        token = int(b.argmax())
        a, b = device.step(token), cpu.step(token)
    same = sum(x == y for x, y in zip(device_steps, cpu_steps))
    assert len(device_steps) == len(cpu_steps) > 0 and same >= 0.98 * len(cpu_steps)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_replayed_decode_with_a_quantised_cache_equals_eager(kv_type):
    """The captured segments quantise each new token's K/V on the device as the eager ones do."""
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(6)).tolist()
    eager, graphed = session(model, False, kv_type, second_select_num=3), session(model, True, kv_type, second_select_num=3)
    a, b = eager.prefill(ids), graphed.prefill(ids)
    assert graphed.host.k[0].dtype == (torch.int8 if kv_type == "q8_0" else torch.uint8)
    for i in range(100):
        assert float((b - a).norm() / a.norm()) < 3e-2, i
        token = int(a.argmax())
        a, b = eager.step(token), graphed.step(token)
    for layer in range(model.config.num_layers):  # the write-through of both stored the same blocks
        for which in ("k", "v"):
            ours, theirs = graphed.host.tokens(layer, which, 700, 800), eager.host.tokens(layer, which, 700, 800)
            assert (ours == theirs).float().mean() > 0.99
