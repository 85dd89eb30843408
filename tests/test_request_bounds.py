"""The server's inputs are bounded before the work on them (docs/server.md): a body by the tokens
it could hold, its arrival by a time-out and by a cap on the bytes all unfinished bodies hold, a
long text by a token count that stops where the context does; parameters it does not implement
are refused; a seed of 0 is a seed; JSON schemas that cannot be enforced get a 4xx; tools cannot
carry control tokens into the prompt."""

import asyncio
import http.client
import json
import logging
import socket
import time

import numpy as np
import pytest

from ktlong.chat.sampling import Sampler
from ktlong.gguf.chat_template import ChatTemplate
from ktlong.models.loader import load_model
from ktlong.server.__main__ import make_app
from ktlong.server.request_body import MAX_DEPTH, BodyLimits, read_json
from ktlong.server.prompt_ids import CHARS_PER_TOKEN_CHECKED, count_tokens
from ktlong.server.protocol import ApiError, Defaults, Prompting
from tests.http_server import RunningServer, started
from tests.tiny_gguf import TinySpec, write_tiny_gguf

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(), seed=1)
    return load_model(str(path))


@pytest.fixture
def prompting(tiny):
    return Prompting(tiny.tokenizer, ChatTemplate(None), "", 256, Defaults(16, 0.0, 1.0, 0, 0, 0.0, 0.0))


