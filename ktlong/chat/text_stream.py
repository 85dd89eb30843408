"""Turn a growing list of token ids into printable text pieces, never splitting a UTF-8 character."""

from __future__ import annotations


class TextStream:
    def __init__(self, decode):
        self.decode = decode  # list[int] -> str
        self.ids: list[int] = []
        self.emitted = 0  # characters of decode(ids) already returned

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return ""
        piece, self.emitted = text[self.emitted:], len(text)
        return piece

    def text(self) -> str:
        return self.decode(self.ids)
