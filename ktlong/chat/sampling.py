"""Next-token choice: greedy at temperature 0, else top-k / top-p sampling, in numpy, over the
logits of either engine (a torch tensor on any device, or the CPU engine's array)."""

from __future__ import annotations

import numpy as np


def as_array(logits) -> np.ndarray:
    """[vocab] logits as a float64 numpy array."""
    if hasattr(logits, "detach"):  # a torch tensor
        logits = logits.detach().float().cpu().numpy()
    return np.asarray(logits, np.float64)


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.rng = np.random.default_rng(seed)

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

    def __call__(self, logits) -> int:
        """logits [vocab] float32 -> the next token."""
        if self.temperature == 0:
            return int(logits.argmax())
        probs = self.probabilities(logits)
        return int(self.rng.choice(probs.shape[0], p=probs))
