"""Block scores from the prompt's last queries (SnapKV's observation window), for decode-time
preselection.

After the last prefill chunk of a layer, every key of the layer is still in the device
pages. The last Tq queries attend to all of them, causally; the softmax mass each query puts
on each block, summed over the queries and the query heads of a kv group, scores the block.
Keys go through in slices with a per-slice max, rescaled at the end, so memory stays
O(slice) at any context length. On a GPU the same mass comes from one Triton kernel
(observation_kernel.py); this torch version is its reference and the CPU's path.
"""

from __future__ import annotations

import torch

from operators import triton_installed


def query_rows(q: torch.Tensor, num_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """q: [Tq, H, D] -> [KV, G*Tq, D] in dtype, contiguous: each kv group's queries as rows
    (head in group, query), the order both paths score them in."""
    num_q, num_heads, dim = q.shape
    group = num_heads // num_kv
    rows = q.view(num_q, num_kv, group, dim).permute(1, 2, 0, 3).reshape(num_kv, group * num_q, dim)
    return rows.to(dtype).contiguous()


def observation_block_mass(q: torch.Tensor, k_pages: torch.Tensor, num_tokens: int, scale: float,
                           slice_blocks: int = 128) -> torch.Tensor:
    """q: [Tq, H, D], the queries of positions num_tokens-Tq..num_tokens-1; k_pages:
    [KV, NB, B, D] holding at least num_tokens keys -> [KV, ceil(num_tokens / B)] float32, the
    attention mass on each block summed over the queries and the heads of each group."""
    if q.is_cuda and triton_installed():
        from operators.observation_kernel import kernel_applies, observation_block_mass_kernel

        if kernel_applies(k_pages):
            return observation_block_mass_kernel(q, k_pages, num_tokens, scale)
    return observation_block_mass_reference(q, k_pages, num_tokens, scale, slice_blocks)


def observation_block_mass_reference(q: torch.Tensor, k_pages: torch.Tensor, num_tokens: int, scale: float,
                                     slice_blocks: int = 128) -> torch.Tensor:
    """observation_block_mass in plain torch (the CPU's path, and the kernel's reference).

    Each slice leaves its rows' max and its blocks' sums of exp(logit - that max) in buffers
    made once; one pass over all slices at the end weighs them to the overall max, so the
    launches are a handful per slice and a handful in all."""
    num_q, num_heads, dim = q.shape
    num_kv, _, block, _ = k_pages.shape
    group = num_heads // num_kv
    num_blocks = -(-num_tokens // block)
    num_slices = -(-num_blocks // slice_blocks)
    rows = group * num_q
    qg = query_rows(q, num_kv, k_pages.dtype)  # [KV, G*Tq, D]
    q_pos = (torch.arange(num_q, device=q.device) + num_tokens - num_q).repeat(group)  # [G*Tq]
    maxima = torch.empty((num_slices, num_kv, rows, 1), device=q.device)
    sums = torch.zeros((num_slices, num_kv, rows, slice_blocks), device=q.device)  # a short last slice: zeros
    for i in range(num_slices):
        b0, b1 = i * slice_blocks, min(num_blocks, (i + 1) * slice_blocks)
        keys = k_pages[:, b0:b1].reshape(num_kv, -1, dim)
        logits = torch.bmm(qg, keys.transpose(1, 2)).float().mul_(scale)  # [KV, G*Tq, n]
        if b1 * block > num_tokens - num_q + 1:  # the slice holds keys after the first query
            k_pos = torch.arange(b0 * block, b1 * block, device=q.device)
            logits.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            m = logits.amax(-1, keepdim=True)
            maxima[i] = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a slice wholly after a query
        else:
            torch.amax(logits, -1, keepdim=True, out=maxima[i])
        exp = logits.sub_(maxima[i]).exp_().view(num_kv, rows, b1 - b0, block)
        torch.sum(exp, -1, out=sums[i, :, :, :b1 - b0])
    weighted = sums * torch.exp(maxima - maxima.amax(0))  # [S, KV, G*Tq, slice]
    total = weighted.sum((0, 3))  # [KV, G*Tq]
    mass = (weighted / total[None, :, :, None]).sum(2)  # [S, KV, slice]
    return mass.transpose(0, 1).reshape(num_kv, -1)[:, :num_blocks]
