"""Property-based fuzzing (Hypothesis, fixed seeds and bounded example counts, so CI is
deterministic and quick): whatever a client, a config file or a damaged cache file holds, the
answer is a value or one sentence, never a traceback, a 5xx or a wrong cache."""

import asyncio
import json
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from ktlong.config import ConfigError, load_config, option_names
from ktlong.gguf.chat_template import ChatTemplate
from ktlong.models.loader import load_model
from ktlong.server.app import read_json
from ktlong.server.protocol import ApiError, Defaults, Job, Prompting, check_model
from ktlong.session.saved_cache import CacheFileError, load_cache, save_cache
from tests.test_saved_cache import FP, TURNS, prompt, same_cache, session_for
from tests.tiny_gguf import TinySpec, tiny_model, write_tiny_gguf

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MODEL_ID = "tiny"
REQUEST_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                  "top_k", "seed", "stop", "stream", "stream_options", "n", "tools", "tool_choice", "logprobs",
                  "presence_penalty", "response_format", "best_of", "echo", "min_p"]

texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)  # JSON carries no surrogates
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) |
                           st.floats(allow_nan=False, allow_infinity=False) | texts,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                           max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                           "content": texts | json_values}), max_size=3)
bodies = st.fixed_dictionaries({}, optional={
    **{name: json_values for name in REQUEST_FIELDS},
    "model": st.just(MODEL_ID) | json_values, "messages": messages | json_values,
    "prompt": texts | st.lists(st.integers(-5, 400), max_size=5) | json_values})


@pytest.fixture(scope="module")
def prompting(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(), seed=1)
    lm = load_model(str(path))
    return Prompting(lm.tokenizer, ChatTemplate(None), "", 256, Defaults(16, 0.0, 1.0, 0, 0))


class Body:
    """The part of a Starlette request read_json uses: the body, in two pieces."""

    def __init__(self, data: bytes):
        self.data = data

    async def stream(self):
        yield self.data[: len(self.data) // 2]
        yield self.data[len(self.data) // 2:]


def answer(prompting, data: bytes, kind: str):
    """What the server does with a body before the model: a Job, or an ApiError it sends."""
    try:
        body = asyncio.run(read_json(Body(data), 1 << 20))
        check_model(body, MODEL_ID)
        return (prompting.chat_job if kind == "chat" else prompting.completion_job)(body)
    except ApiError as e:
        return e


@FUZZ
@given(body=bodies, kind=st.sampled_from(["chat", "completion"]))
def test_any_json_request_is_a_job_or_a_4xx_never_a_5xx(prompting, body, kind):
    got = answer(prompting, json.dumps(body).encode(), kind)
    if isinstance(got, ApiError):
        assert 400 <= got.status < 500 and got.message.endswith(".")
    else:
        assert isinstance(got, Job) and 0 < len(got.prompt_ids) < 256 and got.max_tokens >= 1
        assert math.isfinite(got.temperature) and 0 < got.top_p <= 1


@FUZZ
@given(data=st.binary(max_size=300) | bodies.map(lambda b: json.dumps(b).encode()).flatmap(
    lambda raw: st.integers(0, max(0, len(raw) - 1)).map(lambda i: raw[:i] + b"\xff" + raw[i + 1:])))
def test_any_bytes_are_a_job_or_a_4xx(prompting, data):
    got = answer(prompting, data, "chat")
    assert isinstance(got, Job) or 400 <= got.status < 500


yaml_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=8)


@FUZZ
@given(options=st.dictionaries(st.sampled_from(option_names()) | texts, yaml_values, max_size=4),
       raw=st.none() | st.text(max_size=200))
def test_any_yaml_under_any_key_loads_or_is_one_sentence(tmp_path, monkeypatch, options, raw):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    path = tmp_path / "fuzz.yaml"
    path.write_text(raw if raw is not None else yaml.safe_dump(options, allow_unicode=True))
    try:
        config = load_config(str(path), write_user_file=False)
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message.strip() and len(message) < 1000
    else:  # every value as the file gave it (an int where a float is declared widened), and finite
        for name, value in (options.items() if raw is None else ()):
            assert getattr(config, name) == ("" if value is None else value)
        for name in option_names():
            value = getattr(config, name)
            assert not (isinstance(value, float) and not math.isfinite(value))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache")
    lm = tiny_model(folder, TinySpec(num_layers=2, hidden=128, head_dim=32), seed=8)
    session = session_for(lm)
    session.prefill(prompt(70))
    path = folder / "c.kv"
    save_cache(path, session, FP, TURNS)
    session.prefill(session.ids + prompt(20, seed=3))
    save_cache(path, session, FP, TURNS)  # appends a record: damage can hit either
    return lm, session, path.read_bytes()


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cut=st.none() | st.integers(0, 1 << 22), flips=st.lists(st.tuples(st.integers(0, 1 << 22), st.integers(0, 7)),
                                                                 max_size=3),
       tail=st.binary(max_size=64))
def test_a_damaged_cache_file_is_refused_or_loads_as_saved(saved, tmp_path, cut, flips, tail):
    lm, original, data = saved
    damaged = bytearray(data[:cut % (len(data) + 1)] if cut is not None else data)
    for at, bit in flips:
        if damaged:
            damaged[at % len(damaged)] ^= 1 << bit
    path = tmp_path / "damaged.kv"
    path.write_bytes(bytes(damaged) + tail)
    session = session_for(lm)
    try:
        turns = load_cache(path, session, FP)
    except CacheFileError as e:
        assert "\n" not in str(e) and session.host.num_tokens == 0
        return
    # loaded: the whole save, or the one before an append the damage cut; never anything else
    assert [tuple(t) for t in turns] == TURNS
    if session.host.num_tokens == original.host.num_tokens:
        same_cache(session, original)
    else:
        assert session.ids == original.ids[:session.host.num_tokens]
