"""Dense causal attention in plain torch: the reference every other attention path is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float | None = None, window: int = 0) -> torch.Tensor:
    """Causal GQA attention with the queries aligned to the end of the keys (bottom-right).

    q: [Tq, H, D]; k, v: [KV, Tk, D] head-major (strided views are fine), Tk >= Tq,
    H a multiple of KV -> out [Tq, H, D]. Query i sits at position Tk - Tq + i and sees keys
    up to itself; with window > 0 only the last `window` of them (itself included).
    """
    num_q, num_heads, _ = q.shape
    num_kv_heads, num_k, _ = k.shape
    assert num_k >= num_q and num_heads % num_kv_heads == 0, (q.shape, k.shape)
    assert v.shape == k.shape
    if window and num_k > window:
        if num_q == 1:
            k, v, num_k = k[:, -window:], v[:, -window:], window
        else:
            rows = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
            cols = torch.arange(num_k, device=q.device)[None, :]
            mask = (cols <= rows) & (cols > rows - window)
            return _sdpa(q, k, v, mask, False, scale)
    if num_q == 1 or num_q == num_k:
        mask, is_causal = None, num_q > 1
    else:
        rows = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
        mask, is_causal = torch.arange(num_k, device=q.device)[None, :] <= rows, False
    return _sdpa(q, k, v, mask, is_causal, scale)


def _sdpa(q, k, v, mask, is_causal, scale) -> torch.Tensor:
    """torch's fused attention with a batch dimension: on the CPU, 3-D inputs take the math
    path, which builds the whole [H, Tq, Tk] score matrix; 4-D ones the flash kernel, 3-6x
    faster here and O(Tq) in memory."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[0])
    return out[0].transpose(0, 1)
