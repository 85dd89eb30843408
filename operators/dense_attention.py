"""Dense causal attention in plain torch: the reference every other attention path is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from operators.merge_state import merge_states


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
    if num_q == 1 and q.device.type == "cpu":
        return _one_query(q, k, v, scale)
    if 1 < num_q < num_k and q.device.type == "cpu":
        return _chunk_after_history(q, k, v, scale)
    if num_q == 1 or num_q == num_k:
        mask, is_causal = None, num_q > 1
    else:
        rows = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
        mask, is_causal = torch.arange(num_k, device=q.device)[None, :] <= rows, False
    return _sdpa(q, k, v, mask, is_causal, scale)


def _one_query(q, k, v, scale) -> torch.Tensor:
    """A decode step on the CPU: each kv head's group of query heads in two batched products,
    so the keys and values are read once per kv head: 1.65x torch's fused kernel for groups of 7
    heads at 4K-16K keys on 2 cores, 1.06x for groups of 3. window_attention.attention_with_lse
    computes the same with its log-sum-exp, 20-30% slower here: a step that needs no lse takes
    the softmax."""
    num_kv, _, dim = k.shape
    group = q.shape[1] // num_kv
    scores = torch.bmm(q[0].view(num_kv, group, dim), k.transpose(1, 2))
    scores *= dim ** -0.5 if scale is None else scale
    out = torch.bmm(torch.softmax(scores, -1), v)  # [KV, G, D]
    return out.view(1, num_kv * group, dim)


def _chunk_after_history(q, k, v, scale) -> torch.Tensor:
    """A prefill chunk below its history on the CPU, without a mask: the history part takes
    each kv head's group of query heads as rows of one problem, the chunk's own keys a causal
    one (square, so `is_causal` aligns), and the two merge by their log-sum-exps. torch's masked
    kernel reads the [Tq, Tk] mask for every tile: 512 queries over 4,096 keys ran 1.22x faster
    split at SmolLM2's heads (9 over 3), 1.19x at Qwen2.5-0.5B's (14 over 2), 1.46x over 16,384
    keys (docs/measurements/2026-11-27-cpu-chunk-default.md). The log-sum-exp comes from the
    flash kernel that torch's own CPU dispatch calls."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    num_q, num_heads, dim = q.shape
    num_kv, num_k, _ = k.shape
    group, history = num_heads // num_kv, num_k - num_q
    heads = q.transpose(0, 1).contiguous()  # [H, Tq, D]: kv head j's group is one run of group*Tq rows
    out_h, lse_h = flash(heads.view(1, num_kv, group * num_q, dim), k[None, :, :history], v[None, :, :history],
                         scale=scale)[:2]
    own_k, own_v = (t[:, history:].repeat_interleave(group, 0)[None] for t in (k, v))
    out_d, lse_d = flash(heads[None], own_k, own_v, is_causal=True, scale=scale)[:2]
    out, _ = merge_states(out_h.reshape(-1, dim), lse_h.reshape(-1), out_d.reshape(-1, dim), lse_d.reshape(-1))
    return out.view(num_heads, num_q, dim).to(q.dtype).transpose(0, 1)


def _sdpa(q, k, v, mask, is_causal, scale) -> torch.Tensor:
    """torch's fused attention with a batch dimension: on the CPU, 3-D inputs take the math
    path, which builds the whole [H, Tq, Tk] score matrix; 4-D ones the flash kernel, 3-6x
    faster here and O(Tq) in memory."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[0])
    return out[0].transpose(0, 1)
