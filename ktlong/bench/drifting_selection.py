"""A decode selection that drifts from token to token at a given rate, for benchmarks on random
weights.

On random weights every token's top-k is nearly new (tokens are independent random embeddings),
while on real text most of a token's blocks are the previous token's (72% at 128K on Qwen2.5 with
YaRN, docs/measurements/2026-11-decode.md). Whatever uses that (the device's block cache)
can only be timed on the 8B shape with a selection that behaves like a real one. This wraps a
selector: each step the real selection runs (so its cost is still paid and timed), then each of
the previous token's blocks stays with probability `share`, and the rest are filled from the
real selection's best blocks not kept. SHARED selections stay shared (one list for every head).
"""

from __future__ import annotations

import numpy as np


class DriftingSelection:
    def __init__(self, select, share: float, seed: int = 0):
        """select: the selector's select method, wrapped."""
        assert 0.0 <= share <= 1.0, share
        self.select, self.share = select, share
        self.rng = np.random.default_rng(seed)
        self.previous: dict[int, np.ndarray] = {}

    def __call__(self, layer: int, step: int, q, first: int, last: int, device_scores=None):
        blocks, counts = self.select(layer, step, q, first, last, device_scores)
        prev = self.previous.get(layer)
        k = blocks.shape[1]
        if prev is None or prev.shape != blocks.shape or (counts != k).any():
            self.previous[layer] = blocks.copy()
            return blocks, counts
        shared = bool((blocks == blocks[:1]).all() and (prev == prev[:1]).all())
        rows = [self._drift(prev[0], blocks[0])] if shared else [self._drift(p, b) for p, b in zip(prev, blocks)]
        drifted = np.repeat(rows[0][None], len(blocks), 0) if shared else np.stack(rows)
        self.previous[layer] = drifted
        return drifted, counts  # int32, as the rows it is built from

    def _drift(self, prev: np.ndarray, real: np.ndarray) -> np.ndarray:
        kept = prev[self.rng.random(len(prev)) < self.share]
        fill = real[~np.isin(real, kept)][:len(prev) - len(kept)]  # in the real selection's order
        return np.concatenate([kept, fill])
