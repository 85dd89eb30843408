"""Dense causal attention in plain torch: the reference every sparse path is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention with the queries aligned to the end of the keys (bottom-right).

    q: [Tq, H, D]; k, v: [Tk, KV, D] with Tk >= Tq and H a multiple of KV -> out [Tq, H, D].
    Query i sits at position Tk - Tq + i and sees keys 0 .. Tk - Tq + i.
    """
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads, _ = k.shape
    assert num_k >= num_q and num_heads % num_kv_heads == 0, (q.shape, k.shape)
    assert v.shape == k.shape
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    if num_q == 1 or num_q == num_k:
        mask, is_causal = None, num_q > 1
    else:
        offset = num_k - num_q
        rows = torch.arange(num_q, device=q.device)[:, None] + offset
        mask, is_causal = torch.arange(num_k, device=q.device)[None, :] <= rows, False
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=num_heads != num_kv_heads)
    return out.transpose(0, 1)
