"""The kept-keys bench's records agree with top-k's own rule and with the prompt: an answer
block that more blocks outrank than the group keeps is dropped, one that fewer blocks outrank
or tie with than it keeps is kept, the block found holds the answer's first token, and every
compact layer's chunks after the answer are recorded."""

import pytest


@pytest.mark.slow
def test_records_follow_topk_and_the_answer_block_holds_the_answer(real_model):
    from ktlong.bench.kept_keys import KeyWatch, answer_blocks
    from ktlong.chat.conversation import Conversation
    from ktlong.chat.generate import generate
    from ktlong.chat.sampling import Sampler
    from ktlong.config import default_config
    from ktlong.eval.tasks import make_sample
    from ktlong.session.long_context import LongContextSession
    from ktlong.session.plan import plan_session

    lm = real_model("smollm2-135m")
    config = default_config(mode="long_context", block_size=64, keep_blocks=8, chunk_size=512)
    plan = plan_session(config, lm.config, lm.weight_bytes, 4096, lm.model.device, lm.model.dtype)
    session = LongContextSession.from_plan(lm.model, plan)
    conversation = Conversation(lm.tokenizer, lm.chat_template)
    sample = make_sample("passkey", 2000, 0.5, 0, lambda text: len(conversation.render_ids([], text)))
    ids = conversation.render_ids([], sample.prompt)
    [block] = answer_blocks(lm.tokenizer, ids, [sample.answer], 64)
    before, through = lm.tokenizer.decode(ids[:block * 64]), lm.tokenizer.decode(ids[:(block + 1) * 64])
    assert sample.answer not in before and sample.answer[0] in through[len(before):]
    watch = KeyWatch(session.engine, [block], lm.model.scale)
    generate(session, ids, 2, Sampler(), lm.tokenizer.stop_ids, lm.tokenizer)
    records = watch.records
    chunks = [s for s in range(0, len(ids), 512) if s // 64 > block]
    groups = session.engine.compact.groups.shape[0]
    assert len(records) == lm.config.num_layers * len(chunks) * groups
    dense = config.prefill_dense_layer_num
    assert all(r.kept and r.rank is None for r in records if r.layer < dense)
    selected = [r for r in records if r.rank is not None]
    assert selected and any(not r.kept for r in selected)  # a count of 8 drops the answer somewhere
    for r in selected:
        if r.rank >= r.num_keep:
            assert not r.kept, r
        if r.rank + r.tied < r.num_keep:
            assert r.kept, r


@pytest.mark.slow
def test_masses_record_each_prompt_once_and_hold_shares(real_model):
    """Two prompts in one session, each watched: the second prompt's selected chunks are
    recorded once (the first watch, closed, no longer wraps the selector); every record's exact
    shares are a part of a softmax (non-negative, at most 1 over the history), its estimates a
    whole one, and its kept blocks the group's page list (keep_blocks, sinks and window among them)."""
    import numpy as np

    from ktlong.bench.kept_keys import KeyWatch, Masses
    from ktlong.chat.conversation import Conversation
    from ktlong.chat.generate import generate
    from ktlong.chat.sampling import Sampler
    from ktlong.config import default_config
    from ktlong.eval.tasks import make_sample
    from ktlong.session.long_context import LongContextSession
    from ktlong.session.plan import plan_session

    lm = real_model("smollm2-135m")
    config = default_config(mode="long_context", block_size=64, keep_blocks=8, chunk_size=512)
    plan = plan_session(config, lm.config, lm.weight_bytes, 4096, lm.model.device, lm.model.dtype)
    session = LongContextSession.from_plan(lm.model, plan)
    conversation = Conversation(lm.tokenizer, lm.chat_template)
    masses, counts = Masses(16, lm.model.scale), []
    for seed in range(2):
        sample = make_sample("passkey", 1200, 0.5, seed, lambda text: len(conversation.render_ids([], text)))
        ids = conversation.render_ids([], sample.prompt)
        session.reset()
        watch = KeyWatch(session.engine, [], lm.model.scale, masses)
        generate(session, ids, 1, Sampler(), lm.tokenizer.stop_ids, lm.tokenizer)
        watch.close()
        counts.append(len(masses.rows) - sum(counts))
    compact = [layer for layer in range(lm.config.num_layers) if layer >= config.prefill_dense_layer_num]
    chunks = len([s for s in range(512, len(ids), 512) if 8 <= config.dense_above * (s // 64)])  # the rest ran dense
    assert 0 < counts[0] == len(compact) * chunks * session.engine.compact.groups.shape[0] == counts[1], counts
    for (layer, start, group, num_hist), exact, estimate, kept in zip(masses.rows, *(masses.arrays[k] for k in (
            "exact", "estimate", "kept"))):
        assert num_hist == start // 64 and len(exact) == len(estimate) == len(kept) == num_hist
        exact, estimate = exact.astype(np.float64), estimate.astype(np.float64)
        assert exact.min() >= 0 and exact.sum() <= 1 + 1e-2  # float16 values
        assert abs(estimate.sum() - 1) < 1e-2
        assert kept.sum() == min(8, num_hist) and kept[0] == 1 and kept[-2:].all()  # sink and window
