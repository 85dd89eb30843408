"""The block summary kernels (operators/block_summary_kernel.py) against the torch path
(operators/block_summary.py) and a plain per-token statement of the importance. In Triton's
interpreter on the CPU; compiled on a GPU."""

import pytest
import torch

from operators.block_summary import anchor_keys, block_summaries, token_importance
from operators.block_summary_kernel import summarize_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def importance_reference(q_last, keys, scale):
    """[KV, T] float64: per key, the highest softmax weight any last query of any head of its kv
    head gives it, one row at a time."""
    num_q, num_heads, _ = q_last.shape
    num_kv, num_k, _ = keys.shape
    out = torch.zeros((num_kv, num_k), dtype=torch.float64)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv)
        for i in range(num_q):
            pos = num_k - num_q + i
            w = torch.softmax(keys[kv, :pos + 1].double() @ q_last[i, h].double() * scale, 0)
            out[kv, :pos + 1] = torch.maximum(out[kv, :pos + 1], w)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_valid", [5 * 16, 4 * 16 + 3, 9])
@pytest.mark.parametrize("num_q", [64, 70, 7])
def test_summaries_and_dynamic_anchor_equal_the_torch_path(dtype, num_valid, num_q):
    num_q = min(num_q, num_valid)
    g = torch.Generator().manual_seed(num_valid * 100 + num_q)
    num_kv, num_heads, block, dim, first = 2, 6, 16, 16, 3
    pages = (torch.randn(num_kv, 12, block, dim, generator=g) * 2).to(dtype).to(DEVICE)
    nb = -(-num_valid // block)
    k_blocks = pages[:, first:first + nb]  # a range of the pages, as prefill passes it
    q_last = (torch.randn(num_q + 5, num_heads, dim, generator=g) * 2).to(dtype).to(DEVICE)[5:]
    pooled = torch.full((num_kv, 12, dim), 7.0, device=DEVICE)
    kmax, kmin, anchors = summarize_blocks(k_blocks, num_valid, pooled[:, first:first + nb], 0.3, q_last)

    mean_ref, max_ref, min_ref = block_summaries(k_blocks.cpu(), num_valid)
    torch.testing.assert_close(pooled[:, first:first + nb].cpu(), mean_ref, rtol=1e-6, atol=1e-6)
    assert (pooled[:, :first] == 7).all() and (pooled[:, first + nb:] == 7).all()  # nothing else written
    assert torch.equal(kmax.cpu(), max_ref) and torch.equal(kmin.cpu(), min_ref)

    keys = k_blocks.cpu().reshape(num_kv, -1, dim)[:, :num_valid]
    importance = importance_reference(q_last.cpu(), keys, 0.3)
    torch.testing.assert_close(token_importance(q_last.cpu(), keys, 0.3).double(), importance, rtol=1e-5, atol=1e-7)
    for kv in range(num_kv):
        for b in range(nb):
            span = importance[kv, b * block:min((b + 1) * block, num_valid)]
            picked = [t for t in range(len(span)) if torch.equal(anchors[kv, b, 0].cpu(), keys[kv, b * block + t].float())]
            assert picked, (kv, b)  # the anchor is one of the block's keys, as stored
            assert span[picked].max() >= span.max() * (1 - 1e-5), (kv, b)  # of the highest importance
    torch_path = anchor_keys(k_blocks.cpu(), num_valid, "DYNAMIC", 1, token_importance(q_last.cpu(), keys, 0.3))
    agree = (anchors.cpu() == torch_path).all(-1).float().mean()
    assert agree >= 0.9, agree  # the same token but at near ties


def test_summaries_without_queries():
    g = torch.Generator().manual_seed(3)
    k_blocks = torch.randn(3, 4, 32, 16, generator=g).to(DEVICE)
    mean = torch.empty(3, 4, 16, device=DEVICE)
    kmax, kmin, anchors = summarize_blocks(k_blocks, 3 * 32 + 1, mean, 1.0)
    ref = block_summaries(k_blocks.cpu(), 3 * 32 + 1)
    torch.testing.assert_close(mean.cpu(), ref[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(kmax.cpu(), ref[1]) and torch.equal(kmin.cpu(), ref[2]) and anchors is None
    assert torch.equal(kmax[:, 3].cpu(), k_blocks[:, 3, 0].cpu())  # a block of one valid token


def test_refuses_blocks_that_are_not_back_to_back():
    k = torch.zeros(2, 4, 16, 32, device=DEVICE)[..., :16]
    with pytest.raises(ValueError, match="back to back"):
        summarize_blocks(k, 16, torch.zeros(2, 4, 16, device=DEVICE), 1.0)
