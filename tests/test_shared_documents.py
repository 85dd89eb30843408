"""Conversations over one document share its DRAM KV (LongContextSession.share): a second
question over a document another conversation holds, while that one is still decoding, prefills
only its question (the document's whole multiples of the granularity shared, its blocks past them
copied), and gives what the same question gives as a follow-up over the first conversation's own
cache, token for token; the first conversation decodes on as it would have alone, the
two decode together as each does alone, and DRAM holds the shared blocks once."""

import dataclasses

import numpy as np
import pytest
import torch

from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.kv.shared_prefix import granularity
from ktlong.session.long_context import LongContextSession
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model

B, CAPACITY = 16, 1024
# tokens; the document's first 512 (32 blocks: the granularity) are shared, its next 3 blocks and
# 6 rows of a fourth copied
DOCUMENT, QUESTION = 566, 24
STEPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=4, hidden=128, head_dim=32), seed=11)


def ids(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 298, size=n)]


DOC = ids(1, DOCUMENT)
FIRST, SECOND = DOC + ids(2, QUESTION), DOC + ids(3, QUESTION)


def session_for(lm, settings):
    c = lm.config
    layout = with_anchors(kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, B, CAPACITY, "fp32"), settings)
    assert granularity(layout) == 32
    return LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True,
                              compact=None, selection=settings, local_windows_len=32, use_cuda_graph=False)


def decode(step, tokens):
    return [step(t).clone() for t in tokens]


@pytest.mark.parametrize("scoring", ["cpu", "device", pytest.param("device, reading DRAM", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter, which tests/conftest.py sets only "
    "without CUDA (tests/test_gpu_shared_documents.py reads DRAM there)"))])
def test_a_second_question_over_a_decoding_document_shares_its_blocks(tiny, scoring):
    # "device, reading DRAM": the selected blocks' kernel (Triton's interpreter here), where a
    # block of the document that both select in a step is read once
    settings = dataclasses.replace(selection(second_select_num=3, preselect_block=False, dense_layer_num=0),
                                   block_scoring=scoring.split(",")[0],
                                   context_attention="gpu" if "DRAM" in scoring else "cpu")
    answer_one, answer_two = ids(4, 2 * STEPS), ids(5, STEPS)

    # references: the first conversation alone; the second as a follow-up over the first
    # conversation's cache, cut back to the document
    alone = session_for(tiny, settings)
    alone.prefill(FIRST)
    first_alone = decode(alone.step, answer_one[:STEPS])
    pcie = lambda decoder: decoder.times.device_read - decoder.times.kept_read  # noqa: E731 (blocks over PCIe)
    read_alone = -pcie(alone.decoder)
    first_alone += decode(alone.step, answer_one[STEPS:])
    private = session_for(tiny, settings)
    private.prefill(FIRST)
    second_logits_alone = private.prefill(SECOND)
    second_alone = decode(private.step, answer_two)
    read_alone += pcie(alone.decoder) + pcie(private.decoder)  # over the steps decoded together below
    assert private.last_prefill_tokens == QUESTION

    # the first conversation decodes, then leaves the session for the second question's prefill
    session = session_for(tiny, settings)
    session.prefill(FIRST)
    first = decode(session.step, answer_one[:STEPS])
    one = session.detach(HostKVCache(session.layout, pin=False))
    assert session.share(one, SECOND) == DOCUMENT
    assert session.host.shared is one.host.shared and one.host.shared_blocks == 32
    second_logits = session.prefill(SECOND)
    assert session.last_prefill_tokens == QUESTION
    assert torch.equal(second_logits, second_logits_alone)
    two = session.conversation
    # both decode together, each as it does alone
    read_together = -pcie(one.decoder) - pcie(two.decoder)
    together = [session.step_batch([one, two], [a, b]).clone() for a, b in zip(answer_one[STEPS:], answer_two)]
    first += [row[0] for row in together]
    second = [row[1] for row in together]
    for got, want in ((first, first_alone), (second, second_alone)):
        for a, b in zip(got, want):
            # float32 through 4 layers, the batch's rows summed in another order: n·u·Σ|a·b| bounds it
            # (n ≤ 1,024 terms, u = 2^-24), about 1e-4 of the largest logit after the layers
            assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
    assert one.ids == FIRST + answer_one and two.ids == SECOND + answer_two
    if "DRAM" in scoring:  # each keeps its own slots as alone; a block both select is read once, not twice
        read_together += pcie(one.decoder) + pcie(two.decoder)
        assert 0 < read_together < read_alone
    # DRAM: the shared blocks once
    per_cache = session.layout.dram_cache_bytes()
    assert one.host.shared_bytes == two.host.shared_bytes == one.host.shared.nbytes > per_cache // 3


