"""Decode attention of G query heads per kv head over selected blocks, on the CPU.

Work is split over (kv head, range of selected blocks) so that every thread is busy even
with 8 kv heads; each split keeps an online softmax (running max, sum, weighted values)
per query head, block by block, and the splits merge at the end. The result is the output
[H, D] and the natural-log log-sum-exp [H], so it can merge with another attention part.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from cpu_ops.kv_storage import KIND, StoredKV, decode, load_block


LOG2E = np.float32(1.4426950408889634)


@nb.njit(inline="always", cache=True, fastmath=True)
def exp_inplace(x, n, bits_i32, bits_f32):
    """x[:n] = exp(x[:n]) for x <= 0, by 2^(x log2 e) = 2^k * p(f): a loop LLVM vectorises
    (math.exp stays scalar). Relative error below 1.1e-5 (measured); below -87 the result is 0.
    bits_f32 aliases bits_i32."""
    for i in range(n):
        y = max(x[i] * LOG2E, np.float32(-126.0))
        k = np.floor(y)
        f = y - k  # [0, 1)
        p = np.float32(1.5403530393381606e-4)
        p = p * f + np.float32(1.3333558146428443e-3)
        p = p * f + np.float32(9.6181291076284772e-3)
        p = p * f + np.float32(5.5504108664821580e-2)
        p = p * f + np.float32(2.4022650695910071e-1)
        p = p * f + np.float32(6.9314718055994531e-1)
        p = p * f + np.float32(1.0)
        bits_i32[i] = (np.int32(k) + 127) << 23
        x[i] = p * bits_f32[i] if x[i] > np.float32(-87.0) else np.float32(0.0)


@nb.njit(parallel=True, cache=True, fastmath=True)
def _partial_attention(kind, k_data, k_scales, v_data, v_scales, q, blocks, counts, num_tokens,
                       block_size, scale, splits, part_m, part_l, part_acc):
    num_heads, dim = q.shape
    num_kv = blocks.shape[0]
    group = num_heads // num_kv
    for w in nb.prange(num_kv * splits):
        h, s = w // splits, w % splits
        n = counts[h]
        per = (n + splits - 1) // splits
        lo, hi = s * per, min(n, (s + 1) * per)
        block_u32 = np.empty((block_size, dim), np.uint32)
        block = block_u32.view(np.float32)  # one widened K or V block, reused
        logits = np.empty((group, block_size), np.float32)
        pow_i32 = np.empty(block_size, np.int32)
        pow_f32 = pow_i32.view(np.float32)
        m = np.full(group, -np.inf, np.float32)
        l = np.zeros(group, np.float32)
        acc = np.zeros((group, dim), np.float32)
        for idx in range(lo, hi):
            b = blocks[h, idx]
            valid = min(block_size, num_tokens - b * block_size)
            load_block(kind, k_data, k_scales, h, b, valid, block_u32, block)
            for g in range(group):
                qg = q[h * group + g]
                for t in range(valid):
                    d = np.float32(0.0)
                    for c in range(dim):
                        d += qg[c] * block[t, c]
                    logits[g, t] = d * scale
            for g in range(group):
                block_max = -np.inf
                for t in range(valid):
                    block_max = max(block_max, logits[g, t])
                new_m = max(m[g], block_max)
                correction = math.exp(m[g] - new_m)
                l[g] *= correction
                for c in range(dim):
                    acc[g, c] *= correction
                m[g] = new_m
                row_p = logits[g]
                for t in range(valid):
                    row_p[t] -= new_m
                exp_inplace(row_p, valid, pow_i32, pow_f32)
                total = np.float32(0.0)
                for t in range(valid):
                    total += row_p[t]
                l[g] += total
            load_block(kind, v_data, v_scales, h, b, valid, block_u32, block)
            for g in range(group):
                for t in range(valid):
                    p = logits[g, t]
                    for c in range(dim):
                        acc[g, c] += p * block[t, c]
        for g in range(group):
            part_m[h, s, g] = m[g]
            part_l[h, s, g] = l[g]
            for c in range(dim):
                part_acc[h, s, g, c] = acc[g, c]


@nb.njit(parallel=True, cache=True)
def _merge_splits(part_m, part_l, part_acc, out, lse):
    num_kv, splits, group, dim = part_acc.shape
    for w in nb.prange(num_kv * group):
        h, g = w // group, w % group
        m = -np.inf
        for s in range(splits):
            m = max(m, part_m[h, s, g])
        total = 0.0
        for c in range(dim):
            out[h * group + g, c] = 0.0
        if m == -np.inf:
            lse[h * group + g] = -np.inf
            continue
        for s in range(splits):
            wgt = math.exp(part_m[h, s, g] - m)
            total += part_l[h, s, g] * wgt
            for c in range(dim):
                out[h * group + g, c] += part_acc[h, s, g, c] * wgt
        for c in range(dim):
            out[h * group + g, c] /= total
        lse[h * group + g] = m + math.log(total)


def num_splits(num_kv_heads: int, threads: int) -> int:
    """Enough splits that (kv head, split) work items give every thread two of them."""
    return max(1, -(-2 * threads // num_kv_heads))


def sparse_attention(q: np.ndarray, k: StoredKV, v: StoredKV, blocks: np.ndarray, counts: np.ndarray,
                     num_tokens: int, block_size: int, scale: float, threads: int | None = None):
    """q: float32 [H, D]; blocks: int32 [KV, S] (first counts[h] used, any order) ->
    out float32 [H, D], lse float32 [H] (natural log)."""
    num_heads, dim = q.shape
    num_kv = blocks.shape[0]
    assert k.kind == v.kind and k.head_dim == dim and num_heads % num_kv == 0
    assert counts.shape == (num_kv,) and (counts <= blocks.shape[1]).all()
    splits = num_splits(num_kv, threads or nb.get_num_threads())
    group = num_heads // num_kv
    part_m = np.empty((num_kv, splits, group), np.float32)
    part_l = np.empty((num_kv, splits, group), np.float32)
    part_acc = np.empty((num_kv, splits, group, dim), np.float32)
    _partial_attention(KIND[k.kind], k.data, k.scales if k.scales.ndim == 4 else _NO_SCALES, v.data,
                       v.scales if v.scales.ndim == 4 else _NO_SCALES, np.ascontiguousarray(q, np.float32),
                       blocks, counts, num_tokens, block_size, np.float32(scale), splits, part_m, part_l,
                       part_acc)
    out = np.empty((num_heads, dim), np.float32)
    lse = np.empty(num_heads, np.float32)
    _merge_splits(part_m, part_l, part_acc, out, lse)
    return out, lse


_NO_SCALES = np.zeros((1, 1, 1, 1), np.float32)


def sparse_attention_reference(q, k: StoredKV, v: StoredKV, block_lists, num_tokens, block_size, scale):
    """float64 numpy: each kv head's query heads attend to the tokens of its listed blocks."""
    keys, values = decode(k).astype(np.float64), decode(v).astype(np.float64)
    num_heads, dim = q.shape
    num_kv = keys.shape[0]
    group = num_heads // num_kv
    out, lse = np.zeros((num_heads, dim)), np.full(num_heads, -np.inf)
    for h in range(num_kv):
        tok = [(b, t) for b in block_lists[h] for t in range(min(block_size, num_tokens - b * block_size))]
        if not tok:
            continue
        kk = np.stack([keys[h, b, t] for b, t in tok])
        vv = np.stack([values[h, b, t] for b, t in tok])
        for g in range(group):
            s = kk @ q[h * group + g].astype(np.float64) * scale
            mx = s.max()
            p = np.exp(s - mx)
            out[h * group + g] = p @ vv / p.sum()
            lse[h * group + g] = mx + np.log(p.sum())
    return out, lse
