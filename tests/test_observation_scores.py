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


@pytest.mark.parametrize("num_tokens,num_q,group,dim,block", [(200, 12, 3, 16, 16), (77, 32, 6, 32, 32),
                                                                (40, 5, 1, 16, 64)])
def test_block_mass_kernel_equals_the_direct_softmax(num_tokens, num_q, group, dim, block):
    """The Triton kernel (in Triton's interpreter on the CPU, compiled on a GPU): rows in several
    tiles (192 rows), a group of one, blocks past the last token, queries fewer than a block."""
    from operators.observation_kernel import observation_block_mass_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the KV cache's dtype on a GPU; the interpreter reads bfloat16 as something else (numpy has
    # no bfloat16), so the CPU checks the same arithmetic in float16
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(num_tokens)
    num_kv = 2
    k_pages = torch.randn(num_kv, -(-num_tokens // block) + 1, block, dim, generator=g).to(dtype)
    q = (torch.randn(num_q, num_kv * group, dim, generator=g) * 2).to(dtype)
    got = observation_block_mass_kernel(q.to(device), k_pages.to(device), num_tokens, 0.25).cpu()
    ref = reference_mass(q.float().numpy(), k_pages.float().view(num_kv, -1, dim).numpy(), num_tokens, 0.25, block)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_q,group,dim", [(32, 4, 128), (32, 7, 64), (9, 8, 128)])
def test_gpu_block_mass_kernel_equals_the_torch_path(num_q, group, dim):
    """Compiled on the GPU at real shapes (LLaMA-3.1-8B's group of 4, Qwen2.5-0.5B's 7 with
    head_dim 64, a short question), 8,000 keys in bfloat16 pages: the kernel against the torch
    path in float32 on the same values."""
    from operators.observation_kernel import observation_block_mass_kernel
    from operators.observation_scores import observation_block_mass_reference

    g = torch.Generator(device="cuda").manual_seed(group)
    num_kv, block, num_tokens = 2, 128, 8000
    k_pages = torch.randn(num_kv, 64, block, dim, generator=g, device="cuda").to(torch.bfloat16)
    q = torch.randn(num_q, num_kv * group, dim, generator=g, device="cuda").to(torch.bfloat16)
    got = observation_block_mass_kernel(q, k_pages, num_tokens, dim ** -0.5)
    ref = observation_block_mass_reference(q.float(), k_pages.float(), num_tokens, dim ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got.sum(1), torch.full((num_kv,), float(num_q * group), device="cuda"))