def test_a_common_prefix_shorter_than_the_granularity_is_copied_whole(tiny):
    """400 common tokens, under the 512 a shared prefix takes: nothing shared, all 400 copied, and
    the question prefilled over them as a follow-up over the first conversation's own cache."""
    settings = selection(second_select_num=3, preselect_block=False, dense_layer_num=0)
    first, second = DOC[:400] + ids(6, 20), DOC[:400] + ids(7, 20)
    private = session_for(tiny, settings)
    private.prefill(first)
    want = private.prefill(second)
    session = session_for(tiny, settings)
    session.prefill(first)
    one = session.detach(HostKVCache(session.layout, pin=False))
    assert session.share(one, second) == 400
    assert session.host.shared is None and one.host.shared is None and session.host.copying
    assert torch.equal(session.prefill(second), want) and session.last_prefill_tokens == 20
    assert session.share(one, ids(8, 30)) == 0 and session.ids == second  # nothing in common: nothing changed


def test_a_sharing_conversation_saves_and_loads_as_any_other(tiny, tmp_path):
    """A saved cache of a conversation that shares its document holds the shared blocks too (read
    through the mapping); loaded into a cache that itself shared a prefix (its sharing dropped
    first), it decodes as the saved one; the source is untouched throughout."""
    from ktlong.session.saved_cache import load_cache, save_cache

    settings = selection(second_select_num=3, preselect_block=False, dense_layer_num=0)
    fp = {"model": "tiny", "kv_type": "fp32"}
    session = session_for(tiny, settings)
    session.prefill(FIRST)
    one = session.detach(HostKVCache(session.layout, pin=False))
    source_k = one.host.k[0].clone()
    session.share(one, SECOND)
    session.prefill(SECOND)
    path = tmp_path / "second.kv"
    save_cache(path, session, fp, [])
    follow, answer = SECOND + ids(9, 16), ids(8, STEPS)  # a follow-up after the saved turn, then its answer
    saved = [session.prefill(follow)] + decode(session.step, answer)

    other = session_for(tiny, settings)
    other.prefill(FIRST)
    holder = other.detach(HostKVCache(other.layout, pin=False))
    other.share(holder, SECOND)  # the cache the file is loaded into shares a prefix now
    load_cache(path, other, fp)
    assert other.host.shared is None and other.ids == SECOND
    loaded = [other.prefill(follow)] + decode(other.step, answer)
    assert other.last_prefill_tokens == 16
    for a, b in zip(loaded, saved):
        assert torch.equal(a, b)
    assert torch.equal(one.host.k[0], source_k) and torch.equal(holder.host.k[0][:, :32], source_k[:, :32])


def test_a_joined_documents_pages_are_held_before_its_prefill_reads_them_a_piece_at_a_time(tiny, monkeypatch):
    """Sharing maps the document's pages and holds none of them (HostKVCache._hold: page-locking
    a 128K document's pages at the join held every stream for seconds); the prefill that follows
    reserves them first, asking should_stop after each piece (where a sliced prefill hands back
    to the decode steps), before its engine reads a layer; a stop asked there ends it with the
    cache forgotten, the source untouched."""
    from ktlong.errors import Cancelled
    from ktlong.kv import host_cache

    settings = selection(second_select_num=3, preselect_block=False, dense_layer_num=0)
    session = session_for(tiny, settings)
    session.prefill(FIRST)
    one = session.detach(HostKVCache(session.layout, pin=False))
    source_k = one.host.k[0].clone()
    pieces = []
    grow = host_cache.HostKVCache._grow
    monkeypatch.setattr(host_cache.HostKVCache, "_grow",
                        lambda self, layer, blocks, pace: grow(self, layer, blocks, lambda: (pieces.append(layer),
                                                                                              pace())))
    for stop_at in (None, 3):
        if stop_at is not None:  # the last question's conversation leaves: an empty cache again
            session.detach(HostKVCache(session.layout, pin=False))
        assert session.share(one, SECOND) == DOCUMENT
        assert set(session.host.committed.values()) == {0} and session.host.copying  # mapped, nothing held yet
        pieces.clear()
        asked, seen = [], {}
        run = session.engine.run

        def engine_run(*args, **kwargs):
            seen["committed"], seen["asked"] = dict(session.host.committed), len(asked)
            seen["copying"] = session.host.copying
            return run(*args, **kwargs)
        monkeypatch.setattr(session.engine, "run", engine_run)
        should_stop = lambda: asked.append(1) or len(asked) == stop_at  # noqa: E731
        if stop_at is None:
            session.prefill(SECOND, should_stop=should_stop)
            # the shared blocks held, and the blocks past them copied, before the engine ran
            assert min(seen["committed"].values()) >= -(-DOCUMENT // B) and not seen["copying"]
            assert seen["asked"] >= len(pieces) > len(session.layout.global_layers)  # asked after each piece
        else:
            with pytest.raises(Cancelled):
                session.prefill(SECOND, should_stop=should_stop)
            assert "committed" not in seen and session.host.num_tokens == 0 and session.host.shared is None
            assert not session.host.copying
        assert torch.equal(one.host.k[0], source_k)
