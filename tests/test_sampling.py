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


def test_logit_bias_and_penalties_move_the_logits_as_the_openai_api_says():
    """logits [0, 1, 2, 3, 4]; token 4 chosen twice, 1 once: presence 0.5 and frequency 1.0
    take 2.5 off 4 and 1.5 off 1; a bias of +5 on 0: [5, -0.5, 2, 3, 1.5], written out by hand."""
    sampler = Sampler(0.0, presence_penalty=0.5, frequency_penalty=1.0, logit_bias={0: 5.0})
    logits = torch.arange(5, dtype=torch.float32)
    np.testing.assert_allclose(sampler.adjusted(logits, {4: 2, 1: 1}), [5, -0.5, 2, 3, 1.5])
    assert logits.tolist() == [0, 1, 2, 3, 4]  # the caller's logits untouched
    assert sampler(logits, {4: 2, 1: 1}) == 0
    negative = Sampler(1.0, presence_penalty=-2.0)  # a negative penalty favours what was chosen
    np.testing.assert_allclose(negative.probabilities(negative.adjusted(LOGITS, {0: 1})),
                               np.array([0.05 * np.e ** 2, 0.4, 0.1, 0.3, 0.15]) / (0.95 + 0.05 * np.e ** 2))


def test_an_answers_penalties_count_its_own_tokens():
    """Logits that always favour token 1 by 0.75 over token 2 (and token 0 by far less): greedy
    repeats 1; a frequency penalty of 1 takes 1 off a token each time it is chosen, which
    alternates them (1, then 2 at 0.25 against 0, then 1 at 0 against -0.75, ...), counted per
    answer, not carried into the next one."""
    from ktlong.chat.answer import Answer
    from tests.no_text import NO_TEXT

    logits = torch.tensor([-5.0, 1.0, 0.25])
    sampler = Sampler(0.0, frequency_penalty=1.0)
    for _ in range(2):  # the same sampler for two answers, as a chat's
        answer = Answer(6, sampler, frozenset(), NO_TEXT)
        tokens = [answer.next(logits)]
        while tokens[-1] is not None:
            tokens.append(answer.next(logits))
        assert answer.token_ids == [1, 2, 1, 2, 1, 2]
    plain = Answer(4, Sampler(), frozenset(), NO_TEXT)
    while plain.next(logits) is not None:
        pass
    assert plain.token_ids == [1, 1, 1, 1]
