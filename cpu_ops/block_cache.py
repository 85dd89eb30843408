"""The host's bookkeeping of a device cache of recently selected KV blocks (one global layer's
share): which block each slot holds, which slot holds each block, when a slot was last read.

Per kv head there are `slots` slots. A decode step's selected blocks split into hits (held in a
slot) and misses; misses, up to a bound, are admitted into the least recently used slots (never
one read this step) and their pages gathered from DRAM into a staging buffer, which the device
copies into those slots before it attends to the hits and the admitted blocks. The CPU attends to
the misses left over, from DRAM.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def split_hits(blocks, counts, slot_of, last_used, step, stride, block_size, hit_index, hit_valid,
               miss_blocks, miss_counts):
    """blocks [KV, S] int32 (first counts[h] used); slot_of [KV, NB] int32 (-1: not held);
    last_used [KV, C] int64, set to step for every slot hit. Writes, per kv head h, the hits as
    rows h * stride + slot of the device cache (hit_index [KV, S'] int64, the rest of the row left
    as it is) and their token count (hit_valid [KV] = hits x block_size), and the misses
    (miss_blocks [KV, S] / miss_counts), each in the order of blocks."""
    for h in range(blocks.shape[0]):
        nh = 0
        nm = 0
        for i in range(counts[h]):
            b = blocks[h, i]
            s = slot_of[h, b]
            if s >= 0:
                hit_index[h, nh] = h * stride + s
                last_used[h, s] = step
                nh += 1
            else:
                miss_blocks[h, nm] = b
                nm += 1
        hit_valid[h] = nh * block_size
        miss_counts[h] = nm


@nb.njit(cache=True)
def admit_misses(miss_blocks, miss_counts, slot_of, block_in, last_used, step, max_admit, stride, block_size,
                 hit_index, hit_valid, admit_heads, admit_blocks, admit_slots):
    """Give misses the least recently used slot of their head that this step did not read, up to
    max_admit in all (heads taken in turn, each head's misses in order, so one head cannot take
    every admission). An admitted block counts as held at once and joins this step's device
    rows after the hits (hit_index / hit_valid, as split_hits wrote them): the device copies its
    staged pages in before it attends. The misses left (not admitted) move to the front of
    miss_blocks, miss_counts says how many: the CPU reads those. Returns how many were admitted;
    admit_*[:n] say which (head, block) went to which slot."""
    num_kv, num_slots = block_in.shape
    n = 0
    admitted = np.zeros(num_kv, np.int64)
    full = np.zeros(num_kv, np.bool_)  # every slot of the head was read this step
    progress = True
    while progress and n < max_admit:
        progress = False
        for h in range(num_kv):
            if full[h] or admitted[h] >= miss_counts[h] or n >= max_admit:
                continue
            victim = -1
            oldest = step  # slots read this step (last_used == step) are never evicted
            for s in range(num_slots):
                if last_used[h, s] < oldest:
                    oldest = last_used[h, s]
                    victim = s
            if victim < 0:
                full[h] = True
                continue
            b = miss_blocks[h, admitted[h]]
            admitted[h] += 1
            old = block_in[h, victim]
            if old >= 0:
                slot_of[h, old] = -1
            block_in[h, victim] = b
            slot_of[h, b] = victim
            last_used[h, victim] = step
            rows = hit_valid[h] // block_size
            hit_index[h, rows] = h * stride + victim
            hit_valid[h] += block_size
            admit_heads[n], admit_blocks[n], admit_slots[n] = h, b, victim
            n += 1
            progress = True
    for h in range(num_kv):
        left = miss_counts[h] - admitted[h]
        for i in range(left):
            miss_blocks[h, i] = miss_blocks[h, admitted[h] + i]
        miss_counts[h] = left
    return n


@nb.njit(cache=True, parallel=True)
def gather_pages(k, v, heads, blocks, n, out):
    """out[i, 0] = k[heads[i], blocks[i]] and out[i, 1] = v[...] for i < n: pages [B, R] of two
    head-major [KV, NB, B, R] arrays into a C-contiguous [A, 2, B, R] (the first n admissions'
    K and V one run, which the device copies in one piece). Each page is copied as one
    flat run (a slice assignment of the 2-D page ran at a sixth of the speed), on the decode
    threads."""
    for item in nb.prange(2 * n):
        i = item % n
        if item < n:
            _copy_flat(k[heads[i], blocks[i]].ravel(), out[i, 0].ravel())
        else:
            _copy_flat(v[heads[i], blocks[i]].ravel(), out[i, 1].ravel())


@nb.njit(inline="always", cache=True)
def _copy_flat(src, dst):
    for t in range(src.size):
        dst[t] = src[t]
