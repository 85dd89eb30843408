"""Structured output on the GPU: long-context decode replayed from CUDA graphs, its logits masked
by the JSON grammar before each token. Every token must be one llguidance's own matcher allows
at that point, and each answer must parse and keep to its schema (checked field by field)."""

import json

import pytest
import torch

pytest.importorskip("llguidance")

from ktlong.chat.constrained import JsonConstraint, json_grammar
from ktlong.chat.generate import generate
from ktlong.chat.sampling import Sampler
from ktlong.models.loader import load_model
from tests.http_server import started
from tests.tiny_gguf import TinySpec, write_tiny_gguf

pytestmark = pytest.mark.gpu

SCHEMAS = [
    ({"type": "object", "additionalProperties": False, "required": ["colour", "n"],
      "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": -5, "maximum": 5}}},
     lambda v: v["colour"] in ("red", "green", "blue") and -5 <= v["n"] <= 5 and set(v) == {"colour", "n"}),
    ({"type": "object", "additionalProperties": False, "required": ["tags"],
      "properties": {"tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}}}},
     lambda v: set(v) == {"tags"} and len(v["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 6 for t in v["tags"])),
    ({"type": "object", "additionalProperties": False, "required": ["ok", "point"],
      "properties": {"ok": {"type": "boolean"}, "point": {
          "type": "object", "additionalProperties": False, "required": ["x"],
          "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
     lambda v: isinstance(v["ok"], bool) and set(v["point"]) == {"x"} and 0 <= v["point"]["x"] <= 99),
]


class CheckedConstraint(JsonConstraint):
    """Asks llguidance's own matcher, fed the same tokens, whether each sampled token may come."""

    def __init__(self, tokenizer, grammar):
        from llguidance import LLMatcher

        super().__init__(tokenizer, grammar)
        self.reference = LLMatcher(tokenizer.guidance, grammar)

    def consume(self, token: int):
        bits = self.reference.compute_bitmask()
        assert bits[token // 8] >> (token % 8) & 1, f"token {token} is outside the grammar"
        assert self.reference.consume_token(token)
        super().consume(token)


def test_answers_keep_to_their_schemas_with_cuda_graphs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=2, hidden=256, intermediate=512, head_dim=64, context=4096), seed=5)
    lm = load_model(str(path), "cuda", torch.bfloat16)
    session = started(lm, path, mode="long_context", block_size=64, chunk_size=256, local_windows_len=256).session
    assert session.use_cuda_graph and session.layout.capacity > 1200
    prompt = [int(t) for t in torch.randint(0, 250, (1000,), generator=torch.Generator().manual_seed(2))]
    for i, (schema, keeps) in enumerate(SCHEMAS):
        for temperature in (0.0, 1.0):  # greedy, and sampled over what the mask leaves
            constraint = CheckedConstraint(lm.tokenizer, json_grammar(schema))
            gen = generate(session, prompt, 200, Sampler(temperature, seed=i), lm.tokenizer.stop_ids,
                           lm.tokenizer, constraint=constraint)
            assert gen.finish_reason == "stop" and constraint.done, gen.text
            assert session.decoder.body.capturing  # the steps replayed CUDA graphs
            assert keeps(json.loads(gen.text)), gen.text
            session.reset()
