"""An independent float64 llama-family forward written from the papers, for tests.

It reads the tensors exactly as GGUF stores them: for arch llama the q/k rows are in
llama.cpp's permuted order, so RoPE rotates adjacent pairs (2i, 2i+1); for qwen2 and gemma3
the rows are in Hugging Face order and RoPE rotates (i, i + d/2). Attention is an explicit
loop. gemma3 (as written by llama.cpp, norm weights already 1 + w): q/k norms, post norms,
GELU-tanh, embeddings times sqrt(hidden), every 6th layer global with base rope_base, the
others sliding over the last `sliding_window` tokens with RoPE base 10000.
"""

from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, base, adjacent_pairs):
    # x: [H, D] at position pos
    d = x.shape[-1]
    out = x.copy()
    for i in range(d // 2):
        theta = pos * base ** (-2.0 * i / d)
        c, s = np.cos(theta), np.sin(theta)
        a, b = (2 * i, 2 * i + 1) if adjacent_pairs else (i, i + d // 2)
        out[:, a] = x[:, a] * c - x[:, b] * s
        out[:, b] = x[:, b] * c + x[:, a] * s
    return out


def reference_logits(t: dict[str, np.ndarray], spec, token_ids: list[int]) -> np.ndarray:
    t = {k: v.astype(np.float64) for k, v in t.items()}
    adjacent = spec.arch == "llama"
    gemma = spec.arch == "gemma3"
    h_q, h_kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = t["token_embd.weight"][token_ids] * (np.sqrt(spec.hidden) if gemma else 1.0)
    n = len(token_ids)
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        sliding = gemma and spec.sliding_window and (i + 1) % 6 != 0
        base = 10000.0 if sliding else spec.rope_base
        a = _rms(x, t[p + "attn_norm.weight"], spec.eps)
        q = (a @ t[p + "attn_q.weight"].T + t.get(p + "attn_q.bias", 0)).reshape(n, h_q, d)
        k = (a @ t[p + "attn_k.weight"].T + t.get(p + "attn_k.bias", 0)).reshape(n, h_kv, d)
        v = (a @ t[p + "attn_v.weight"].T + t.get(p + "attn_v.bias", 0)).reshape(n, h_kv, d)
        if gemma:
            q, k = _rms(q, t[p + "attn_q_norm.weight"], spec.eps), _rms(k, t[p + "attn_k_norm.weight"], spec.eps)
        q = np.stack([_rope(q[j], j, base, adjacent) for j in range(n)])
        k = np.stack([_rope(k[j], j, base, adjacent) for j in range(n)])
        o = np.zeros((n, h_q, d))
        for head in range(h_q):
            kv = head // (h_q // h_kv)
            for j in range(n):
                lo = max(0, j + 1 - spec.sliding_window) if sliding else 0
                s = k[lo: j + 1, kv] @ q[j, head] / np.sqrt(d)
                w = np.exp(s - s.max())
                o[j, head] = (w / w.sum()) @ v[lo: j + 1, kv]
        attn = o.reshape(n, -1) @ t[p + "attn_output.weight"].T
        x = x + (_rms(attn, t[p + "post_attention_norm.weight"], spec.eps) if gemma else attn)
        m = _rms(x, t[p + "ffn_norm.weight"], spec.eps)
        g = m @ t[p + "ffn_gate.weight"].T
        u = m @ t[p + "ffn_up.weight"].T
        if gemma:
            act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            x = x + _rms((act * u) @ t[p + "ffn_down.weight"].T, t[p + "post_ffw_norm.weight"], spec.eps)
        else:
            x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "ffn_down.weight"].T
    x = _rms(x, t["output_norm.weight"], spec.eps)
    head = t["token_embd.weight"] if spec.tied else t["output.weight"]
    return x @ head.T
