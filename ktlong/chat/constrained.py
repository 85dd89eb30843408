"""Sampling held to a JSON schema by llguidance: before each token, every token that would take
the answer off the grammar is masked out of the logits; after it, the token is consumed.

llguidance (rather than xgrammar, measured in docs/decisions.md): one dependency-free wheel that
builds its tokenizer from the `tokenizers` object the GGUF tokenizer already is
(ktlong/gguf/tokenizer.py), starts a new schema in about a millisecond, and takes the JSON
schema itself.
"""

from __future__ import annotations

import numpy as np
import torch

from ktlong.errors import KtlongError

ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
_BITS = torch.arange(32, dtype=torch.int32)  # bit i of a word: token 32 * word + i


def json_grammar(schema: dict) -> str:
    """The grammar of answers valid under schema, checked; KtlongError names what llguidance
    cannot take. No free whitespace between JSON tokens: an answer cannot run on in spaces."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    error = LLMatcher.validate_grammar(grammar)  # empty when valid
    if error:
        raise KtlongError(f"The JSON schema cannot be enforced ({error[:300]}).")
    return grammar


class JsonConstraint:
    def __init__(self, tokenizer, grammar: str):
        from llguidance import LLMatcher

        self.vocab = tokenizer.vocab_size
        self.matcher = LLMatcher(tokenizer.guidance, grammar)
        if self.matcher.is_error():
            raise KtlongError(f"The JSON schema cannot be enforced ({self.matcher.get_error()[:300]}).")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with every token the grammar forbids at -inf (a copy). The bitmask
        (one bit a token, little-endian 32-bit words) goes to the logits' device packed, 4 KB
        for 128K tokens, and is unpacked there: no host sync, no index list."""
        words = torch.from_numpy(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32).copy())
        words = words.to(logits.device, non_blocking=True)
        allowed = ((words[:, None] >> _BITS.to(logits.device)) & 1).view(-1).bool()
        keep = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        n = min(self.vocab, allowed.shape[0])
        keep[:n] = allowed[:n]
        return logits.masked_fill(~keep, float("-inf"))

    def consume(self, token: int):
        if not self.matcher.consume_token(token):
            raise KtlongError(f"token {token} is outside the grammar ({self.matcher.get_error()[:200]})")

    @property
    def done(self) -> bool:
        """The answer is complete: nothing but the end may follow."""
        return self.matcher.is_stopped()

