"""The longest context the memory planner accepts, at each tensor-parallel size.

python -m ktlong.bench context-limit --shape llama-3.1-8b --tensor_parallel 1,2 --gpu_cap_gb 24

For a GPU plan: the GPU limit is where a rank's plan (its weights, chunk workspace, decode
window and device anchors) outgrows the cap; the DRAM limit is where every rank's KV cache and
side tables together outgrow the host's free memory (--dram_gb, default: what is free here).
Nothing is allocated; it runs on any machine.
"""

from __future__ import annotations

import argparse

import torch

from ktlong.cli import print_table
from ktlong.config import load_config, parse_set, refuse_unread
from ktlong.errors import KtlongError
from ktlong.kv.free_memory import GIB, available_dram_bytes
from ktlong.models.random_model import SHAPES, num_weight_elements, random_config
from ktlong.parallel.shard import shard_config
from ktlong.session.plan import plan_session, resolve_chunk_size

# what this bench reads of the config: what the memory plan counts
READS = frozenset({"chunk_size", "block_size", "kv_type", "local_windows_len", "anchor_type", "anchor_num",
                   "second_select_num", "block_scoring", "context_attention"})

MAX_TOKENS = 1 << 26


def longest(fits, block: int) -> int:
    """The largest multiple of block (up to MAX_TOKENS) that fits, by bisection; 0 if none."""
    low, high = 0, MAX_TOKENS // block
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid * block):
            low = mid
        else:
            high = mid - 1
    return low * block


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench context-limit", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tensor_parallel", default="1,2", help="rank counts, comma-separated")
    p.add_argument("--gpu_cap_gb", type=float, default=24.0, help="GPU memory per rank")
    p.add_argument("--dram_gb", type=float, help="host memory for the KV cache (default: free memory here)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config option")
    args = p.parse_args(argv)
    try:
        sizes = [int(n) for n in args.tensor_parallel.split(",")]
    except ValueError:
        sizes = [0]
    if not all(n >= 1 for n in sizes):
        raise KtlongError(f"--tensor_parallel {args.tensor_parallel!r}: give rank counts, e.g. 1,2.")
    overrides = parse_set(args.set)
    refuse_unread(overrides, READS, "python -m ktlong.bench context-limit",
                  "finds the longest context whose memory plan fits --gpu_cap_gb")
    overrides["gpu_memory_budget_gb"] = (args.gpu_cap_gb, "--gpu_cap_gb")
    config = load_config(overrides=overrides, write_user_file=False)
    dram = int(args.dram_gb * GIB) if args.dram_gb else available_dram_bytes()
    budget = int(args.gpu_cap_gb * GIB)
    device = torch.device("cuda")  # a GPU plan; nothing touches the device
    rows = []
    for n in sizes:
        c = shard_config(random_config(args.shape), n)

        def plan(tokens):
            return plan_session(config, c, num_weight_elements(c) * 2, tokens, device, torch.bfloat16).memory

        gpu = longest(lambda t: plan(t).device_total <= budget, config.block_size)
        host = longest(lambda t: n * plan(t).dram_total <= dram, config.block_size)
        limit = min(gpu, host)
        at = plan(limit) if limit else None
        rows.append([n, f"{gpu:,}", f"{host:,}", f"{limit:,}", "GPU" if gpu <= host else "DRAM",
                     f"{at.device_total / GIB:.1f}" if at else "-", f"{n * at.dram_total / GIB:.1f}" if at else "-",
                     f"{at.weights / GIB:.1f}" if at else "-"])
    kv = config.kv_type if config.kv_type != "auto" else "bf16"
    chunk = resolve_chunk_size(config.chunk_size, config.block_size, device)
    print(f"{args.shape}, kv {kv}, chunk {chunk}, local window {config.local_windows_len}, "
          f"GPU cap {args.gpu_cap_gb} GiB per rank, {dram / GIB:.0f} GiB of host memory")
    print_table(["tensor parallel", "GPU limit", "DRAM limit", "longest context", "bound by",
                 "GPU GiB per rank", "DRAM GiB all ranks", "weights GiB per rank"], rows)
    return 0
