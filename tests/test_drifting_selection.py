"""The decode bench's drifting selection keeps the previous token's blocks at the asked rate and
fills the rest from the real selection."""

import numpy as np

from ktlong.bench.drifting_selection import DriftingSelection


def real_selection(rng, shared):
    def select(layer, step, q, first, last, device_scores=None):
        rows = 1 if shared else 4
        blocks = np.stack([rng.choice(200, 8, replace=False) for _ in range(rows)]).astype(np.int32)
        return np.repeat(blocks, 4 // rows, 0), np.full(4, 8, np.int32)
    return select


def run(share, shared, steps=300):
    rng = np.random.default_rng(1)
    drifting = DriftingSelection(real_selection(rng, shared), share, seed=2)
    history = [drifting(0, t, None, 0, 200)[0] for t in range(steps)]
    return history


def test_share_one_keeps_the_first_selection_and_zero_follows_the_real_one():
    history = run(1.0, False)
    assert all((h == history[0]).all() for h in history)
    rng = np.random.default_rng(1)
    real = real_selection(np.random.default_rng(1), False)
    drifting = DriftingSelection(real_selection(rng, False), 0.0)
    for t in range(20):
        np.testing.assert_array_equal(drifting(0, t, None, 0, 200)[0], real(0, t, None, 0, 200)[0])


def test_the_kept_share_matches_the_rate_and_rows_stay_valid():
    for shared in (False, True):
        history = run(0.72, shared)
        overlaps = [len(set(a[h]) & set(b[h])) / 8 for a, b in zip(history, history[1:]) for h in range(4)]
        assert abs(np.mean(overlaps) - 0.72) < 0.03
        for blocks in history:
            assert all(len(set(row)) == 8 for row in blocks)  # 8 distinct blocks per head
            assert ((blocks == blocks[:1]).all()) == shared  # SHARED stays one list
