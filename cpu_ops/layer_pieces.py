"""The small parts of a llama-family layer for one decode token, fused in Numba.

Between its products with the weights, a layer's decode step on the CPU does a few dozen small
operations (norms, residual adds, biases, RoPE, the cache write, the MLP's activation). As torch
calls they cost more than the products (tens of microseconds each, for vectors of a few hundred
floats); here they are four calls, each one pass over its vectors. Float32 throughout, as
torch's CPU path; the K/V rows are written as bfloat16 words, rounded to nearest even.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.bf16 import bf16_word
from cpu_ops.exp import exp_nonpositive


@nb.njit(cache=True, fastmath=True)
def add_rms_norm(x, delta, weight, eps, out):
    """x += delta (an empty delta adds nothing); out = x / rms(x) * weight. x, delta, weight, out: [n]."""
    n = x.shape[0]
    if delta.shape[0]:
        for i in range(n):
            x[i] += delta[i]
    total = np.float32(0.0)
    for i in range(n):
        total += x[i] * x[i]
    inverse = np.float32(1.0) / np.sqrt(total / np.float32(n) + np.float32(eps))
    for i in range(n):
        out[i] = x[i] * inverse * weight[i]


@nb.njit(inline="always", cache=True, fastmath=True)
def _rotate(src, cos, sin, dst):
    """dst = src with its first len(cos) channels rotated in half-split pairs (i, i + half)."""
    rot = cos.shape[0]
    half = rot // 2
    for i in range(half):
        dst[i] = src[i] * cos[i] - src[i + half] * sin[i]
        dst[i + half] = src[i + half] * cos[i + half] + src[i] * sin[i + half]
    for i in range(rot, src.shape[0]):
        dst[i] = src[i]


@nb.njit(cache=True, fastmath=True)
def place_qkv(qkv, bias, cos, sin, q, k_row, v_row):
    """The fused q/k/v product's row [(H + 2 KV) * D] (+ bias, when not empty) -> q [H, D] rotated;
    k rotated and v as bfloat16 words into the cache rows k_row, v_row [KV, D]."""
    num_heads, dim = q.shape
    num_kv = k_row.shape[0]
    if bias.shape[0]:
        for i in range(qkv.shape[0]):
            qkv[i] += bias[i]
    for h in range(num_heads):
        _rotate(qkv[h * dim:(h + 1) * dim], cos, sin, q[h])
    rotated = np.empty(dim, np.float32)
    for h in range(num_kv):
        start = (num_heads + h) * dim
        _rotate(qkv[start:start + dim], cos, sin, rotated)
        for c in range(dim):
            k_row[h, c] = bf16_word(rotated[c])
            v_row[h, c] = bf16_word(qkv[start + num_kv * dim + c])


@nb.njit(cache=True, fastmath=True, error_model="numpy")  # numpy's division: no zero check, so the loop vectorises
def silu_times(gate_up, out):
    """gate_up [2 I] (gate, then up) -> out [I] = silu(gate) * up."""
    n = out.shape[0]
    for i in range(n):
        g = gate_up[i]
        e = exp_nonpositive(-abs(g))  # sigmoid(g) from e**-|g|, which cannot overflow
        sigmoid = np.float32(1.0) / (np.float32(1.0) + e) if g >= 0 else e / (np.float32(1.0) + e)
        out[i] = g * sigmoid * gate_up[n + i]


@nb.njit(cache=True)
def add_rms_norm_rows(x, delta, weight, eps, out):
    """add_rms_norm over the rows of a prefill chunk: x [T, n] += delta [T, n] (an empty delta,
    [0, n], adds nothing); out [T, n] = the rows normalised, times weight."""
    for t in range(x.shape[0]):
        add_rms_norm(x[t], delta[t] if delta.shape[0] else delta[0:0, 0], weight, eps, out[t])


@nb.njit(cache=True)
def place_qkv_rows(qkv, bias, cos, sin, q, keys, values, start):
    """place_qkv over the rows of a prefill chunk: qkv [T, (H + 2 KV) * D] -> q [T, H, D]; row t's
    k and v as bfloat16 words into keys, values [KV, tokens, D] at position start + t. cos, sin:
    [T, rotated dims]."""
    for t in range(qkv.shape[0]):
        place_qkv(qkv[t], bias, cos[t], sin[t], q[t], keys[:, start + t], values[:, start + t])


@nb.njit(cache=True)
def silu_times_rows(gate_up, out):
    """silu_times over the rows of a prefill chunk: gate_up [T, 2 I] -> out [T, I]."""
    for t in range(gate_up.shape[0]):
        silu_times(gate_up[t], out[t])
