"""Conversations decoded together equal each conversation decoded alone: the same logits (within
float32 rounding of the matrix products, whose rows the batch sums in another order) and the
same selected blocks at every step, while conversations of different lengths join and leave
the batch; and one step reads the weights once for the whole batch."""

import dataclasses

import numpy as np
import pytest
import torch

from ktlong.decode.batch import Batches, DecodeBatch
from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import LongContextSession
from tests.settings import few_shares, selection, selection_kernels_as_on_a_gpu, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model

B = 16
PROMPTS = (200, 263, 150)  # tokens: three conversations of different lengths
STEPS = 5
# (first step, last step + 1) of each conversation in the batch, in the batch's own steps: the
# first joins at step 1, the third leaves at 3 and the second at 4; the batch of two at step 3
# (the first and second) takes the body of the one before (the second and third), each row
# another conversation's
ACTIVE = ((1, STEPS), (0, 4), (0, 3))

# the batch's kernels run here on CPU tensors, in Triton's interpreter, which tests/conftest.py
# turns on only where there is no GPU; on a GPU, tests/test_gpu_batched_decode.py runs them
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter; "
                                "tests/test_gpu_batched_decode.py covers the batch on a GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=3, hidden=128, head_dim=32), seed=7)  # q8_0 rows: head_dim 32


def conversation(lm, settings, kv_type, length, answer_room=None):
    c = lm.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, B, 512, kv_type), settings)
    session = LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True,
                                 compact=None, selection=settings, local_windows_len=32, use_cuda_graph=False)
    session.prefill([int(t) for t in np.random.default_rng(length).integers(0, 298, size=length)],
                    answer_room=answer_room)
    return session


def record_selections(decoder):
    """Every selection the decoder's selector makes, as (layer, step, per-head block lists)."""
    calls, original = [], decoder.selector.select

    def select(layer, step, q, first, last, device_scores=None):
        blocks, counts = original(layer, step, q, first, last, device_scores)
        calls.append((layer, step, [sorted(blocks[h, :counts[h]].tolist()) for h in range(len(counts))]))
        return blocks, counts

    decoder.selector.select = select
    return calls


def tokens_of(i):
    return [int(t) for t in np.random.default_rng(100 + i).integers(0, 298, size=STEPS)]


