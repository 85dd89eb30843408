"""Decode attention of one query over the keys held on the device (sinks and the local window),
with log-sum-exp: over a slice of valid keys, or over a whole buffer with the invalid ones masked
(fixed shapes, for CUDA graphs)."""

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


def masked_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
                            hi: torch.Tensor, scale: float):
    """q: [H, D]; k, v: [KV, N, D], a whole window buffer of which keys lo..hi-1 are valid (lo,
    hi: 0-dim device tensors) -> out [H, D] float32, lse [H] float32. Fixed shapes, no sync."""
    index = torch.arange(k.shape[1], device=q.device)
    scores = _masked_scores(q, k, ((index < lo) | (index >= hi))[None, None, :], scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse[..., None]).to(v.dtype), v).float()
    return out.reshape(q.shape), lse.reshape(q.shape[0])


def attention_over_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float):
    """q: [H, D]; k, v: [KV, N, D] of which each kv head's first valid[h] keys count (valid: [KV]
    device tensor; 0 allowed) -> out [H, D] float32, lse [H] float32 (-inf, out 0 where nothing
    counts). Fixed shapes, no sync."""
    index = torch.arange(k.shape[1], device=q.device)
    scores = _masked_scores(q, k, (index[None, :] >= valid[:, None])[:, None, :], scale)
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.bmm(torch.exp(scores - finite[..., None]).to(v.dtype), v).float()
    return out.reshape(q.shape), lse.reshape(q.shape[0])


def _masked_scores(q: torch.Tensor, k: torch.Tensor, invalid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D] against k [KV, N, D], each kv head's query heads together -> float32 scores
    [KV, G, N], -inf where invalid (broadcast to that shape)."""
    num_kv, _, dim = k.shape
    scores = torch.bmm(q.to(k.dtype).view(num_kv, -1, dim), k.transpose(1, 2)).float() * scale
    return scores.masked_fill(invalid, float("-inf"))
