"""response_format through the official `openai` client: every answer to 20 JSON schemas
(nested objects, enums, arrays, bounded numbers and strings) parses and validates against its
schema with jsonschema, whole and streamed; json_object gives an object; a schema that cannot be
enforced is refused in one sentence; the mask keeps exactly the tokens llguidance's bitmask allows."""

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from ktlong.server.__main__ import make_app
from tests.http_server import RunningServer, started

pytestmark = pytest.mark.slow  # loads a real model

MODEL = "smollm2-135m"
S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"]},
    {"type": "object", "properties": {"city": S, "country": S}, "required": ["city", "country"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10},
                                      "reason": S}, "required": ["score", "reason"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "label": S},
        "required": ["id", "label"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {
        "type": "integer", "minimum": 0, "maximum": 100}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "admin": {"type": "boolean"}}, "required": ["name", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
     "required": ["year"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"unit": {"const": "celsius"}, "value": {
        "type": "integer", "minimum": -40, "maximum": 50}}, "required": ["unit", "value"]},
    {"type": "object", "properties": {"first": S, "last": S, "middle": S}, "required": ["first", "last"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "count": {
        "type": "integer", "minimum": 0, "maximum": 1000}}, "required": ["status", "count"],
     "additionalProperties": False},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
     "required": ["flags"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100,
                                                "multipleOf": 0.5}}, "required": ["price"]},
    {"type": "object", "properties": {"lang": {"enum": ["en", "fr", "de"]}, "words": {"type": "array", "items": S,
                                                                                       "maxItems": 2}},
     "required": ["lang", "words"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
]


def closed(schema):
    """As OpenAI's strict mode writes schemas: no property besides those named."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


SCHEMAS = [closed(s) for s in SCHEMAS]


@pytest.fixture(scope="module")
def server(real_model):
    lm = real_model(MODEL)
    app, _ = make_app(started(lm, MODEL, max_new_tokens=120))
    s = RunningServer(app)
    yield s
    s.stop()


def ask(client, schema, stream=False, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Answer with JSON about Paris: " + json.dumps(schema)}]
    out = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, stream=stream, **kw)
    if not stream:
        return out.choices[0].message.content, out.choices[0].finish_reason
    pieces, finish = [], None
    for event in out:
        for c in event.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(pieces), finish


def test_every_answer_validates_against_its_schema(server):
    client = server.client()
    for i, schema in enumerate(SCHEMAS):
        text, finish = ask(client, schema, stream=i % 4 == 0, temperature=0.7 if i % 3 else 0.0, seed=i)
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_refusals(server):
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": (
        'Reply with exactly this JSON object: {"city": "Paris"}')}], response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
                {"type": "yaml"}, {"type": "json_schema"}):
        with pytest.raises(openai.BadRequestError, match="response_format|JSON schema"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=fmt)
    with pytest.raises(openai.BadRequestError, match="chat/completions"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"response_format": {"type": "json_object"}})


def test_the_mask_keeps_what_the_grammar_allows(real_model):
    import torch
    from llguidance import LLMatcher

    from ktlong.chat.constrained import JsonConstraint, json_grammar

    lm = real_model(MODEL)
    grammar = json_grammar(SCHEMAS[3])
    constraint = JsonConstraint(lm.tokenizer, grammar)
    reference = LLMatcher(lm.tokenizer.guidance, grammar)
    for token in lm.tokenizer.encode('{"colour":"green"}', add_bos=False):
        masked = constraint.mask(torch.zeros(lm.tokenizer.vocab_size + 3))
        bits = reference.compute_bitmask()  # bit t of the little-endian words: token t may follow
        allowed = [t for t in range(lm.tokenizer.vocab_size) if bits[t // 8] >> (t % 8) & 1]
        assert torch.nonzero(masked == 0).flatten().tolist() == allowed and masked[-3:].isinf().all()
        constraint.consume(token)
        reference.consume_token(token)
    assert constraint.done


def test_long_context_mode_keeps_to_the_schema(real_model):
    lm = real_model(MODEL)
    app, _ = make_app(started(lm, MODEL, mode="long_context", max_new_tokens=120, block_size=16, chunk_size=64,
                              local_windows_len=64, max_seq_len=2048))
    s = RunningServer(app)
    try:
        for i in (5, 8, 13):
            text, finish = ask(s.client(), SCHEMAS[i], stream=i == 8)
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMAS[i])
    finally:
        s.stop()
