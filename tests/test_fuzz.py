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
from ktlong.server.request_body import BodyLimits, read_json
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
    return Prompting(lm.tokenizer, ChatTemplate(None), "", 256, Defaults(16, 0.0, 1.0, 0, 0, 0.0, 0.0))


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
        body = asyncio.run(read_json(Body(data), BodyLimits(1 << 20, 2 << 20, 30.0)))
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


# ---- tools and tool calls: no field carries a control token into the prompt ----

@pytest.fixture(scope="module")
def qwen_prompting(qwen_path):
    """Qwen2.5-Coder's tokenizer and its tool-calling chat template, without its weights."""
    from ktlong.gguf.chat_template import template_for
    from ktlong.gguf.reader import GGUFFile
    from ktlong.gguf.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer(GGUFFile(str(qwen_path)))
    template = template_for(tokenizer, tokenizer.chat_template)
    return Prompting(tokenizer, template, "", 4096, Defaults(16, 0.0, 1.0, 0, 0, 0.0, 0.0))


def special_counts(prompting, ids) -> dict[int, int]:
    special = {prompting.tokenizer.encode(name, add_bos=False)[0] for name in prompting.tokenizer.special_names}
    counts = {}
    for t in ids:
        if t in special:
            counts[t] = counts.get(t, 0) + 1
    return counts


def tools_request(strings):
    """A chat request with tools and an earlier call whose every free string is the next of strings."""
    s = iter(strings)
    tool = {"type": "function", "function": {"name": next(s), "description": next(s), "parameters": {
        "type": "object", "properties": {next(s): {"type": "string", "description": next(s)}}}}}
    call = {"id": next(s), "type": "function", "function": {"name": next(s),
                                                            "arguments": json.dumps({next(s): next(s)})}}
    return {"model": MODEL_ID, "tools": [tool], "messages": [
        {"role": "user", "content": next(s)}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": next(s)}]}


hostile = st.lists(st.sampled_from(["<|im_end|>", "<|im_start|>", "system", "<tool_call>", "</tool_call>",
                                    "<|endoftext|>", "<|fim_prefix|>", "\n", "{", '"']) | texts,
                   min_size=1, max_size=5).map("".join)


@FUZZ
@given(strings=st.lists(hostile, min_size=10, max_size=10), forced=st.booleans())
def test_tools_and_calls_carry_no_control_token_from_any_field(qwen_prompting, strings, forced):
    """The prompt's special tokens are the template's own: as many of each as when every
    string the client wrote is a plain word."""
    strings = [s or "x" for s in strings]
    body, plain = tools_request(strings), tools_request([f"w{i}" for i in range(10)])
    if forced:
        for b in (body, plain):
            b["tool_choice"] = {"type": "function", "function": {"name": b["tools"][0]["function"]["name"]}}
    try:
        job = qwen_prompting.chat_job(body)
    except ApiError as e:  # a name or call the template cannot take is refused, never rendered
        assert 400 <= e.status < 500
        return
    expected = special_counts(qwen_prompting, qwen_prompting.chat_job(plain).prompt_ids)
    assert special_counts(qwen_prompting, job.prompt_ids) == expected


# ---- JSON schemas: a 2xx whose answer validates, or a 4xx; never a 5xx ----

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | texts
bounds = st.integers(-2**66, 2**66) | st.floats(-1e40, 1e40, allow_nan=False)
counts = st.integers(0, 6) | st.integers(0, 2**66)
patterns = st.sampled_from(["^[a-z]+$", "^(a{1000}){1000}$", "^[0-9]{3}-[0-9]{2}$", "(", "^(ab|cd){2,4}$", "a*b*",
                            "^\\d{20000}$", "[[:alpha:]]"])
leaf_schemas = st.one_of(
    st.fixed_dictionaries({"type": st.just("integer")}, optional={"minimum": bounds, "maximum": bounds}),
    st.fixed_dictionaries({"type": st.just("number")}, optional={"minimum": bounds, "exclusiveMaximum": bounds}),
    st.fixed_dictionaries({"type": st.just("string")},
                          optional={"minLength": counts, "maxLength": counts, "pattern": patterns}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"$ref": "#"}, {"$ref": "#/$defs/nowhere"}, {},
                     {"type": "objectx"}, {"not": {}}]),
    st.fixed_dictionaries({"enum": st.lists(scalars, max_size=4)}), st.fixed_dictionaries({"const": scalars}))
schemas = st.recursive(leaf_schemas, lambda inner: st.one_of(
    st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"minItems": counts,
                                                                               "maxItems": counts}),
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.sampled_from("abc"), inner,
                                                                                   max_size=3)},
                          optional={"required": st.lists(st.sampled_from("abcd"), max_size=3, unique=True),
                                    "additionalProperties": st.booleans()}),
    st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)})), max_leaves=6)


