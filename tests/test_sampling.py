"""The sampler draws from softmax(logits / temperature) cut to the top k and the top-p nucleus:
its distribution against one written out by hand, and its draws against that distribution."""

import numpy as np
import pytest
import torch

from ktlong.chat.sampling import Sampler

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))


@pytest.mark.parametrize("top_k, top_p, expected", [
    (0, 1.0, [0.05, 0.4, 0.1, 0.3, 0.15]),
    (2, 1.0, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]),
    (0, 0.6, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]),  # 0.4 < 0.6, so 0.3 is in; then 0.7 >= 0.6: the rest out
    (0, 0.35, [0, 1.0, 0, 0, 0]),
    (3, 0.9, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85]),  # of the top 3, 0.82 before the last
    (3, 0.8, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]),
])
def test_distribution_is_the_nucleus_of_the_top_k(top_k, top_p, expected):
    got = Sampler(1.0, top_p, top_k).probabilities(LOGITS)
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_temperature_sharpens_and_draws_follow_the_distribution():
    sampler = Sampler(0.5, seed=3)
    want = np.array([0.05, 0.4, 0.1, 0.3, 0.15]) ** 2
    want /= want.sum()
    np.testing.assert_allclose(sampler.probabilities(torch.from_numpy(LOGITS).float()), want, rtol=1e-6)
    draws = np.bincount([sampler(LOGITS) for _ in range(20000)], minlength=5) / 20000
    np.testing.assert_allclose(draws, want, atol=0.015)


def test_greedy_takes_the_largest_and_a_seed_repeats():
    assert Sampler()(torch.tensor([0.1, 3.0, -1.0])) == 1 and Sampler()(LOGITS) == 1
    first, second = Sampler(1.0, seed=7), Sampler(1.0, seed=7)
    assert [first(LOGITS) for _ in range(50)] == [second(LOGITS) for _ in range(50)]
