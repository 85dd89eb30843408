"""On the GPU, the server with a real model: Qwen2.5-Coder-0.5B with YaRN x4 (131,072 tokens),
three documents of about 120K tokens, eight clients (a question each, asked before its
document, so that a conversation's cache serves only its own client), through the official
`openai` client. Each conversation is prefilled once and kept in DRAM (the cache of many
documents); then every client asks alone, one after another, and then all eight at once. Each
comes back from DRAM the same way both times (its last prompt token computed again), so the
one difference is the batch: eight streams decoding together, joining as their caches come
back. Every answer equals the answer the client got alone."""

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvicorn")  # the server's dependencies, not every machine's
pytest.importorskip("openai")

from ktlong.config import default_config
from ktlong.server.__main__ import make_app
from ktlong.session.startup import start
from tests.http_server import RunningServer
from tests.test_gpu_real_batch import DOCS, LINES, document

pytestmark = pytest.mark.gpu

ANSWER = 32
ASKERS = ("Amira", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro")


def prompt(lm, i: int) -> list[int]:
    record = f"{DOCS[i]}-{(i * 419 + 77) % LINES:05d}"
    question = f"{ASKERS[i]} asks: how many crates did the barge of record {record} carry, and of what?"
    return lm.tokenizer.encode(lm.chat_template.render(
        [{"role": "user", "content": f"{question}\n\n{document(DOCS[i])}\n\nAgain: {question}"}]))


def test_eight_clients_over_three_long_documents_get_the_answers_each_gets_alone(qwen_path, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    config = default_config(model=str(qwen_path), mode="long_context", device="cuda", rope_scaling="yarn",
                            rope_scale=4.0, kv_type="q8_0", max_num_seqs=8, cache_dram_gb=16)
    st = start(config)
    prompts = [prompt(st.lm, i) for i in range(len(DOCS))]
    assert all(115_000 < len(p) < 125_000 for p in prompts)
    session = st.session
    batches, step_batch = [], session.step_batch
    session.step_batch = lambda conversations, tokens, *beside: (batches.append(len(conversations)),
                                                        step_batch(conversations, tokens, *beside))[1]
    app, _ = make_app(st)
    server = RunningServer(app)
    client = server.client(timeout=600)
    model_id = client.models.list().data[0].id

    def ask(i: int, tokens: int):
        r = client.completions.create(model=model_id, prompt=prompts[i], max_tokens=tokens, temperature=0)
        return r.choices[0].text, r.usage

    try:
        for i in range(len(DOCS)):  # each prefilled once; every conversation stays in DRAM
            assert ask(i, 1)[1].prompt_tokens_details.cached_tokens == 0
        alone = []
        for i in range(len(DOCS)):
            text, usage = ask(i, ANSWER)
            assert usage.prompt_tokens_details.cached_tokens == len(prompts[i]) - 1
            alone.append(text)
        assert max(batches, default=1) == 1  # one at a time: every step was one conversation's
        batches.clear()
        with ThreadPoolExecutor(len(DOCS)) as pool:
            together = list(pool.map(lambda i: ask(i, ANSWER), range(len(DOCS))))
        for i, (text, usage) in enumerate(together):
            assert usage.prompt_tokens_details.cached_tokens == len(prompts[i]) - 1
            assert text == alone[i], (i, alone[i], text)
        assert max(batches) >= 4, batches  # the streams decoded together
    finally:
        server.stop()