CASES = {
    "fp32, CPU scoring": ("fp32", dict(block_scoring="cpu")),
    "q8_0, device scoring, token_step 2, layer_step 2": ("q8_0", dict(block_scoring="device", token_step=2,
                                                                      layer_step=2, dense_layer_num=1)),
    # the selected blocks' kernel and the selection's (scores, top-k, rows: as on a GPU, in
    # Triton's interpreter here): one launch a layer for the batch, each conversation's own
    # selection, copies and kept slots (the slowest case here); its dense layer reads every
    # block each conversation's anchors reach, and its anchors reach as far as its own prompt and
    # answer: selections and scores of different widths (12 blocks, but the shortest reaches 10:
    # its top-k and kept slots are narrower)
    "q8_0, the device selects and reads": ("q8_0", dict(block_scoring="device", context_attention="gpu",
                                                        dense_layer_num=1, second_select_num=12)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_batch_with_joins_and_leaves_equals_each_conversation_alone(tiny, case, monkeypatch):
    kv_type, options = CASES[case]
    if options.get("context_attention") == "gpu":  # the selection's kernels, as a GPU runs them (but torch's top-k)
        selection_kernels_as_on_a_gpu(monkeypatch)
        few_shares(monkeypatch)
    settings = dataclasses.replace(selection(second_select_num=3, preselect_block=False, dense_layer_num=0),
                                   **options)
    # alone: each conversation decodes its tokens by itself
    alone_logits, alone_calls, alone_read = [], [], []
    for i, length in enumerate(PROMPTS):
        session = conversation(tiny, settings, kv_type, length)
        calls = record_selections(session.decoder)
        first, stop = ACTIVE[i]
        alone_logits.append([session.step(t).clone() for t in tokens_of(i)[:stop - first]])
        alone_calls.append(calls)
        alone_read.append(session.decoder.times.device_read)
    if session.decoder.selection is None:  # the host selects: its calls show that blocks were selected
        assert all(any(len(heads[0]) == 3 for _, _, heads in calls) for calls in alone_calls)

    # together: one batch per set of members, rebuilt as conversations join and leave; each
    # decoder's device anchors sized for its prompt and answer (alone: for max_seq_len), so the
    # members of a batch score blocks tables of different widths
    sessions = [conversation(tiny, settings, kv_type, length, answer_room=STEPS) for length in PROMPTS]
    decoders = [s.decoder for s in sessions]
    if options.get("context_attention") == "gpu":
        assert all(d.selection.kernel for d in decoders)
        assert [d.selection.places for d in decoders] == [12, 12, 10]  # the shortest's top-k is narrower
    if options["block_scoring"] == "device":
        assert [d.device_anchors.num_blocks for d in decoders] == [-(-(n + STEPS) // B) for n in PROMPTS]
        assert [d.anchor_bytes for d in decoders] == [sessions[0].anchors.bytes_for(n + STEPS) for n in PROMPTS]
    batch_calls = [record_selections(d) for d in decoders]
    logits = [[] for _ in PROMPTS]
    heads = tiny.model.logits
    passes = []
    tiny.model.logits = lambda x, decoding=False: passes.append(x.shape[0]) or heads(x, decoding)
    try:
        batches, rebound = Batches(tiny.model, use_cuda_graph=False), []
        for step in range(STEPS):
            active = [i for i, (first, stop) in enumerate(ACTIVE) if first <= step < stop]
            batch, how = batches.of([decoders[i] for i in active])  # as the session steps them
            if how == "rebound":
                rebound.append(step)
            out = batch.step([decoders[i] for i in active], [tokens_of(i)[step - ACTIVE[i][0]] for i in active])
            if step in rebound:  # every kernel call found the launch its table was made for: rewritten in place
                assert batch.body.tables.matches and batch.body.tables.sites
            for row, i in enumerate(active):
                logits[i].append(out[row].clone())
    finally:
        tiny.model.logits = heads
    # the device selecting, the batch of two at step 3 stepped with the body of the one before,
    # its kernels' tables written from the addresses of that one's members
    assert rebound == ([3] if options.get("context_attention") == "gpu" else [])
    # one pass over the output head per step, with every member's row in it
    assert passes == [sum(first <= s < stop for first, stop in ACTIVE) for s in range(STEPS)]
    assert max(passes) == 3

    for i in range(len(PROMPTS)):
        assert batch_calls[i] == alone_calls[i], f"conversation {i} selected other blocks in the batch"
        assert decoders[i].times.device_read == alone_read[i]  # the device read as many blocks
        assert decoders[i].times.device_read > 0 or options.get("context_attention") != "gpu"
        assert len(logits[i]) == len(alone_logits[i])
        for step, (a, b) in enumerate(zip(logits[i], alone_logits[i])):
            # float32 through 3 layers, the batch's products summed in another order than one
            # row's: about 1e-6 of the largest logit; where such a difference moves a value that is
            # rounded to bfloat16 (the window's logits and probabilities) across a rounding
            # boundary, it becomes one bfloat16 step, 2^-8 of that value: the bound per step
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= 2 ** -8 * scale, (i, step)
        assert sessions[i].host.num_tokens == PROMPTS[i] + len(alone_logits[i])


def test_the_window_parts_of_a_batch_in_one_launch_equal_each_members_torch_ops(tiny):
    """Where the window kernel runs (captured, on a GPU), a batch's window parts of a layer are one
    launch, each conversation's buffers found by their offsets from the first's: the same
    attention states as each conversation's masked torch ops (Triton's interpreter here)."""
    import torch

    from operators.window_attention_kernel import window_attention

    settings = selection(second_select_num=3, preselect_block=False, dense_layer_num=0, block_scoring="cpu")
    sessions = [conversation(tiny, settings, "bf16", length) for length in PROMPTS]
    body = DecodeBatch(tiny.model, [s.decoder for s in sessions], use_cuda_graph=False).body
    body.capturing = True  # the captured path's inputs (lo, hi on the device), without a GPU to capture on
    for b, s in enumerate(sessions):
        body.set_step(b, 7, s.decoder.position)
    c = tiny.config
    q = torch.randn(len(PROMPTS), c.num_heads, c.head_dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    layer = body.global_layers[1]
    o_ops, lse_ops = body._windows(layer, q)  # torch's masked ops, conversation by conversation
    body.window_kernel = window_attention
    body._bind_members()  # the kernels' tables of these members
    o_one, lse_one = body._windows(layer, q)
    torch.testing.assert_close(lse_one, lse_ops, rtol=1e-5, atol=1e-5)
    # rounded to bfloat16 as the torch ops round: equal but where a float32 sum's order moves a
    # value across a rounding boundary, one bfloat16 step
    assert ((o_one - o_ops).abs() <= o_ops.abs().clamp_min(1e-3) * 2 ** -7).all()


@pytest.mark.parametrize("kv_type", ["fp32", "q8_0"])
def test_a_batchs_new_rows_in_one_launch_land_where_the_torch_ops_put_them(tiny, kv_type, monkeypatch):
    """Where the append kernel runs (on a GPU), a layer's new K/V of every conversation are one
    launch, each conversation's window and stored rows found by their offsets from the first's:
    the same window rows and the same bytes for DRAM as the torch ops write, conversation by
    conversation (Triton's interpreter here, whose float32 -> bfloat16 casts truncate where a
    GPU's round to nearest: so the model's rows are made bfloat16 values first; the kernel's own
    rounding against torch's: tests/test_decode_append_kernel.py)."""
    import torch

    from operators.decode_append_kernel import append_token

    settings = selection(second_select_num=3, preselect_block=False, dense_layer_num=0, block_scoring="cpu")
    sessions = [conversation(tiny, settings, kv_type, length) for length in PROMPTS]
    body = DecodeBatch(tiny.model, [s.decoder for s in sessions], use_cuda_graph=False).body
    for b, s in enumerate(sessions):
        body.set_step(b, 7 + b, s.decoder.position)
    body.x.copy_(torch.randn(body.x.shape, generator=torch.Generator().manual_seed(3)))
    body.rope = tiny.model.rope_tables(body.position)
    qkv = tiny.model.qkv
    monkeypatch.setattr(tiny.model, "qkv", lambda *a, **k: [t.to(torch.bfloat16).float() for t in qkv(*a, **k)])
    layer = body.global_layers[1]
    before = [(w.buf_k.clone(), w.buf_v.clone()) for w in body.windows]
    body._append(layer, 1)  # torch's ops
    torch_rows = [(w.buf_k.clone(), w.buf_v.clone()) for w in body.windows], body.kv_host.clone(), \
        body.kv_scales_host.clone()
    for w, (k, v) in zip(body.windows, before):
        w.buf_k.copy_(k)
        w.buf_v.copy_(v)
    body.kv_host.zero_()
    body.kv_scales_host.zero_()
    body.append_kernel = append_token
    body._bind_members()  # the kernels' tables of these members
    body._append(layer, 1)
    windows, kv, scales = torch_rows
    for w, (k, v), (k0, _) in zip(body.windows, windows, before):
        assert torch.equal(w.buf_k, k) and torch.equal(w.buf_v, v) and not torch.equal(k, k0)
    assert torch.equal(body.kv_host[:, 1], kv[:, 1]) and body.kv_host[:, 1].any()
    assert torch.equal(body.kv_scales_host, scales)
