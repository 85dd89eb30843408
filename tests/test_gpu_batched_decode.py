"""On the GPU: conversations decoded together, replayed from CUDA graphs, follow each
conversation decoded alone while they join and leave, with the device reading (and, with
device scoring, selecting) each one's blocks in DRAM; the batch's step is one graph, which a
later batch of as many other conversations replays (DecodeBatch.rebind)."""

import pytest
import torch

from ktlong.decode.batch import Batches
from ktlong.kv.layout import kv_layout
from ktlong.models.random_model import random_model
from ktlong.session.long_context import LongContextSession
from tests.settings import gpu_backend, selection, with_anchors

pytestmark = pytest.mark.gpu

PROMPTS = (700, 900, 560)
STEPS = 40
# (first step, last step + 1) in the batch's steps: the batch of two at step 22 (the first and
# second) takes the body and graph of the one before (the second and third), each row another's
ACTIVE = ((10, STEPS), (0, 34), (0, 22))


def session(model, chosen, length):
    c = model.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1200, "q8_0",
                                    page_type="bf16"), chosen)
    s = LongContextSession(model, layout, chunk_size=256, backend=gpu_backend(model), hidden_on_device=True,
                           compact=None, selection=chosen, local_windows_len=128, use_cuda_graph=True)
    s.prefill(torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(length)).tolist())
    return s


def tokens_of(i):
    return torch.randint(0, 1000, (STEPS,), generator=torch.Generator().manual_seed(50 + i)).tolist()


@pytest.mark.parametrize("context_attention", ["gpu", "cpu"])
def test_a_graphed_batch_with_joins_and_leaves_follows_each_conversation_alone(context_attention):
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    chosen = selection("cuda", preselect_block=False, second_select_num=4, context_attention=context_attention)
    alone = []
    for i, length in enumerate(PROMPTS):
        s = session(model, chosen, length)
        first, stop = ACTIVE[i]
        alone.append([s.step(t).float() for t in tokens_of(i)[:stop - first]])
    sessions = [session(model, chosen, length) for length in PROMPTS]
    decoders = [s.decoder for s in sessions]
    together = [[] for _ in PROMPTS]
    batches, kept = Batches(model, use_cuda_graph=True), []
    for step in range(STEPS):
        active = [i for i, (first, stop) in enumerate(ACTIVE) if first <= step < stop]
        batch, how = batches.of([decoders[i] for i in active])  # as the session steps them
        graph = batch.body.graphs[0] if how == "rebound" else None
        out = batch.step([decoders[i] for i in active], [tokens_of(i)[step - ACTIVE[i][0]] for i in active])
        for row, i in enumerate(active):
            together[i].append(out[row].float())
        assert batch.body.capturing and batch.body.graphs  # replayed, not run eagerly
        if graph is not None:  # rebound: its first step ran eagerly, rewriting the tables, and kept the graph
            assert batch.body.graphs[0] is graph and batch.body.tables.matches
            kept.append(step)
    if context_attention == "gpu":
        assert len(batch.body.graphs) == 1  # the device selects: the batch's token is one graph
    assert kept == ([22] if context_attention == "gpu" else [])  # the host selects: each batch captures its own
    for i in range(len(PROMPTS)):
        agree = 0
        for step, (a, b) in enumerate(zip(together[i], alone[i])):
            # bf16 products of a batch's rows against one row's: rounding apart, not more
            rel = float((a - b).norm() / b.norm())
            assert rel < 3e-2, (i, step, rel)
            agree += int(a.argmax() == b.argmax())
        assert agree >= 0.9 * len(alone[i]), (i, agree)
        assert sessions[i].host.num_tokens == PROMPTS[i] + len(alone[i])
