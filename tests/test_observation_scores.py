"""Observation-window block scores equal a direct float64 softmax over all keys."""

import numpy as np
import pytest
import torch

from operators.observation_scores import observation_block_mass


def reference_mass(q, k_tokens, num_tokens, scale, block):
    """q [Tq, H, D], k_tokens [KV, T, D] -> [KV, blocks]: causal softmax mass per block."""
    q, k = q.astype(np.float64), k_tokens[:, :num_tokens].astype(np.float64)
    num_q, num_heads, _ = q.shape
    num_kv = k.shape[0]
    group = num_heads // num_kv
    mass = np.zeros((num_kv, -(-num_tokens // block)))
    for h in range(num_heads):
        for i in range(num_q):
            pos = num_tokens - num_q + i
            logits = k[h // group, :pos + 1] @ q[i, h] * scale
            p = np.exp(logits - logits.max())
            p /= p.sum()
            for t in range(pos + 1):
                mass[h // group, t // block] += p[t]
    return mass


@pytest.mark.parametrize("num_tokens,slice_blocks", [(200, 128), (200, 3), (64, 1), (37, 2)])
def test_block_mass_equals_the_direct_softmax(num_tokens, slice_blocks):
    g = torch.Generator().manual_seed(num_tokens)
    num_kv, block, dim = 2, 16, 8
    k_pages = torch.randn(num_kv, 16, block, dim, generator=g)
    q = torch.randn(12, 6, dim, generator=g) * 2
    got = observation_block_mass(q, k_pages, num_tokens, 0.5, slice_blocks)
    ref = reference_mass(q.numpy(), k_pages.view(num_kv, -1, dim).numpy(), num_tokens, 0.5, block)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)
    # each query row sums to one: the total is queries x heads per group
    np.testing.assert_allclose(got.sum(1).numpy(), [12 * 3] * num_kv, rtol=1e-5)
