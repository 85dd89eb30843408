"""Decode attention of one query over a few keys held on the device, with log-sum-exp."""

from __future__ import annotations

import torch


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q: [H, D]; k, v: [KV, N, D] (N may be 0) -> out [H, D] float32, lse [H] float32 (natural log)."""
    num_heads, dim = q.shape
    num_kv, n, _ = k.shape
    if n == 0:
        return (torch.zeros(num_heads, dim, device=q.device),
                torch.full((num_heads,), float("-inf"), device=q.device))
    group = num_heads // num_kv
    qg = q.to(k.dtype).view(num_kv, group, dim)
    # matmuls in the cache dtype (float32 accumulation), softmax in float32: no upcast copy of K/V
    scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale  # [KV, G, N]
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    out = torch.bmm(p.to(v.dtype), v).float()
    return out.reshape(num_heads, dim), lse.reshape(num_heads)
