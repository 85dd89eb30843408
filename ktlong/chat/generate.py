"""Generate an answer token by token, streaming text as it becomes printable."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ktlong.errors import Cancelled
from ktlong.session.protocol import Session
from ktlong.chat.answer import Answer
from ktlong.chat.sampling import Sampler
from ktlong.chat.text_stream import Detokenizer

if TYPE_CHECKING:
    import torch

    from ktlong.chat.constrained import JsonConstraint


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    finish_reason: str  # stop | length | interrupted (Ctrl-C) | cancelled (should_stop)

    @property
    def decode_tokens_per_second(self) -> float:
        return max(len(self.token_ids) - 1, 0) / self.decode_seconds if self.decode_seconds else 0.0


def generate(session: Session, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler,
             stop_ids: frozenset[int], tokenizer: Detokenizer,
             on_text: Callable[[str], None] = lambda s: None, show_progress: bool = False,
             should_stop: Callable[[], bool] | None = None,
             on_progress: Callable[[int, int], None] | None = None,
             should_stop_prefill: Callable[[], bool] | None = None,
             on_token: "Callable[[int, torch.Tensor], None] | None" = None,
             constraint: "JsonConstraint | None" = None, ctrl_c_ends_answer: bool = True) -> Generation:
    """Greedy or sampled continuation of prompt_ids; Ctrl-C ends it early, keeping what was made
    (ctrl_c_ends_answer; else it stops the caller: an evaluation or a bench, whose cut answer
    would be a wrong result), and so does should_stop (asked between prefill chunks and before
    every token). on_progress: the prefill's (tokens done, tokens it computes) after every
    chunk. should_stop_prefill: asked between prefill chunks instead of should_stop, where a stop
    should let the prefill finish. on_token(token, logits): each generated token with the logits
    it was sampled from.
    constraint: a grammar the answer keeps to (its tokens masked before sampling); the answer
    ends when the grammar does."""
    answer = Answer(min(max_new_tokens, session.max_seq_len - len(prompt_ids)), sampler, stop_ids, tokenizer,
                    on_text, should_stop, on_token, constraint)
    start = time.perf_counter()
    finish, prefill_done = None, start
    try:
        logits = session.prefill(prompt_ids, show_progress, should_stop_prefill or should_stop, on_progress)
        prefill_done = time.perf_counter()
        while (token := answer.next(logits)) is not None:
            logits = session.step(token)
        finish = answer.finish_reason
    except KeyboardInterrupt:
        if not ctrl_c_ends_answer:
            raise
        finish = "interrupted"
    except Cancelled:
        finish = "cancelled"
    end = time.perf_counter()
    if prefill_done == start:
        prefill_done = end
    return Generation(answer.token_ids, answer.stream.text(), len(prompt_ids), prefill_done - start,
                      end - prefill_done, finish)
