"""Sampling held to a JSON schema by llguidance: before each token, every token that would take
the answer off the grammar is masked out of the logits; after it, the token is consumed.

llguidance (rather than xgrammar, measured in docs/decisions.md): one dependency-free wheel that
builds its tokenizer from the `tokenizers` object the GGUF tokenizer already is
(ktlong/gguf/tokenizer.py), starts a new schema in about a millisecond, and takes the JSON
schema itself.
"""

from __future__ import annotations

import re._parser
import warnings

import numpy as np
import torch

from ktlong.errors import KtlongError

ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
_BITS = torch.arange(32, dtype=torch.int32)  # bit i of a word: token 32 * word + i
# a pattern whose shortest match is longer than this is refused: llguidance's lexer builds one
# expression per counted repetition and gives up part way through the answer ("^(a{1000}){1000}$")
MAX_PATTERN_WIDTH = 10_000
# numeric bounds llguidance enforces exactly: at 16 digits and more, 4 of 80 were off by one
# (minimum 8929548040361255 let 8929548040361254 through)
MAX_BOUND = 10 ** 15
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
DATA = ("const", "enum", "default", "examples")  # values, not schemas: their keys mean nothing here


class SchemaError(KtlongError):
    """A JSON schema that cannot be enforced: found before the answer starts, or (past
    llguidance's limits) while it is written."""


def json_grammar(schema: dict, tokenizer=None) -> str:
    """The grammar of answers valid under schema, checked; SchemaError names what llguidance
    cannot take. No free whitespace between JSON tokens: an answer cannot run on in spaces.
    tokenizer: a GGUFTokenizer, to check also that the grammar admits an answer at all."""
    from llguidance import LLMatcher

    _check_values(schema)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except Exception as e:  # llguidance's own checks raise ValueError, RuntimeError, TypeError ...
        raise SchemaError(f"The JSON schema cannot be enforced ({one_line(str(e))}).") from None
    error = LLMatcher.validate_grammar(grammar)  # empty when valid
    if error:
        raise SchemaError(f"The JSON schema cannot be enforced ({one_line(error)}).")
    if tokenizer is not None:
        matcher = JsonConstraint(tokenizer, grammar).matcher
        matcher.compute_bitmask()
        if matcher.is_error() or matcher.is_stopped():  # {"$ref": "#"}: nothing can start an answer
            raise SchemaError("The JSON schema admits no JSON value (a reference to itself with nothing "
                              "else, say); give a schema that some value satisfies.")
    return grammar


def one_line(text: str, limit: int = 200) -> str:
    """llguidance's message as one line: its first, whitespace collapsed, cut at limit characters."""
    first = " ".join(text.strip().split("\n", 1)[0].split())
    return first[:limit].rstrip(":")


def _check_values(schema):
    """Refuse what llguidance would take and not enforce: a 'pattern' that is not a regular
    expression, that llguidance reads otherwise than JSON Schema, or whose shortest match is
    longer than MAX_PATTERN_WIDTH characters; a numeric bound of MAX_BOUND or more."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            for name in BOUNDS:
                bound = node.get(name)
                if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not abs(bound) < MAX_BOUND:
                    raise SchemaError(f"The JSON schema's {name} {str(bound)[:40]} is too large to enforce exactly; "
                                      "bounds must lie within ±1e15.")
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                try:
                    with warnings.catch_warnings(record=True) as notes:
                        warnings.simplefilter("always", FutureWarning)
                        width = re._parser.parse(pattern).getwidth()[0]
                except (re.error, RecursionError, OverflowError) as e:  # as validators check "format": "regex"
                    raise SchemaError(f"The JSON schema's pattern {pattern[:60]!r} is not a regular expression "
                                      f"({one_line(str(e), 80)}); fix it.") from None
                # Python's notes on a "[" or "&&", "--", "~~", "||" inside a class: a nested set, a
                # POSIX class or a set operation to llguidance's regex, plain characters to JSON
                # Schema's (ECMA-262): "[[:alpha:]]" let "S" through, which no validator accepts
                if any(str(n.message).startswith("Possible") for n in notes):
                    raise SchemaError(f"The JSON schema's pattern {pattern[:60]!r} holds '[' (or '&&', '--', '~~', "
                                      "'||') inside a character class, which regular expression dialects read "
                                      "differently; escape it ('\\[') or write the class out ('[A-Za-z]').")
                if width > MAX_PATTERN_WIDTH:
                    raise SchemaError(f"The JSON schema's pattern {pattern[:60]!r} matches only strings of "
                                      f"{width:,} characters or more; the most this server enforces is "
                                      f"{MAX_PATTERN_WIDTH:,}.")
            todo.extend(v for k, v in node.items() if k not in DATA)


class JsonConstraint:
    def __init__(self, tokenizer, grammar: str):
        from llguidance import LLMatcher

        self.vocab = tokenizer.vocab_size
        self.matcher = LLMatcher(tokenizer.guidance, grammar)
        self._check()

    def _check(self):
        if self.matcher.is_error():
            raise SchemaError(f"The JSON schema cannot be enforced ({one_line(self.matcher.get_error())}); "
                              "simplify it.")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with every token the grammar forbids at -inf (a copy). The bitmask
        (one bit a token, little-endian 32-bit words) goes to the logits' device packed, 4 KB
        for 128K tokens, and is unpacked there: no host sync, no index list."""
        words = torch.from_numpy(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32).copy())
        self._check()  # past llguidance's limits, its lexer stops part way through an answer
        words = words.to(logits.device, non_blocking=True)
        allowed = ((words[:, None] >> _BITS.to(logits.device)) & 1).view(-1).bool()
        keep = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        n = min(self.vocab, allowed.shape[0])
        keep[:n] = allowed[:n]
        return logits.masked_fill(~keep, float("-inf"))

    def consume(self, token: int):
        if not self.matcher.consume_token(token):
            self._check()
            raise KtlongError(f"token {token} is outside the grammar ({self.matcher.get_error()[:200]})")

    @property
    def done(self) -> bool:
        """The answer is complete: nothing but the end may follow."""
        return self.matcher.is_stopped()

