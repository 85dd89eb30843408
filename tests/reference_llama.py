"""An independent float64 llama-family forward written from the papers, for tests.

It reads the tensors exactly as GGUF stores them: for arch llama the q/k rows are in
llama.cpp's permuted order, so RoPE rotates adjacent pairs (2i, 2i+1); for qwen2 the rows
are in Hugging Face order and RoPE rotates (i, i + d/2). Attention is an explicit loop.
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
    h_q, h_kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = t["token_embd.weight"][token_ids]
    n = len(token_ids)
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        a = _rms(x, t[p + "attn_norm.weight"], spec.eps)
        q = a @ t[p + "attn_q.weight"].T + t.get(p + "attn_q.bias", 0)
        k = a @ t[p + "attn_k.weight"].T + t.get(p + "attn_k.bias", 0)
        v = a @ t[p + "attn_v.weight"].T + t.get(p + "attn_v.bias", 0)
        q = np.stack([_rope(q[j].reshape(h_q, d), j, spec.rope_base, adjacent) for j in range(n)])
        k = np.stack([_rope(k[j].reshape(h_kv, d), j, spec.rope_base, adjacent) for j in range(n)])
        v = v.reshape(n, h_kv, d)
        o = np.zeros((n, h_q, d))
        for head in range(h_q):
            kv = head // (h_q // h_kv)
            for j in range(n):
                s = k[: j + 1, kv] @ q[j, head] / np.sqrt(d)
                w = np.exp(s - s.max())
                o[j, head] = (w / w.sum()) @ v[: j + 1, kv]
        x = x + o.reshape(n, -1) @ t[p + "attn_output.weight"].T
        m = _rms(x, t[p + "ffn_norm.weight"], spec.eps)
        g = m @ t[p + "ffn_gate.weight"].T
        u = m @ t[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "ffn_down.weight"].T
    x = _rms(x, t["output_norm.weight"], spec.eps)
    head = t["token_embd.weight"] if spec.tied else t["output.weight"]
    return x @ head.T
