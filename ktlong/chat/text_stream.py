"""Turn a growing list of token ids into printable text pieces, never splitting a UTF-8
character, each token's piece made from a few tokens (the tokenizer's decode stream), not the
whole answer again."""

from __future__ import annotations

from typing import Callable, Protocol


class Detokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...

    def decode_stream(self) -> Callable[[int], str | None]: ...


class TextStream:
    def __init__(self, tokenizer: Detokenizer):
        self.tokenizer = tokenizer
        self.step = tokenizer.decode_stream()
        self.ids: list[int] = []

    def push(self, token_id: int) -> str:
        """The text token_id completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        return self.step(token_id) or ""

    def text(self) -> str:
        """The whole answer's text, decoded once."""
        return self.tokenizer.decode(self.ids)
