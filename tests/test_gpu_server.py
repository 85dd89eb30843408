"""The server on the GPU: long-context mode with CUDA graphs captured and replayed on the worker
thread answers what the same session type answers in the test's thread."""

import json

import pytest
import torch

pytest.importorskip("uvicorn")  # the server's dependencies, not every machine's (tests/test_server.py: openai)
pytest.importorskip("starlette")

from ktlong.chat.generate import generate
from ktlong.chat.sampling import Sampler
from ktlong.models.loader import load_model
from ktlong.server.__main__ import make_app
from tests.http_server import RunningServer, started
from tests.tiny_gguf import TinySpec, write_tiny_gguf

pytestmark = pytest.mark.gpu


def test_long_context_server_on_the_gpu_answers_as_a_session_does(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=2, hidden=256, intermediate=512, head_dim=64, context=4096), seed=3)
    lm = load_model(str(path), "cuda", torch.bfloat16)
    options = dict(mode="long_context", block_size=64, chunk_size=256, local_windows_len=256, max_new_tokens=12)
    prompt = [int(t) for t in torch.randint(0, 300, (900,), generator=torch.Generator().manual_seed(1))]
    reference = started(lm, path, **options).session
    assert reference.use_cuda_graph
    expected = [generate(reference, prompt, 12, Sampler(), lm.tokenizer.stop_ids, lm.tokenizer)
                for _ in range(2)]  # the second time from the cache (one token prefilled)
    assert reference.last_prefill_tokens == 1
    del reference
    app, _ = make_app(started(lm, path, **options))
    server = RunningServer(app)
    try:
        for want in expected:
            status, data = server.raw("POST", "/v1/completions", json.dumps(
                {"model": "tiny", "prompt": prompt, "max_tokens": 12}), {"Content-Type": "application/json"})
            assert status == 200, data
            body = json.loads(data)
            assert body["choices"][0]["text"] == want.text
            assert body["usage"]["completion_tokens"] == len(want.token_ids)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    finally:
        server.stop()


def test_concurrent_requests_on_the_gpu_decode_together_and_answer_as_alone(tmp_path, monkeypatch):
    """Four clients at once with max_num_seqs 4: steps decode several conversations through one
    captured batch, prefills run between them, and each answer equals that prompt's answer from
    the same kind of session alone (greedy, bf16: the batch's rows are the rows alone)."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=2, hidden=256, intermediate=512, head_dim=64, context=4096), seed=3)
    lm = load_model(str(path), "cuda", torch.bfloat16)
    options = dict(mode="long_context", block_size=64, chunk_size=256, local_windows_len=256, max_new_tokens=16,
                   kv_type="q8_0", cache_min_tokens=64)
    g = torch.Generator().manual_seed(2)
    prompts = [[int(t) for t in torch.randint(0, 300, (n,), generator=g)] for n in (900, 1300, 700, 1600)]
    reference = started(lm, path, **options).session
    expected = [generate(reference, p, 16, Sampler(), lm.tokenizer.stop_ids, lm.tokenizer).text for p in prompts]
    del reference
    app, _ = make_app(started(lm, path, max_num_seqs=4, prefill_slice_ms=5, **options))
    session = app.state.worker.session
    rows, step_batch = [], session.step_batch
    session.step_batch = lambda conversations, tokens, *beside: (rows.append(len(conversations)),
                                                        step_batch(conversations, tokens, *beside))[1]
    server = RunningServer(app)

    def ask(prompt):
        status, data = server.raw("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": prompt, "max_tokens": 16}), {"Content-Type": "application/json"})
        assert status == 200, data
        return json.loads(data)["choices"][0]["text"]

    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
        assert got == expected
        assert max(rows) > 1
    finally:
        server.stop()
