"""The block top-k kernels against torch.topk. On the CPU they run in Triton's interpreter
(tests/conftest.py); on a GPU compiled, on the device."""

import pytest
import torch

from operators.block_topk_kernel import block_topk, kernel_applies

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, n, k", [(1, 2100, 32),  # three rounds (2100 -> 288 -> 64 candidates -> 32)
                                        (3, 1000, 20),  # a row per kv head, a k of no power of two
                                        (2, 50, 50),  # every block
                                        (1, 300, 128)])  # the widest k, a chunk and a bit
def test_block_topk_equals_torch_topk(rows, n, k):
    """Same scores best first, and the same blocks wherever the score is finite; a row with
    fewer finite scores than k fills up with the lowest-indexed -inf blocks."""
    g = torch.Generator().manual_seed(n)
    scores = torch.randn(rows, n, generator=g)
    scores[:, ::7] = float("-inf")  # blocks the selection's mask rules out
    top, picked = block_topk(scores.to(DEVICE), k)
    ref_top, ref_picked = torch.topk(scores, k, dim=1)
    assert torch.equal(top.cpu(), ref_top)
    finite = ref_top > float("-inf")
    assert torch.equal(picked.cpu()[finite], ref_picked[finite])
    ruled_out = torch.arange(0, n, 7)
    for r in range(rows):
        tail = picked.cpu()[r][~finite[r]]
        assert torch.equal(tail, ruled_out[:len(tail)])


def test_ties_go_to_the_lower_index():
    scores = torch.zeros(1, 300)
    scores[0, 200:] = 1.0
    top, picked = block_topk(scores.to(DEVICE), 8)
    assert torch.equal(picked.cpu()[0], torch.arange(200, 208))
    assert torch.equal(top.cpu()[0], torch.ones(8))


def test_a_k_past_half_a_chunk_is_refused():
    assert kernel_applies(1000, 128) and not kernel_applies(1000, 129)
    with pytest.raises(ValueError, match="torch.topk"):
        block_topk(torch.zeros(1, 1000, device=DEVICE), 200)
