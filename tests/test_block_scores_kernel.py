"""Device selection's Triton scoring kernel (operators/block_scores_kernel.py) against the torch
scores (operators/block_scores.py) with the selection's mask applied as device_selection.py's
torch path applies it. In Triton's interpreter on the CPU; compiled on a GPU."""

import pytest
import torch

from operators.block_scores import device_block_scores, query_vectors
from operators.block_scores_kernel import kernel_applies, masked_block_scores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("first, last", [(1, 70), (1, 4), (0, 0)])  # crowded, fewer than selected, empty
def test_kernel_scores_equal_the_torch_scores_masked(quest, shared, first, last):
    g = torch.Generator().manual_seed(int(quest) + 2 * int(shared))
    num_kv, group, dim, num_blocks, selected = 2, 4, 32, 75, 5  # blocks past a program's 32, one partial
    q = torch.randn(num_kv * group, dim, generator=g)
    anchors = torch.randn(num_kv, num_blocks, 2 if quest else 1, dim, generator=g).to(torch.bfloat16)
    rows = 1 if shared else num_kv
    bias = torch.where(torch.rand(rows, num_blocks, generator=g) < 0.3, float("-inf"), 0.0)
    params = torch.tensor([first, last, 1])
    to = dict(device=DEVICE)
    out = masked_block_scores(query_vectors(q.to(**to), num_kv, quest), anchors.to(**to).view(num_kv, num_blocks, -1),
                              bias.to(**to), params.to(**to), selected, shared)
    ref = device_block_scores(q, anchors, quest, shared)
    blocks = torch.arange(num_blocks)
    if last - first > selected:
        ref = ref + bias
    ref = torch.where((blocks >= first) & (blocks < last), ref, float("-inf"))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-4)


def test_which_anchors_the_kernel_scores():
    assert kernel_applies(1, False, 128) and kernel_applies(2, True, 128)
    assert not kernel_applies(4, False, 128)  # several keys a block: max over them, not linear
    assert not kernel_applies(1, False, 80)
