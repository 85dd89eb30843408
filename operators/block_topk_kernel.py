"""The best k entries of each row of block scores, in two Triton kernels, for decode's device
selection (ktlong/decode/device_selection.py).

torch.topk gives a row of 8,192 scores (1M tokens in 128-token blocks, one shared row) one
thread block: 45 us a layer on an H200, 1.4 ms of a 14 ms token. Here the row is cut into
chunks that programs sort side by side (`_chunk_best`: each keeps its best k), and one program a
row sorts those candidates (`_row_best`). Both sort keys that order as the scores do, with ties
going to the lower index, so the result is deterministic; the best k of the candidates are the
best k of the row.

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

CHUNK = 128  # scores a program of _chunk_best sorts (at least twice k's width)
MAX_WIDTH = 8192  # the most candidates _row_best sorts in one program; wider rows use torch.topk
MAX_INDEX = tl.constexpr(2**31 - 1)  # an index's complement fits the low half's 31 bits


@triton.jit
def _keys(x, index):
    """float32 scores and their int64 indexes -> int64 keys (see the module's doc)."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (MAX_INDEX - index)


@triton.jit
def _chunk_best(scores_ptr, keys_ptr, n, stride_row, CHUNK: tl.constexpr, WIDTH: tl.constexpr):
    """Row r, chunk c of the scores -> its best WIDTH keys, best first, at keys[r, c, :]."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(scores_ptr + row * stride_row + cols, mask=cols < n, other=float("-inf"))
    keys = tl.sort(_keys(x, cols.to(tl.int64)), descending=True)
    at = tl.arange(0, CHUNK)
    tl.store(keys_ptr + (row * tl.num_programs(1) + chunk) * WIDTH + at, keys, mask=at < WIDTH)


@triton.jit
def _row_best(keys_ptr, top_ptr, picked_ptr, count, k, CANDIDATES: tl.constexpr):
    """Row r's count candidate keys -> its best k scores (top[r]) and their indexes (picked[r]),
    best first."""
    row = tl.program_id(0)
    at = tl.arange(0, CANDIDATES)
    keys = tl.load(keys_ptr + row * count + at, mask=at < count, other=-(2**63) + 1)
    keys = tl.sort(keys, descending=True)
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    index = MAX_INDEX - (keys & 0x7FFFFFFF)
    tl.store(top_ptr + row * k + at, bits.to(tl.float32, bitcast=True), mask=at < k)
    tl.store(picked_ptr + row * k + at, index, mask=at < k)


def kernel_applies(num_scores: int, k: int) -> bool:
    """Rows whose chunks' candidates fit one program's sort, and a k a chunk can hold twice."""
    width = triton.next_power_of_2(max(k, 1))
    return 0 < k <= num_scores and 2 * width <= CHUNK and triton.cdiv(num_scores, CHUNK) * width <= MAX_WIDTH


def block_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, N] float32 -> (top [R, k] float32, picked [R, k] int64), best first, as
    torch.topk(scores, k, dim=1) gives them (ties: the lower index first). Fixed shapes, no sync."""
    expect("scores", scores, ndim=2, dtype=torch.float32)
    rows, n = scores.shape
    if not kernel_applies(n, k):
        raise ValueError(f"block_topk takes k up to {CHUNK // 2} of at most {MAX_WIDTH} candidates "
                         f"(here k {k} of {n} scores); use torch.topk")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    width = triton.next_power_of_2(k)
    chunks = triton.cdiv(n, CHUNK)
    keys = torch.empty((rows, chunks, width), dtype=torch.int64, device=scores.device)
    _chunk_best[(rows, chunks)](scores, keys, n, scores.stride(0), CHUNK=CHUNK, WIDTH=width)
    top = torch.empty((rows, k), dtype=torch.float32, device=scores.device)
    picked = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    count = chunks * width
    _row_best[(rows,)](keys, top, picked, count, k, CANDIDATES=triton.next_power_of_2(count))
    return top, picked
