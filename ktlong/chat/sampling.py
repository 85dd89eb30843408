"""Next-token choice: greedy at temperature 0, else top-k / top-p sampling, in numpy, over the
logits of either engine (a torch tensor on any device, or the CPU engine's array), after the
OpenAI API's logit bias and presence and frequency penalties."""

from __future__ import annotations

from typing import Mapping

import numpy as np


def as_array(logits) -> np.ndarray:
    """[vocab] logits as a float64 numpy array."""
    if hasattr(logits, "detach"):  # a torch tensor
        logits = logits.detach().float().cpu().numpy()
    return np.asarray(logits, np.float64)


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None):
        """presence_penalty, frequency_penalty: as the OpenAI API's, taken off the logit of every
        token the answer chose so far, the first once, the second once per time it was chosen;
        logit_bias: token id -> a value added to its logit."""
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.presence, self.frequency = presence_penalty, frequency_penalty
        self.bias = dict(logit_bias or {})
        self.rng = np.random.default_rng(seed)

    def adjusted(self, logits, chosen: Mapping[int, int]):
        """logits with the bias added and the penalties for `chosen` (token -> times the answer
        chose it) taken off: the logits themselves where neither applies."""
        penalised = (self.presence or self.frequency) and chosen
        if not (self.bias or penalised):
            return logits
        x = np.array(as_array(logits))  # a copy: the caller's logits stay as they are
        for token, value in self.bias.items():
            x[token] += value
        if penalised:
            tokens = np.fromiter(chosen.keys(), np.int64, len(chosen))
            x[tokens] -= np.fromiter(chosen.values(), np.float64, len(chosen)) * self.frequency + self.presence
        return x

    def probabilities(self, logits) -> np.ndarray:
        """The distribution a sampled token is drawn from [vocab]: softmax(logits / temperature),
        tokens outside the top k and outside the top-p nucleus set to 0, renormalised."""
        x = as_array(logits)
        with np.errstate(over="ignore"):  # shifted first: a tiny temperature makes -inf, never inf - inf
            x = (x - x.max()) / self.temperature
        if self.top_k:
            k = min(self.top_k, x.shape[0])
            x[x < np.partition(x, -k)[-k]] = -np.inf
        probs = np.exp(x)
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            ranked = probs[order]
            ranked[np.cumsum(ranked) - ranked > self.top_p] = 0  # outside: the mass before it already exceeds top_p
            probs = np.zeros_like(probs)
            probs[order] = ranked
            probs /= probs.sum()
        return probs

    def __call__(self, logits, chosen: Mapping[int, int] | None = None) -> int:
        """logits [vocab] float32 -> the next token; chosen: the answer's tokens so far, counted."""
        logits = self.adjusted(logits, chosen or {})
        if self.temperature == 0:
            return int(logits.argmax())
        probs = self.probabilities(logits)
        return int(self.rng.choice(probs.shape[0], p=probs))
