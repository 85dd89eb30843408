"""On the GPU, a real model: Qwen2.5-Coder-0.5B with YaRN x4 (131,072 tokens), three documents of
about 120K tokens, eight conversations over them (questions of their own), each prefilled as the
server does (a conversation over a document another holds shares its blocks, one copy in DRAM).
Decoded together in one batch, each conversation's answer is the one it gets decoded alone after
the same prefill. (A full prefill of each prompt instead may split a near tie otherwise: the
shared tokens are where the follow-up's chunks begin.)"""

import pytest
import torch

from ktlong.config import default_config
from ktlong.kv.host_cache import HostKVCache
from ktlong.session.startup import start

pytestmark = pytest.mark.gpu

LINES = 3500  # about 34 tokens each: 119K tokens a document
ANSWER = 24
PLACES = ("Kessa", "Odrin", "Vlatna", "Pellow")
GOODS = ("salt", "tin", "rye", "wool", "glass")
DOCS = (0, 1, 2, 0, 1, 2, 0, 1)  # each conversation's document


def document(d: int) -> str:
    return "\n".join(f"Record {d}-{n:05d}: the barge {PLACES[(n + d) % 4]} {n * 37 % 1000} carried "
                     f"{(n + 11 * d) * 7919 % 9973} crates of {GOODS[(n + d) % 5]} past lock {n % 41}."
                     for n in range(LINES))


def prompt(lm, i: int) -> list[int]:
    record = f"{DOCS[i]}-{(i * 419 + 77) % LINES:05d}"
    question = f"How many crates did the barge of record {record} carry, and of what?"
    return lm.tokenizer.encode(lm.chat_template.render(
        [{"role": "user", "content": f"{document(DOCS[i])}\n\n{question}"}]))


def greedy(logits: torch.Tensor) -> int:
    return int(logits.float().argmax())


def test_eight_conversations_over_three_long_documents_answer_as_each_alone(qwen_path):
    config = default_config(model=str(qwen_path), mode="long_context", device="cuda", rope_scaling="yarn",
                            rope_scale=4.0, kv_type="q8_0", max_num_seqs=8)
    st = start(config)
    lm, session = st.lm, st.session
    assert st.max_seq_len == 131072
    prompts = [prompt(lm, i) for i in range(len(DOCS))]
    assert all(115_000 < len(p) < 125_000 for p in prompts)

    def prefill(i, held):
        """Conversation i prefilled as the server does: sharing the blocks of an earlier
        conversation over its document -> its first token, the tokens shared."""
        source = next((c for j, c in enumerate(held) if DOCS[j] == DOCS[i]), None)
        shared = session.share(source, prompts[i]) if source is not None else 0
        return greedy(session.prefill(prompts[i])), shared

    def leave():
        return session.detach(HostKVCache(session.layout, pin=True))

    # each decoded alone, then out of the session (its blocks for the next) and parked as the
    # server's cache store parks an answer that is done: its decoder's device anchors go when
    # the conversations decoded together below need the room (the pool holds max_num_seqs')
    alone, held = [], []
    for i in range(len(DOCS)):
        tokens = [prefill(i, held)[0]]
        while len(tokens) < ANSWER:
            tokens.append(greedy(session.step(tokens[-1])))
        alone.append(tokens)
        held.append(leave())
        session.park(held[-1])
    session.reset()

    conversations, first, shared = [], [], []  # the same, decoded together
    for i in range(len(DOCS)):
        token, n = prefill(i, conversations)
        first.append(token)
        shared.append(n)
        conversations.append(session.conversation if i == len(DOCS) - 1 else leave())
    assert all(n >= 110_000 for n in shared[3:]) and shared[:3] == [0, 0, 0]
    assert conversations[6].host.shared is conversations[0].host.shared
    together = [[t] for t in first]
    for _ in range(ANSWER - 1):
        logits = session.step_batch(conversations, [t[-1] for t in together])
        for row, tokens in zip(logits, together):
            tokens.append(greedy(row))
    texts = [lm.tokenizer.decode(t) for t in alone]
    print("\n".join(texts))
    for i in range(len(DOCS)):
        assert together[i] == alone[i], (i, texts[i], lm.tokenizer.decode(together[i]))