def chat(prompting, **fields):
    return prompting.chat_job({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


def refusal(call) -> ApiError:
    with pytest.raises(ApiError) as e:
        call()
    return e.value


class Arriving:
    """The part of a Starlette request BodyLimits reads: parts, each after a pause (None: the
    client disconnects there)."""

    def __init__(self, parts, pause=0.0, held: asyncio.Event | None = None):
        """held: the body ends only once it is set (it stays unfinished until then)."""
        self.parts, self.pause, self.held = parts, pause, held

    async def stream(self):
        from starlette.requests import ClientDisconnect

        for part in self.parts:
            await asyncio.sleep(self.pause)
            if part is None:
                raise ClientDisconnect()
            yield part
        if self.held is not None:
            await self.held.wait()


def test_seed_zero_is_a_seed(prompting):
    assert chat(prompting, seed=0).seed == 0
    assert chat(prompting, seed=0).seed == chat(prompting, seed=0).seed
    assert len({chat(prompting).seed for _ in range(5)}) == 5  # none: a fresh draw each time


@pytest.mark.parametrize("name, value", [
    ("ignore_eos", True), ("stop_token_ids", [2]), ("min_tokens", 4), ("max_new_tokens", 8), ("n_predict", 8),
    ("repeat_penalty", 1.1), ("mirostat", 2), ("tfs_z", 0.9), ("top_a", 0.1), ("length_penalty", 1.2),
    ("use_beam_search", True), ("a_field_nobody_defined", "x")])
def test_parameters_it_does_not_implement_are_refused(prompting, name, value):
    e = refusal(lambda: chat(prompting, **{name: value}))
    assert e.status == 400 and e.param == name and name in e.message


def test_fields_that_change_no_answer_and_off_values_are_taken(prompting):
    job = chat(prompting, user="u1", metadata={"a": "b"}, store=False, ignore_eos=False, stop_token_ids=[])
    assert job.prompt_ids == chat(prompting).prompt_ids


def test_a_temperature_near_zero_samples_the_likeliest_token():
    logits = np.array([0.5, 3.0, 2.9999, -1.0], np.float32)
    for temperature in (1e-300, 1e-308, 5e-324):
        probs = Sampler(temperature, 1.0, 0, 0).probabilities(logits)
        assert np.isfinite(probs).all() and probs[1] == 1.0
        assert Sampler(temperature, 0.5, 2, 7)(logits) == 1


@pytest.mark.parametrize("schema", [
    {"type": "array", "minItems": 2 ** 64}, {"type": "integer", "minimum": -1e30},
    {"type": "string", "pattern": "^(a{1000}){1000}$"}, {"$ref": "#"}, {"type": "integer", "minimum": 10 ** 400},
    {"type": "integer", "minimum": 8929548040361255, "maximum": 8929548040361254}, {"type": "string", "pattern": "("},
    # a POSIX class (llguidance: a letter; JSON Schema: one of "[:alph" then "]") and a set operation
    {"type": "string", "pattern": "[[:alpha:]]"}, {"type": "string", "pattern": "^[a-z&&[^b]]$"}])
def test_a_schema_that_cannot_be_enforced_is_a_400_before_the_answer(prompting, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    e = refusal(lambda: chat(prompting, response_format=fmt))
    assert e.status == 400 and e.param == "response_format" and e.message.endswith(".")


def test_a_body_that_stops_arriving_gets_a_408():
    limits = BodyLimits(1 << 20, 2 << 20, timeout=0.2)
    e = refusal(lambda: asyncio.run(limits.read(Arriving([b"{", b"}"], pause=0.5))))
    assert e.status == 408 and limits.in_flight == 0


def test_unfinished_bodies_together_hold_at_most_the_cap():
    limits = BodyLimits(1000, 2000, timeout=5)  # room for five of the six parts

    async def three_at_once():
        # each body stays unfinished after its parts until one of them is refused: whatever order
        # the parts come in, the sixth finds five (2,000 bytes) in flight
        held = asyncio.Event()
        reads = [asyncio.ensure_future(limits.read(Arriving([b"x" * 400, b"y" * 400], 0.05, held))) for _ in range(3)]
        await asyncio.wait(reads, timeout=10, return_when=asyncio.FIRST_COMPLETED)  # a cap that refuses none: 10 s
        held.set()
        return await asyncio.gather(*reads, return_exceptions=True)

    results = asyncio.run(three_at_once())
    refused = [r for r in results if isinstance(r, ApiError)]
    assert [r.status for r in refused] == [503] and sum(isinstance(r, bytes) for r in results) == 2
    assert limits.in_flight == 0  # what the refused body held is given back


def test_a_body_past_its_own_limit_is_a_413_and_a_deep_one_a_400():
    limits = BodyLimits(100, 1000, timeout=5)
    assert refusal(lambda: asyncio.run(limits.read(Arriving([b"x" * 60, b"x" * 60])))).status == 413
    deep = ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)).encode()
    body = b'{"a": ' + deep + b"}"
    e = refusal(lambda: asyncio.run(read_json(Arriving([body]), BodyLimits(1 << 20, 2 << 20, 5))))
    assert e.status == 400 and "nests deeper" in e.message


def test_a_client_that_disconnects_mid_body_is_no_error():
    e = refusal(lambda: asyncio.run(BodyLimits(1000, 1000, 5).read(Arriving([b"{", None]))))
    assert e.status == 499


def test_a_text_too_long_is_counted_only_until_it_passes_max_seq_len(prompting, monkeypatch):
    encoded = []
    encode = prompting.tokenizer.encode
    monkeypatch.setattr(prompting.tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or
                        encode(text, *a, **k))
    text = " ".join(str(i % 97) for i in range(200_000))  # 2.6 characters a token here, 578K characters
    assert len(text) > 256 * CHARS_PER_TOKEN_CHECKED
    e = refusal(lambda: prompting.completion_job({"model": MODEL, "prompt": text}))
    assert e.code == "context_length_exceeded"
    assert sum(encoded) < 70_000  # one piece of 64K characters, not the 578K of the whole
    assert count_tokens(prompting.tokenizer, [text[:5000]], 10 ** 9) == len(encode(text[:5000], add_bos=False,
                                                                                    parse_special=False))
    e = refusal(lambda: chat(prompting, messages=[{"role": "user", "content": text}]))
    assert e.code == "context_length_exceeded" and not prompting.texts.texts  # nothing of it remembered


def test_a_long_prompt_refused_after_encoding_is_not_remembered(tiny):
    prompting = Prompting(tiny.tokenizer, ChatTemplate(None), "", 6000, Defaults(16, 0.0, 1.0, 0, 0, 0.0, 0.0))
    text = " ".join(str(i % 97) for i in range(2800))  # about a character a token here: encoded whole
    e = refusal(lambda: chat(prompting, messages=[{"role": "user", "content": text}]))
    assert e.code == "context_length_exceeded" and not prompting.texts.texts
    chat(prompting, messages=[{"role": "user", "content": text[:5000]}])
    assert len(prompting.texts.texts) == 1  # one that fits is remembered


@pytest.fixture(scope="module")
def keyed_server(tiny):
    app, _ = make_app(started(tiny, MODEL, max_new_tokens=4, max_seq_len=256, api_key="k3y",
                              body_timeout_seconds=1.0))
    s = RunningServer(app)
    yield s
    s.stop()


def test_metrics_ask_for_the_key_and_health_does_not(keyed_server):
    assert keyed_server.raw("GET", "/metrics")[0] == 401
    status, data = keyed_server.raw("GET", "/metrics", headers={"Authorization": "Bearer k3y"})
    assert status == 200 and b"ktlong_" in data
    status, data = keyed_server.raw("GET", "/health")
    assert status == 200 and json.loads(data)["status"] == "ok"


def test_a_temperature_of_1e_308_answers_as_greedy(keyed_server):
    def answer(temperature):
        body = {"model": MODEL, "prompt": "a b c", "temperature": temperature, "max_tokens": 4}
        status, data = keyed_server.raw("POST", "/v1/completions", json.dumps(body),
                                        {"Authorization": "Bearer k3y", "Content-Type": "application/json"})
        assert status == 200, data
        return json.loads(data)["choices"][0]["text"]

    assert answer(1e-308) == answer(0)


def test_slow_and_vanishing_clients_get_no_traceback_in_the_log(keyed_server, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(logging.getLogger("uvicorn"), "handlers", [caplog.handler])  # uvicorn's own don't propagate
    for _ in range(3):  # a client that goes away half way through its body
        with socket.create_connection(("127.0.0.1", keyed_server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
            time.sleep(0.2)
    conn = http.client.HTTPConnection("127.0.0.1", keyed_server.port, timeout=10)  # one that stalls
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("Authorization", "Bearer k3y"), ("Content-Type", "application/json"),
                        ("Content-Length", "1000")):
        conn.putheader(name, value)
    conn.endheaders(b'{"model"')
    response = conn.getresponse()
    assert response.status == 408 and json.loads(response.read())["error"]["code"] == "body_timeout"
    conn.close()
    time.sleep(0.3)
    assert keyed_server.health()["status"] == "ok"
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged
