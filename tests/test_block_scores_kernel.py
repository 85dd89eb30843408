"""Device selection's Triton scoring kernel (operators/block_scores_kernel.py) against the torch
scores (operators/block_scores.py) with the selection's mask applied as device_selection.py's
torch path applies it. In Triton's interpreter on the CPU; compiled on a GPU."""

import pytest
import torch

from operators.block_scores import device_block_scores
from operators.block_scores_kernel import kernel_applies, masked_block_scores, selection_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("first, last", [(1, 70), (1, 4), (0, 0)])  # crowded, fewer than selected, empty
def test_kernel_scores_equal_the_torch_scores_masked(quest, shared, first, last):
    g = torch.Generator().manual_seed(int(quest) + 2 * int(shared))
    num_kv, group, dim, num_blocks, selected = 2, 4, 32, 75, 5  # blocks past a program's 32, one partial
    q = torch.randn(num_kv * group, dim, generator=g).to(torch.bfloat16)  # decode's q, as the model computes it
    anchors = torch.randn(num_kv, num_blocks, 2 if quest else 1, dim, generator=g).to(torch.bfloat16)
    rows = 1 if shared else num_kv
    bias = torch.where(torch.rand(rows, num_blocks, generator=g) < 0.3, float("-inf"), 0.0)
    params = torch.tensor([first, last, 1])
    to = dict(device=DEVICE)
    out = masked_block_scores(q.to(**to), anchors.to(**to).view(num_kv, num_blocks, -1), bias.to(**to),
                              params.to(**to), selected, shared, quest)
    ref = device_block_scores(q.float(), anchors, quest, shared)
    blocks = torch.arange(num_blocks)
    if last - first > selected:
        ref = ref + bias
    ref = torch.where((blocks >= first) & (blocks < last), ref, float("-inf"))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-4)


def test_which_anchors_the_kernel_scores():
    assert kernel_applies(1, False, 128) and kernel_applies(2, True, 128)
    assert not kernel_applies(4, False, 128)  # several keys a block: max over them, not linear
    assert not kernel_applies(1, False, 80)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("fresh", [1, 0])
def test_selection_rows_are_the_torch_ops_on_a_step_that_selects(shared, fresh):
    """A step that selects: each kv head's page rows h * NB + block and its finite scores' count
    times the block size; a step that does not: the rows and counts stay as they were."""
    num_kv, num_blocks, places, block = 3, 40, 5, 16
    g = torch.Generator().manual_seed(fresh + 2 * shared)
    scores = torch.randn(1 if shared else num_kv, num_blocks, generator=g)
    if shared:  # 3 blocks can win, fewer than places
        scores[:, 3:] = float("-inf")
    top, picked = torch.topk(scores, places, dim=1)
    to = dict(device=DEVICE)
    index = torch.full((num_kv, places), 7, dtype=torch.int64, **to)
    valid = torch.full((num_kv,), 9, dtype=torch.int64, **to)
    selection_rows(top.to(**to), picked.to(**to), torch.tensor([0, 0, fresh], **to), index, valid, num_blocks, block)
    if not fresh:
        assert (index == 7).all() and (valid == 9).all()
        return
    heads = torch.arange(num_kv)[:, None]
    assert torch.equal(index.cpu(), heads * num_blocks + picked.expand(num_kv, -1))
    assert torch.equal(valid.cpu(), ((top > float("-inf")).sum(1) * block).expand(num_kv))
