"""The Numba sparse decode operator at LLaMA-3.1-8B shapes, against the host's read bandwidth.

python -m ktlong.bench decode-op [--contexts 32k,128k,512k] [--top_k 96] [--local 4096]
    [--kv_type bf16] [--threads N]

Per layer and token: selection (score every block's anchors, top-k) and attention over the
kept blocks (sink + top-k + local window), bytes read, effective GB/s and its ratio to a
Numba streaming read measured in the same run, and the speedup over the same kernel with
every block selected.
"""

from __future__ import annotations

import argparse
import time

import numba as nb
import numpy as np

from cpu_ops.bf16 import to_bf16
from cpu_ops.block_select import block_scores, select_blocks
from cpu_ops.kv_storage import StoredKV, encode
from cpu_ops.sparse_attention import sparse_attention
from cpu_ops.threads import set_decode_threads, usable_cores
from ktlong.bench.common import median
from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.errors import KtlongError
from ktlong.kv.free_memory import GIB, available_dram_bytes

KV, H, D, B = 8, 32, 128, 128


@nb.njit(parallel=True, cache=True, fastmath=True)
def _stream_sum(a, parts):
    n = a.shape[0]
    per = (n + parts - 1) // parts
    out = np.zeros(parts, np.float32)
    for p in nb.prange(parts):
        s = np.float32(0.0)
        for i in range(p * per, min(n, (p + 1) * per)):
            s += a[i]
        out[p] = s
    return out.sum()


def stream_read_gbps(nbytes: int) -> float:
    a = np.ones(nbytes // 4, np.float32)
    parts = nb.get_num_threads() * 4
    _stream_sum(a, parts)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        _stream_sum(a, parts)
        times.append(time.perf_counter() - t)
    return nbytes / median(times) / 1e9


def random_storage(num_blocks: int, kind: str, rng) -> StoredKV:
    parts = [encode(rng.standard_normal((1, num_blocks, B, D), dtype=np.float32), kind) for _ in range(KV)]
    scales = np.concatenate([p.scales for p in parts]) if parts[0].scales.ndim == 4 else parts[0].scales
    return StoredKV(kind, np.concatenate([p.data for p in parts]), scales)


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench decode-op", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32k,128k,512k")
    p.add_argument("--top_k", type=int, default=96)
    p.add_argument("--local", type=int, default=4096)
    p.add_argument("--kv_type", default="bf16", choices=["bf16", "fp16", "q8_0", "q4_0"])
    p.add_argument("--threads", type=int, default=0, help="Numba threads (0 = every core but one)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    contexts = parse_lengths(args.contexts)
    in_range("--top_k", args.top_k, 1, 4096, "the blocks each kv head selects")
    in_range("--local", args.local, 0, min(contexts) - B, "the window's tokens, a block below the shortest context")
    in_range("--threads", args.threads, 0, usable_cores(), "the Numba threads (0: every core but one)")
    in_range("--reps", args.reps, 1, 1000, "the timed repetitions of each row")
    # keys and values of 2 bytes or fewer, one head's float32 values while they are encoded, and
    # the 1 GiB the streaming read measures
    longest, free = max(contexts), available_dram_bytes()
    need = 2 * KV * longest * D * 2 + longest * D * 4 + GIB
    if need > free:
        raise KtlongError(f"--contexts up to {longest:,} tokens need {need / GIB:.1f} GiB of DRAM but "
                          f"{free / GIB:.1f} GiB is free; use shorter contexts.")
    threads = set_decode_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"{threads} threads; {KV} kv heads, {H} q heads, d {D}, "
          f"block {B}, kv {args.kv_type}, top-k {args.top_k}, local {args.local} tokens; medians of {args.reps}; "
          "stream: a Numba streaming read of 1 GiB, measured just before each row's attention")
    rows = []
    q = rng.standard_normal((H, D), dtype=np.float32)
    for context in contexts:
        num_blocks = context // B
        k, v = random_storage(num_blocks, args.kv_type, rng), random_storage(num_blocks, args.kv_type, rng)
        anchors = to_bf16(rng.standard_normal((KV, num_blocks, 1, D), dtype=np.float32))
        local_first = max(context - args.local, 0) // B
        ids = np.arange(1, local_first, dtype=np.int32)  # block 0 is the sink
        top = np.zeros((KV, max(args.top_k, 1)), np.int32)
        blocks = np.zeros((KV, num_blocks), np.int32)
        counts = np.zeros(KV, np.int32)

        def select():  # as the decoder does (SHARED), then the sink and the local window join
            select_blocks(block_scores(q, anchors, ids, 0, True), ids, args.top_k, top, counts)
            n = counts[0]
            blocks[:, 0], blocks[:, 1:n + 1] = 0, top[:, :n]
            blocks[:, n + 1:n + 1 + num_blocks - local_first] = np.arange(local_first, num_blocks)
            counts[:] = n + 1 + num_blocks - local_first

        select_s = timed(select, args.reps)
        select()
        kept = int(counts[0])
        bandwidth = stream_read_gbps(1 << 30)  # next to the measurement it is the yardstick of
        attend_s = timed(lambda: sparse_attention(q, k, v, blocks, counts, context, B, D ** -0.5), args.reps)
        all_blocks = np.tile(np.arange(num_blocks, dtype=np.int32), (KV, 1))
        all_counts = np.full(KV, num_blocks, np.int32)
        full_s = timed(lambda: sparse_attention(q, k, v, all_blocks, all_counts, context, B, D ** -0.5),
                       max(3, args.reps // 4))
        kv_bytes = kept * B * KV * 2 * k.nbytes_per_token()
        anchor_bytes = anchors.nbytes
        gbps = kv_bytes / attend_s / 1e9
        rows.append([f"{context // 1024}K", kept, f"{select_s * 1e6:,.0f}", f"{anchor_bytes / 1e6:.1f}",
                     f"{attend_s * 1e6:,.0f}", f"{kv_bytes / 1e6:.1f}", f"{gbps:.1f}", f"{bandwidth:.1f}", f"{gbps / bandwidth:.0%}",
                     f"{full_s * 1e6:,.0f}", f"{full_s / (select_s + attend_s):.1f}x"])
    print_table(["context", "blocks kept", "select us", "anchors MB", "attention us", "KV read MB",
                 "GB/s", "stream GB/s", "of stream", "all blocks us", "speedup"], rows)
    return 0
