"""The best k entries of each row of block scores, in two Triton kernels, for decode's device
selection (ktlong/decode/device_selection.py).

torch.topk gives a row of 8,192 scores (1M tokens in 128-token blocks, one shared row) one
thread block: 45 us a layer on an H200, 1.4 ms of a 14 ms token. Here the row is cut into
chunks of 256 that programs sort side by side, each keeping its best k (`_chunk_best`), round
after round until one chunk is left, which one program sorts (`_row_best`): 8,192 scores take
three rounds of 256-entry sorts, where one program sorting all 2,048 candidates of the first
round took 129 us. The sorts order keys that order as the scores do, with ties going to the
lower index, so the result is deterministic; the best k of the candidates are the best k of
the row.

A key is an int64: the score's float32 bits made order-preserving as a signed int32 (negative
floats' magnitude bits flipped) in the high half, and MAX_INDEX - index in the low half.
Entries past the row's end are -inf with an index past every real one, so they rank below even a
real -inf (a block the selection's mask ruled out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.checks import expect

CHUNK = 256  # entries a program sorts: each keeps its best (at least twice k's width)
MAX_INDEX = tl.constexpr(2**31 - 1)  # an index's complement fits the low half's 31 bits
LEAST = tl.constexpr(-(2**63) + 1)  # below every key


@triton.jit
def _keys(x, index):
    """float32 scores and their int64 indexes -> int64 keys (see the module's doc)."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (MAX_INDEX - index)


@triton.jit
def _chunk_best(in_ptr, keys_ptr, n, stride_row, SCORES: tl.constexpr, CHUNK: tl.constexpr, WIDTH: tl.constexpr):
    """Row r, chunk c of the scores (SCORES) or of an earlier round's keys -> the chunk's best
    WIDTH keys, best first, at keys[r, c, :]."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    if SCORES:
        x = tl.load(in_ptr + row * stride_row + cols, mask=cols < n, other=float("-inf"))
        keys = _keys(x, cols.to(tl.int64))
    else:
        keys = tl.load(in_ptr + row * stride_row + cols, mask=cols < n, other=LEAST)
    keys = tl.sort(keys, descending=True)
    at = tl.arange(0, CHUNK)
    tl.store(keys_ptr + (row * tl.num_programs(1) + chunk) * WIDTH + at, keys, mask=at < WIDTH)


@triton.jit
def _row_best(keys_ptr, top_ptr, picked_ptr, count, k, CHUNK: tl.constexpr):
    """Row r's count (at most CHUNK) candidate keys -> its best k scores (top[r]) and their
    indexes (picked[r]), best first."""
    row = tl.program_id(0)
    at = tl.arange(0, CHUNK)
    keys = tl.load(keys_ptr + row * count + at, mask=at < count, other=LEAST)
    keys = tl.sort(keys, descending=True)
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    index = MAX_INDEX - (keys & 0x7FFFFFFF)
    tl.store(top_ptr + row * k + at, bits.to(tl.float32, bitcast=True), mask=at < k)
    tl.store(picked_ptr + row * k + at, index, mask=at < k)


def kernel_applies(num_scores: int, k: int) -> bool:
    """A k that a chunk holds at least twice, of scores that an int32 indexes."""
    return 0 < k <= num_scores < MAX_INDEX and 2 * triton.next_power_of_2(k) <= CHUNK


def block_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, N] float32 -> (top [R, k] float32, picked [R, k] int64), best first, as
    torch.topk(scores, k, dim=1) gives them (ties: the lower index first). Rounds of chunks
    sorted side by side, each keeping its best, until one chunk a row is left. Fixed shapes, no
    sync."""
    expect("scores", scores, ndim=2, dtype=torch.float32)
    rows, n = scores.shape
    if not kernel_applies(n, k):
        raise ValueError(f"block_topk takes a k of at most {CHUNK // 2} (here {k} of {n} scores); use torch.topk")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    width = triton.next_power_of_2(k)
    source, count, stride, first = scores, n, scores.stride(0), True
    while first or count > CHUNK:
        chunks = triton.cdiv(count, CHUNK)
        keys = torch.empty((rows, chunks, width), dtype=torch.int64, device=scores.device)
        _chunk_best[(rows, chunks)](source, keys, count, stride, SCORES=first, CHUNK=CHUNK, WIDTH=width)
        source, count, stride, first = keys, chunks * width, chunks * width, False
    top = torch.empty((rows, k), dtype=torch.float32, device=scores.device)
    picked = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    _row_best[(rows,)](source, top, picked, count, k, CHUNK=CHUNK)
    return top, picked
