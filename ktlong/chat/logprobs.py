"""Log-probabilities of generated tokens under the model's own distribution (the log-softmax of
its logits, before temperature or any sampling filter), with the likeliest alternatives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # alternatives a request may ask for per token


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the likeliest tokens and their logprobs, best first


def token_logprob(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """logits [vocab] of the step that chose `token` -> its logprob and the num_top best."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = ()
    if num_top:
        values, ids = torch.topk(logp, num_top)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logp[token]), top)
