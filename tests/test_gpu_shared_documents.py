"""On the GPU: a second conversation shares a decoding one's leading blocks in pinned DRAM
(ktlong/kv/shared_prefix.py: the pages mapped anew and page-locked again under both caches),
while the first one's decoder and CUDA graphs, which read its DRAM where it lies, go on: the
first decodes as it does alone, the second as the same question as a follow-up over the first
conversation's own cache (the blocks past the shared ones copied), and the two together as each
alone."""

import pytest
import torch

from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.kv.shared_prefix import granularity
from ktlong.models.random_model import random_model
from ktlong.session.long_context import LongContextSession
from tests.settings import gpu_backend, selection, with_anchors

pytestmark = pytest.mark.gpu

STEPS = 24


def ids(seed, n):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOC = ids(1, 1100)  # 1,024 tokens shared, 76 copied (a block and 12 rows of a second)
FIRST, SECOND = DOC + ids(2, 40), DOC + ids(3, 40)


def session_for(model, chosen):
    c = model.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 2048, "q8_0",
                                    page_type="bf16"), chosen)
    assert granularity(layout) == 16  # 1,024 tokens
    return LongContextSession(model, layout, chunk_size=256, backend=gpu_backend(model), hidden_on_device=True,
                              compact=None, selection=chosen, local_windows_len=128, use_cuda_graph=True)


def close(got, want):
    """bf16 products of a batch's rows against one row's: rounding apart, and mostly the same argmax."""
    agree = 0
    for a, b in zip(got, want):
        a, b = a.float(), b.float()
        assert float((a - b).norm() / b.norm()) < 3e-2
        agree += int(a.argmax() == b.argmax())
    assert agree >= 0.9 * len(want)


@pytest.mark.parametrize("context_attention", ["gpu", "cpu"])
def test_a_second_conversation_shares_a_decoding_ones_pinned_blocks(context_attention):
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    chosen = selection("cuda", preselect_block=False, second_select_num=4, context_attention=context_attention)
    one_tokens, two_tokens = ids(4, 2 * STEPS), ids(5, STEPS)
    alone = session_for(model, chosen)
    alone.prefill(FIRST)
    first_alone = [alone.step(t).float() for t in one_tokens]
    private = session_for(model, chosen)
    private.prefill(FIRST)
    second_prefill_alone = private.prefill(SECOND).float()
    second_alone = [private.step(t).float() for t in two_tokens]

    session = session_for(model, chosen)
    session.prefill(FIRST)
    first = [session.step(t).float() for t in one_tokens[:STEPS]]
    one = session.detach(HostKVCache(session.layout, pin=True))
    assert session.share(one, SECOND) == len(DOC)
    assert session.host.shared is one.host.shared and session.host.shared_blocks == 16
    second_prefill = session.prefill(SECOND).float()
    assert session.last_prefill_tokens == len(SECOND) - len(DOC)
    close([second_prefill], [second_prefill_alone])
    two = session.conversation
    together = [session.step_batch([one, two], [a, b]).float() for a, b in zip(one_tokens[STEPS:], two_tokens)]
    close(first + [row[0] for row in together], first_alone)
    close([row[1] for row in together], second_alone)
    if context_attention == "gpu":
        assert one.decoder.times.device_read > 0  # the device read the shared pages where they lie
