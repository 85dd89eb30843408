"""CompactAttention's topk selection kernels (operators/topk_selection_kernel.py) against a plain
torch statement of the rule and against the torch path (block_selector.topk_group_blocks, then
block_union.fixed_page_indices). In Triton's interpreter on the CPU; compiled on a GPU."""

import pytest
import torch

from operators.block_selector import topk_group_blocks
from operators.block_union import fixed_page_indices
from operators.topk_selection_kernel import group_margins, topk_page_indices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B = 16


def reference_margins(q, pooled_keys, num_hist, scale, group_size, sink, window):
    """Per (head, query block): the pooled query's scores over the history blocks minus their
    best; per group: the best of its rows; the sinks and window +inf. Loops, float64."""
    num_heads = q.shape[1]
    heads_per_kv = num_heads // pooled_keys.shape[0]
    num_qb = -(-q.shape[0] // B)
    out = torch.full((num_heads // group_size, num_hist), float("-inf"), dtype=torch.float64)
    for h in range(num_heads):
        keys = pooled_keys[h // heads_per_kv, :num_hist].double()
        for i in range(num_qb):
            pq = q[i * B:(i + 1) * B, h].double().mean(0)
            s = keys @ pq * scale
            out[h // group_size] = torch.maximum(out[h // group_size], s - s.max())
    out[:, :sink] = float("inf")
    if window:
        out[:, max(0, num_hist - window):] = float("inf")
    return out


def reference_mass(q, pooled_keys, num_hist, scale, group_size, sink, window):
    """Per (head, query block): the softmax of the pooled query's scores over the history blocks;
    per group: the mean of its rows; the sinks and window +inf. Loops, float64."""
    num_heads = q.shape[1]
    heads_per_kv = num_heads // pooled_keys.shape[0]
    num_qb = -(-q.shape[0] // B)
    out = torch.zeros((num_heads // group_size, num_hist), dtype=torch.float64)
    for h in range(num_heads):
        keys = pooled_keys[h // heads_per_kv, :num_hist].double()
        for i in range(num_qb):
            pq = q[i * B:(i + 1) * B, h].double().mean(0)
            w = torch.exp(keys @ pq * scale - (keys @ pq * scale).max())
            out[h // group_size] += w / w.sum() / (group_size * num_qb)
    out[:, :sink] = float("inf")
    if window:
        out[:, max(0, num_hist - window):] = float("inf")
    return out


REFERENCES = {"margin": reference_margins, "mass": reference_mass}


@pytest.mark.parametrize("rank", ["margin", "mass"])
@pytest.mark.parametrize("num_q, num_hist, group_size, sink, window", [
    (4 * B, 70, 2, 1, 2),  # blocks past a program's 64
    (3 * B + 5, 9, 4, 0, 0),  # a partial last query block, no sinks or window
    (70 * B, 130, 1, 2, 3),  # query blocks past a program's 16 and 64 rows
    (2 * B, 1100, 2, 1, 2),  # history past one program's 512 blocks: row maxima in three parts
])
def test_margins_equal_the_rule(num_q, num_hist, group_size, sink, window, rank):
    """The kernels' margins, and masses (the rows' softmax, whose sum a history past 512 blocks
    splits into rescaled parts), against the rule in float64. A float32 score here errs by about
    1e-6, which its exponential carries as a relative error of about 1e-6: inside 1e-5 relative."""
    g = torch.Generator().manual_seed(num_hist)
    num_heads, num_kv, dim, scale = 8, 2, 32, 0.3
    q = torch.randn(num_q, num_heads, dim, generator=g).to(torch.bfloat16)
    pooled = torch.randn(num_kv, num_hist + 7, dim, generator=g)  # room past the history, as the prefill's table has
    out = group_margins(q.to(DEVICE), pooled.to(DEVICE), num_hist, B, scale, group_size, sink, window, rank)
    ref = REFERENCES[rank](q, pooled, num_hist, scale, group_size, sink, window)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5 if rank == "margin" else 1e-7)


@pytest.mark.parametrize("group_size, rank", [(2, "margin"), (4, "margin"), (4, "mass")])
def test_page_indices_keep_the_best_margins(group_size, rank):
    """Each group's page list is num_keep blocks whose margins are the best (a row's best blocks
    tie at margin 0, so the rule, not the torch path's choice among ties, is the reference), then
    the chunk's blocks in order, offset to the group's kv head."""
    g = torch.Generator().manual_seed(group_size)
    num_heads, num_kv, dim, num_hist, num_keep, blocks_per_head, scale = 8, 2, 32, 40, 12, 64, 0.25
    chunk_tokens = 5 * B
    q = torch.randn(chunk_tokens, num_heads, dim, generator=g).to(torch.bfloat16)
    pooled = torch.randn(num_kv, blocks_per_head, dim, generator=g)
    num_groups = num_heads // group_size
    per_group = num_keep + 5
    out = torch.full((num_groups * per_group,), -1, dtype=torch.int32, device=DEVICE)
    got = topk_page_indices(q.to(DEVICE), pooled.to(DEVICE), num_hist, B, scale, num_keep, group_size, 1, 2,
                            num_kv, blocks_per_head, chunk_tokens, out=out, rank=rank)
    assert got.data_ptr() == out.data_ptr()  # written in place: a plan reads this tensor
    margins = REFERENCES[rank](q, pooled, num_hist, scale, group_size, 1, 2)
    for grp in range(num_groups):
        row = got.cpu()[grp * per_group:(grp + 1) * per_group].long() - (grp // (num_groups // num_kv)) * blocks_per_head
        kept = row[:num_keep]
        assert len(set(kept.tolist())) == num_keep and 0 <= int(kept.min()) and int(kept.max()) < num_hist
        dropped = torch.ones(num_hist, dtype=torch.bool)
        dropped[kept] = False
        assert float(margins[grp, kept].min()) >= float(margins[grp, dropped].max()) - (1e-5 if rank == "margin" else 1e-7)
        assert row[num_keep:].tolist() == list(range(num_hist, num_hist + 5))  # the chunk's blocks


@pytest.mark.parametrize("rank", ["margin", "mass"])
def test_torch_path_keeps_the_best_margins(rank):
    """The torch path (CPU, and GPUs without triton) by the same rule."""
    g = torch.Generator().manual_seed(7)
    num_heads, num_kv, dim, num_hist, num_keep, scale = 8, 2, 32, 40, 12, 0.25
    q = torch.randn(5 * B, num_heads, dim, generator=g).to(torch.bfloat16)
    pooled = torch.randn(num_kv, num_hist, dim, generator=g)
    ids = topk_group_blocks(q, pooled, B, scale, num_keep, 1, 2, 4, rank)
    margins = REFERENCES[rank](q, pooled, num_hist, scale, 4, 1, 2)
    indices = fixed_page_indices(ids, num_kv, 64, num_hist, 5 * B, B).view(2, -1)
    for grp in range(2):
        dropped = torch.ones(num_hist, dtype=torch.bool)
        dropped[ids[grp]] = False
        assert float(margins[grp, ids[grp]].min()) >= float(margins[grp, dropped].max()) - (1e-5 if rank == "margin" else 1e-7)
        assert indices[grp].tolist() == [grp * 64 + int(i) for i in ids[grp]] + [grp * 64 + num_hist + i for i in range(5)]
