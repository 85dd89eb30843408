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
    out = masked_block_scores(q[None].to(**to), [anchors.to(**to).view(num_kv, num_blocks, -1)], [bias.to(**to)],
                              [params.to(**to)], selected, shared, quest)[0]
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
    selection_rows(top[None].to(**to), picked[None].to(**to), [torch.tensor([0, 0, fresh], **to)], [index], [valid],
                   [num_blocks], block)
    if not fresh:
        assert (index == 7).all() and (valid == 9).all()
        return
    heads = torch.arange(num_kv)[:, None]
    assert torch.equal(index.cpu(), heads * num_blocks + picked.expand(num_kv, -1))
    assert torch.equal(valid.cpu(), ((top > float("-inf")).sum(1) * block).expand(num_kv))


@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_a_batch_is_scored_and_its_rows_written_as_each_member_alone(quest, shared):
    """Three conversations of different lengths (anchors of 75, 40 and 9 blocks, each in a tensor
    of its own), each with its own mask and step parameters, one of them not selecting afresh:
    one launch of each kernel gives each member's scores (-inf past its own blocks) and rows
    exactly as its call alone does, and the top-k of the batch's rows together gives each
    member its own top-k's places."""
    g = torch.Generator().manual_seed(3 + int(quest) + 2 * int(shared))
    num_kv, group, dim, selected, block = 2, 4, 32, 5, 16
    lengths, steps = (75, 40, 9), ([1, 70, 1], [0, 40, 0], [0, 9, 1])
    rows = 1 if shared else num_kv
    to = dict(device=DEVICE)
    q = torch.randn(3, num_kv * group, dim, generator=g).to(torch.bfloat16).to(**to)
    anchors = [torch.randn(num_kv, n, 2 if quest else 1, dim, generator=g).to(torch.bfloat16).to(**to).view(
        num_kv, n, -1) for n in lengths]
    bias = [torch.where(torch.rand(rows, n, generator=g) < 0.3, float("-inf"), 0.0).to(**to) for n in lengths]
    params = [torch.tensor(p, **to) for p in steps]
    scores = masked_block_scores(q, anchors, bias, params, selected, shared, quest)
    assert scores.shape == (3, rows, max(lengths))
    places = min(selected, max(lengths))
    top, picked = torch.topk(scores.view(3 * rows, -1), places, dim=1)
    index = [torch.full((num_kv, min(selected, n)), 7, dtype=torch.int64, **to) for n in lengths]
    valid = [torch.full((num_kv,), 9, dtype=torch.int64, **to) for _ in lengths]
    table_blocks = [80, 80, 80]
    selection_rows(top.view(3, rows, places), picked.view(3, rows, places), params, index, valid, table_blocks, block)
    for b, n in enumerate(lengths):
        alone = masked_block_scores(q[b:b + 1], anchors[b:b + 1], bias[b:b + 1], params[b:b + 1], selected, shared,
                                    quest)[0]
        assert torch.equal(scores[b, :, :n], alone)
        assert (scores[b, :, n:] == float("-inf")).all()
        own = min(selected, n)
        a_top, a_picked = torch.topk(alone, own, dim=1)
        a_index = torch.full((num_kv, own), 7, dtype=torch.int64, **to)
        a_valid = torch.full((num_kv,), 9, dtype=torch.int64, **to)
        selection_rows(a_top[None], a_picked[None], params[b:b + 1], [a_index], [a_valid], table_blocks[b:b + 1], block)
        assert torch.equal(valid[b], a_valid)
        if steps[b][2]:  # each head's blocks that count: the same, best first (the -inf ones' order is torch's)
            for h in range(num_kv):
                counted = int(a_valid[h]) // block
                assert torch.equal(index[b][h, :counted], a_index[h, :counted]), (b, h)
        else:
            assert (index[b] == 7).all() and (valid[b] == 9).all()