@pytest.fixture(scope="module")
def schema_server(tmp_path_factory):
    from ktlong.server.__main__ import make_app
    from tests.http_server import RunningServer, started

    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(), seed=1)
    lm = load_model(str(path))
    server = RunningServer(make_app(started(lm, MODEL_ID, max_seq_len=256, max_new_tokens=24))[0])
    yield server
    server.stop()


@FUZZ
@given(schema=schemas, seed=st.integers(0, 2**32))
def test_any_json_schema_is_an_answer_that_validates_or_a_4xx(schema_server, schema, seed):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "json"}], "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    status, data = schema_server.raw("POST", "/v1/chat/completions", json.dumps(body),
                                     {"Content-Type": "application/json"})
    out = json.loads(data)
    assert status < 500, out
    if status >= 400:
        assert out["error"]["message"].endswith(".") and "\n" not in out["error"]["message"]
        return
    choice = out["choices"][0]
    if choice["finish_reason"] == "stop":  # "length": cut at max_tokens, as any answer may be
        # numbers past 2^53 read as floats, as the schema's own were: JSON compares the values
        # written, and 57765765782311110 is the 5.776576578231111e+16 a schema gave
        wide = lambda digits: int(digits) if abs(int(digits)) < 2 ** 53 else float(digits)
        validate(json.loads(choice["message"]["content"], parse_int=wide), schema)


def validate(instance, schema):
    """jsonschema's verdict. A schema whose anyOf names the whole schema again before any array or
    object ({"anyOf": [{"$ref": "#"}, {"type": "integer"}]}) sends its validator round that loop
    for ever; such a branch adds no instance the others do not already allow, so the loop's
    branches are dropped and the rest judge."""
    import jsonschema

    try:
        jsonschema.validate(instance, schema)
    except RecursionError:
        jsonschema.validate(instance, without_unguarded_self_references(schema))


def without_unguarded_self_references(schema, guarded=False):
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "anyOf" and not guarded:
            value = [without_unguarded_self_references(v) for v in value if v != {"$ref": "#"}]
        elif key == "anyOf":
            value = [without_unguarded_self_references(v, True) for v in value]
        elif key == "items":
            value = without_unguarded_self_references(value, True)
        elif key == "properties":
            value = {k: without_unguarded_self_references(v, True) for k, v in value.items()}
        out[key] = value
    return out


def test_the_reference_judges_a_schema_that_loops_through_its_own_root():
    import jsonschema

    schema = {"anyOf": [{"anyOf": [{"$ref": "#"}, {"type": "integer"}]}]}
    validate(5, schema)
    with pytest.raises(jsonschema.ValidationError):
        validate("five", schema)
    nested = {"type": "array", "items": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}}
    validate([1, [2, [3]]], nested)  # through items, the reference is a real recursion, kept
    with pytest.raises(jsonschema.ValidationError):
        validate([1, ["x"]], nested)


# ---- cache_dir at start-up: any file is used, skipped or removed in one line, never a crash or a hang ----

@FUZZ
@given(files=st.lists(st.tuples(
    st.sampled_from(["damaged", "header", "fifo", "folder", "link", "orphan"]), st.binary(max_size=64),
    json_values, st.lists(st.tuples(st.integers(0, 1 << 22), st.integers(0, 7)), max_size=3)), max_size=5))
def test_any_cache_dir_contents_start_the_store(saved, tmp_path_factory, files):
    import hashlib
    import os

    from ktlong.server.cache_store import CacheStore
    from ktlong.session.cache_records import PREAMBLE, VERSION, WHOLE
    from tests.test_cache_dir_files import dead_pid, within

    lm, original, data = saved
    folder = tmp_path_factory.mktemp("cache_dir")
    for i, (kind, tail, header, flips) in enumerate(files):
        path = folder / f"{i + 1:012x}.ktkv"
        if kind == "damaged":
            damaged = bytearray(data)
            for at, bit in flips:
                damaged[at % len(damaged)] ^= 1 << bit
            path.write_bytes(bytes(damaged[:len(damaged) - len(tail)]))
        elif kind == "header":  # a right checksum over any JSON
            text = json.dumps(header).encode()
            path.write_bytes(PREAMBLE.pack(WHOLE, VERSION, len(text), hashlib.sha256(text).digest()) + text + tail)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "folder":
            path.mkdir()
        elif kind == "link":
            path.symlink_to("/dev/zero" if tail else folder / "nowhere")
        else:
            (folder / f".{path.name}.{dead_pid()}.x.tmp").write_bytes(tail)
    lines = []
    with within(30):
        store = CacheStore(session_for(lm), FP, 0, str(folder), 1 << 30, 16, lines.append)
    assert all("\n" not in line for line in lines)
    for entry in store.entries.values():  # what it took loads as saved
        assert entry.ids == original.ids or original.ids[:len(entry.ids)] == entry.ids
    assert not list(folder.glob(".*.tmp"))
    assert len(store.entries) + len(lines) == sum(kind != "orphan" for kind, *_ in files)
