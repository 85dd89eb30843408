"""Decode attention of G query heads per kv head over selected blocks, on the CPU.

The (kv head, selected block) pairs are cut into one equal share per thread, whatever the
number of kv heads, so every thread is busy; each share keeps an online softmax (running max,
sum, weighted values) per query head, block by block, and the shares merge at the end. The result is the output
[H, D] and the natural-log log-sum-exp [H], so it can merge with another attention part.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from cpu_ops import named_for
from cpu_ops.bf16 import as_float32
from cpu_ops.checks import expect
from cpu_ops.exp import exp_nonpositive
from cpu_ops.kv_storage import KIND, StoredKV, decode, load_rows
from cpu_ops.prefetch import prefetch


ROWS = 4  # rows of a block widened at a time: a whole block (64 KiB) would leave L1


@nb.njit(inline="always", cache=True, fastmath=True)
def _block_logits(q, group, block, valid, scale, logits):
    """logits[g, t] = scale * q[g] . block[t] for g < group; block: float32 rows, or bfloat16
    words read as they are stored (as_float32). Four query heads share one pass over each key
    row (four vector accumulators), so a key is loaded once per four heads."""
    dim = q.shape[1]
    g = 0
    while g + 4 <= group:
        q0, q1, q2, q3 = q[g], q[g + 1], q[g + 2], q[g + 3]
        for t in range(valid):
            row = block[t]
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for c in range(dim):
                x = as_float32(row[c])
                s0 += q0[c] * x
                s1 += q1[c] * x
                s2 += q2[c] * x
                s3 += q3[c] * x
            logits[g, t], logits[g + 1, t] = s0 * scale, s1 * scale
            logits[g + 2, t], logits[g + 3, t] = s2 * scale, s3 * scale
        g += 4
    while g < group:
        qg = q[g]
        for t in range(valid):
            row = block[t]
            s0 = np.float32(0.0)
            for c in range(dim):
                s0 += qg[c] * as_float32(row[c])
            logits[g, t] = s0 * scale
        g += 1


@nb.njit(inline="always", cache=True, fastmath=True)
def _accumulate_values(acc, p, group, block, valid):
    """acc[g] += sum_t p[g, t] block[t] (block as in _block_logits), four value rows per pass so
    that each accumulator row is loaded and stored once per four tokens rather than once per
    token."""
    dim = acc.shape[1]
    for g in range(group):
        a, pg = acc[g], p[g]
        t = 0
        while t + 4 <= valid:
            p0, p1, p2, p3 = pg[t], pg[t + 1], pg[t + 2], pg[t + 3]
            r0, r1, r2, r3 = block[t], block[t + 1], block[t + 2], block[t + 3]
            for c in range(dim):
                a[c] += (p0 * as_float32(r0[c]) + p1 * as_float32(r1[c]) + p2 * as_float32(r2[c])
                         + p3 * as_float32(r3[c]))
            t += 4
        while t < valid:
            p0, r0 = pg[t], block[t]
            for c in range(dim):
                a[c] += p0 * as_float32(r0[c])
            t += 1


@nb.njit(parallel=True, cache=True)
def _merge_items(part_m, part_l, part_acc, out, lse):
    num_kv, items, group, dim = part_acc.shape
    for w in nb.prange(num_kv * group):
        h, g = w // group, w % group
        m = -np.inf
        for i in range(items):
            m = max(m, part_m[h, i, g])
        total = 0.0
        for c in range(dim):
            out[h * group + g, c] = 0.0
        if m == -np.inf:
            lse[h * group + g] = -np.inf
            continue
        for i in range(items):
            if part_m[h, i, g] == -np.inf:  # an item that did not touch this head
                continue
            wgt = math.exp(part_m[h, i, g] - m)
            total += part_l[h, i, g] * wgt
            for c in range(dim):
                out[h * group + g, c] += part_acc[h, i, g, c] * wgt
        for c in range(dim):
            out[h * group + g, c] /= total
        lse[h * group + g] = m + math.log(total)


def _compile(name: str):
    """A storage kind's partial attention: its number (KIND) is a constant of the kernel (a
    closure's variable), so it compiles the one reader it uses, not all five; with the slice
    assignments written as loops, in a third to a half of the time (either change alone saves
    a tenth to a third)."""
    kind = KIND[name]

    @nb.njit(parallel=True, cache=True, fastmath=True)
    @named_for(name)
    def partial_attention(k_data, k_scales, v_data, v_scales, q, blocks, counts, num_tokens, block_size, scale,
                          part_m, part_l, part_acc):
        """Work item i takes an equal share of all (kv head, selected block) pairs, in order, so the
        items cost the same whatever the head count; a share that spans heads leaves one partial
        state per head it touched in part_*[h, i] (the others stay empty: m = -inf, l = 0)."""
        items = part_m.shape[1]
        num_heads, dim = q.shape
        num_kv = blocks.shape[0]
        group = num_heads // num_kv
        total = 0
        for h in range(num_kv):
            total += counts[h]
        per = (total + items - 1) // items
        for i in nb.prange(items):
            start, stop = i * per, min(total, (i + 1) * per)
            rows_u32 = np.empty((ROWS, dim), np.uint32)
            rows = rows_u32.view(np.float32)  # a few widened K or V rows (not bfloat16), reused
            # query heads in passes of four (_block_logits); a group of 4k + 2 or 4k + 3 heads is padded
            # with zero heads to a last whole pass, which costs less than two or three single ones
            padded = group + 4 - group % 4 if group % 4 >= 2 else group
            q_group = np.zeros((padded, dim), np.float32)
            # bfloat16 blocks are read where they lie when one pass of four heads covers the group;
            # with more, each row is widened once into `rows` for all of them, as the other kinds
            # always are (with the padding, 2.2x for Qwen's group of 7 over 16K cached tokens)
            in_place = kind == 0 and padded <= 4
            logits = np.empty((padded, block_size), np.float32)
            m = np.empty(group, np.float32)
            l = np.empty(group, np.float32)
            acc = np.empty((group, dim), np.float32)
            head_start = 0
            for h in range(num_kv):
                lo, hi = max(start - head_start, 0), min(stop - head_start, counts[h])
                head_start += counts[h]
                for g in range(group):
                    part_m[h, i, g], part_l[h, i, g] = -np.inf, 0.0
                if lo >= hi:
                    continue
                for g in range(group):  # written out: a slice assignment compiles numpy's broadcasting
                    m[g], l[g] = -np.inf, 0.0  # and its error path into every kernel (a third of its compile)
                    for c in range(dim):
                        acc[g, c] = 0.0
                        q_group[g, c] = q[h * group + g, c]
                for idx in range(lo, hi):
                    b = blocks[h, idx]
                    valid = min(block_size, num_tokens - b * block_size)
                    if idx + 1 < hi:  # the next block streams in while this one is computed
                        prefetch(k_data[h, blocks[h, idx + 1]])
                        prefetch(v_data[h, blocks[h, idx + 1]])
                    if in_place:
                        _block_logits(q_group, padded, k_data[h, b], valid, scale, logits)
                    else:  # widened ROWS rows at a time into a buffer that stays in L1
                        for t in range(0, valid, ROWS):
                            n = min(ROWS, valid - t)
                            load_rows(kind, k_data, k_scales, h, b, t, n, rows_u32, rows)
                            _block_logits(q_group, padded, rows, n, scale, logits[:, t:t + n])
                    for g in range(group):  # online softmax: rescale what came before to the new max
                        row_p = logits[g]
                        block_max = -np.inf
                        for t in range(valid):
                            block_max = max(block_max, row_p[t])
                        new_m = max(m[g], block_max)
                        correction = math.exp(m[g] - new_m)
                        l[g] *= correction
                        for c in range(dim):
                            acc[g, c] *= correction
                        m[g] = new_m
                        for t in range(valid):
                            row_p[t] -= new_m
                        s = np.float32(0.0)
                        for t in range(valid):
                            row_p[t] = exp_nonpositive(row_p[t])
                            s += row_p[t]
                        l[g] += s
                    if in_place:
                        _accumulate_values(acc, logits, group, v_data[h, b], valid)
                    else:
                        for t in range(0, valid, ROWS):
                            n = min(ROWS, valid - t)
                            load_rows(kind, v_data, v_scales, h, b, t, n, rows_u32, rows)
                            _accumulate_values(acc, logits[:, t:t + n], group, rows, n)
                for g in range(group):
                    part_m[h, i, g] = m[g]
                    part_l[h, i, g] = l[g]
                    for c in range(dim):
                        part_acc[h, i, g, c] = acc[g, c]

    return partial_attention


PARTIAL_ATTENTION = {name: _compile(name) for name in KIND}  # storage kind's name -> its kernel


def attend_into(kind: str, k_data, k_scales, v_data, v_scales, q, blocks, counts, num_tokens, block_size, scale,
                part_m, part_l, part_acc, out, lse):
    """sparse_attention's work with its checks done and its buffers given (part_*: [KV, items,
    G(, D)], one share of the blocks per item), for a decode step that calls it every layer: the
    kind's partial states, then their merge, a kernel apart (within a fastmath kernel, its test
    for an empty state, m == -inf, would be folded away)."""
    PARTIAL_ATTENTION[kind](k_data, k_scales, v_data, v_scales, q, blocks, counts, num_tokens, block_size, scale,
                            part_m, part_l, part_acc)
    _merge_items(part_m, part_l, part_acc, out, lse)


def sparse_attention(q: np.ndarray, k: StoredKV, v: StoredKV, blocks: np.ndarray, counts: np.ndarray,
                     num_tokens: int, block_size: int, scale: float, threads: int | None = None):
    """q: float32 [H, D]; blocks: int32 [KV, S] (first counts[h] used, any order) ->
    out float32 [H, D], lse float32 [H] (natural log)."""
    expect("q", q, ndim=2, dtype=np.float32)
    expect("blocks", blocks, ndim=2, dtype=np.int32)
    num_heads, dim = q.shape
    num_kv = blocks.shape[0]
    expect("counts", counts, shape=(num_kv,), dtype=np.int32)
    if k.kind != v.kind or k.head_dim != dim or num_heads % num_kv:
        raise ValueError(f"k and v ({k.kind}, {v.kind}, head_dim {k.head_dim}) must be one kind with q's head_dim "
                         f"{dim}, and q's {num_heads} heads whole groups of blocks' {num_kv} kv heads")
    if (counts > blocks.shape[1]).any() or (counts < 0).any():
        raise ValueError(f"counts {counts.tolist()} must lie in 0..{blocks.shape[1]} (blocks' width)")
    items = max(1, threads or nb.get_num_threads())  # one equal share of the blocks per thread
    group = num_heads // num_kv
    out = np.empty((num_heads, dim), np.float32)
    lse = np.empty(num_heads, np.float32)
    attend_into(k.kind, k.data, k.scales if k.scales.ndim == 4 else NO_SCALES, v.data,
                v.scales if v.scales.ndim == 4 else NO_SCALES, np.ascontiguousarray(q, np.float32), blocks,
                counts, num_tokens, block_size, np.float32(scale), np.empty((num_kv, items, group), np.float32),
                np.empty((num_kv, items, group), np.float32), np.empty((num_kv, items, group, dim), np.float32),
                out, lse)
    return out, lse


NO_SCALES = np.zeros((1, 1, 1, 1), np.uint16)  # the scales of a type that has none (never read)


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
