"""One answer, a token at a time: the logits of its last token in, its next token out (masked by
its grammar, sampled, checked against the stop tokens and its length), its text streamed. It
holds no model: whoever runs the session feeds it, one conversation alone (ktlong/chat/generate.py)
or each of a batch's rows."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable

from ktlong.chat.sampling import Sampler
from ktlong.chat.text_stream import Detokenizer, TextStream

if TYPE_CHECKING:
    import torch

    from ktlong.chat.constrained import JsonConstraint


class Answer:
    def __init__(self, max_new_tokens: int, sampler: Sampler, stop_ids: frozenset[int], tokenizer: Detokenizer,
                 on_text: Callable[[str], None] = lambda s: None,
                 should_stop: Callable[[], bool] | None = None,
                 on_token: "Callable[[int, torch.Tensor], None] | None" = None,
                 constraint: "JsonConstraint | None" = None):
        """should_stop: asked before every token; on_token(token, logits): each token with the
        logits it was sampled from, before its text; constraint: a grammar the answer keeps to
        (its tokens masked before sampling); the answer ends when the grammar does."""
        self.max_new_tokens, self.sampler, self.stop_ids = max_new_tokens, sampler, stop_ids
        self.on_text, self.should_stop, self.on_token, self.constraint = on_text, should_stop, on_token, constraint
        self.stream = TextStream(tokenizer)
        self.chosen: Counter[int] = Counter()  # the tokens sampled so far (the sampler's penalties)
        self.finish_reason: str | None = None  # stop | length | cancelled, once it ended

    @property
    def token_ids(self) -> list[int]:
        return self.stream.ids

    def next(self, logits) -> int | None:
        """The token that follows logits, to run through the model next; None when the answer
        ended instead (finish_reason says why; a last token that reached max_new_tokens is part
        of the answer but is not run)."""
        if len(self.token_ids) >= self.max_new_tokens:
            return self._end("length")
        if self.should_stop is not None and self.should_stop():
            return self._end("cancelled")
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = self.sampler(logits, self.chosen)
        self.chosen[token] += 1
        if token in self.stop_ids:
            return self._end("stop")
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.on_token is not None:
            self.on_token(token, logits)
        self.on_text(self.stream.push(token))
        if self.constraint is not None and self.constraint.done:
            return self._end("stop")
        return self._end("length") if len(self.token_ids) >= self.max_new_tokens else token

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        if rest := self.stream.rest():  # the pieces streamed so far and this are the whole answer's text
            self.on_text(rest)
        return None
