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
        self.shown = 0  # characters the pieces pushed so far hold

    def push(self, token_id: int) -> str:
        """The text token_id completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        piece = self.step(token_id) or ""
        self.shown += len(piece)
        return piece

    def rest(self) -> str:
        """Once the answer ends: what its pieces did not show, a last character its tokens never
        completed, as the whole decode writes it (U+FFFD)."""
        return self.text()[self.shown:]

    def text(self) -> str:
        """The whole answer's text, decoded once."""
        return self.tokenizer.decode(self.ids)
