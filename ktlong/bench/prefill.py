"""Layer-major prefill on random weights of a real shape under a GPU memory cap: the prefill
the config asks for (CompactAttention by default), and dense on the same prompt for the ratio.

python -m ktlong.bench prefill --shape llama-3.1-8b --lengths 32k,128k --gpu_cap_gb 24

Each row: density (the kept fraction of history blocks, mean over the chunks that have a
history, a dense chunk counting 1), the seconds of block selection, of the attention kernels
and of the rest (projections, MLP, offload to DRAM), and the speedup over the dense row of
the same prompt. Random weights give flat attention: topk keeps keep_blocks (with layer_budget
attention too, in every layer).
"""

from __future__ import annotations

import argparse

import torch

from ktlong.bench.common import RUNS
from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.config import load_config, options_in, parse_set, refuse_unread
from ktlong.device import resolve_device
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.memory_plan import GIB
from ktlong.models.random_model import SHAPES, num_weight_elements, random_config, random_model
from ktlong.parallel.group import join_ranks
from ktlong.parallel.launch import quiet_unless_main
from ktlong.parallel.shard import shard_config
from ktlong.prefill import LayerMajorPrefill, PrefillStats
from ktlong.session.plan import plan_session


# what this bench reads of the config: the prefill options and what shapes the KV it writes
READS = options_in("long-context prefill") | {"block_size", "kv_type", "anchor_type", "anchor_num", "threads_num",
                                               "device", "gpu_memory_budget_gb"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench prefill", description=__doc__)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="32k,128k")
    p.add_argument("--chunk_size", type=int, help="default: the config's chunk_size")
    p.add_argument("--block_size", type=int, help="default: the config's block_size")
    p.add_argument("--kv_type", help="default: the config's kv_type")
    p.add_argument("--gpu_cap_gb", type=float, default=24.0, help="GPU memory cap, also the plan's budget")
    p.add_argument("--backend", choices=["auto", "fa2", "fa3", "torch"], help="attention_backend")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config option")
    p.add_argument("--tensor_parallel", type=int, default=1, metavar="N",
                   help="split heads and MLP columns over N ranks; start with torchrun --nproc_per_node N")
    p.add_argument("--baseline", choices=["dense", "none"], default="dense",
                   help="dense: also run dense prefill on each prompt for the speedup (minutes at 1M); none: only "
                        "the config's prefill")
    p.add_argument("--runs", type=int, default=1, help="prefills per arm and prompt, the arms alternating; each "
                   "figure is the median over them")
    args = p.parse_args(argv)
    quiet_unless_main()
    in_range("--runs", args.runs, 1, RUNS, "the runs of each arm")
    overrides = parse_set(args.set)
    refuse_unread(overrides, READS, "python -m ktlong.bench prefill",
                  "measures prefill on random weights, which reads the prefill options and the KV layout")
    for flag, option in (("chunk_size", "chunk_size"), ("block_size", "block_size"), ("kv_type", "kv_type"),
                         ("backend", "attention_backend"), ("device", "device"), ("gpu_cap_gb", "gpu_memory_budget_gb")):
        if getattr(args, flag) is not None:
            overrides[option] = (getattr(args, flag), f"--{flag}")
    config = load_config(overrides=overrides, write_user_file=False)
    lengths = parse_lengths(args.lengths)
    device = resolve_device(config.device)
    c = random_config(args.shape)
    tp, device = join_ranks(args.tensor_parallel, c, device)
    if tp is not None:
        c = shard_config(c, tp.world)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = int(config.gpu_memory_budget_gb * GIB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    weight_bytes = num_weight_elements(c) * dtype.itemsize
    plans = [plan_session(config, c, weight_bytes, length, device, dtype) for length in lengths]
    for plan in plans:  # refuse what cannot fit before any weight is made
        plan.check()
    model = random_model(args.shape, device, dtype, tp=tp)
    ranks = f", tensor parallel {tp.world} (rank 0's figures)" if tp is not None else ""
    print(f"{args.shape} random {dtype} weights on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"chunk {plans[0].chunk_size}, block {config.block_size}, GPU cap {config.gpu_memory_budget_gb} GiB"
          f"{' per GPU' if tp is not None else ''}{ranks}")
    compact = plans[0].compact
    arms = [("compact" if compact else "dense", compact)]
    if compact is not None and args.baseline == "dense":
        arms.append(("dense", None))
    rows = []
    for length, plan in zip(lengths, plans):
        memory = plan.memory
        host = HostKVCache(plan.layout, pin=device.type == "cuda")
        # its DRAM held and page-locked before anything is timed: the run that first wrote there
        # paid for it (32K: 3.07 s against 1.34 s for the compact arm's first of two runs)
        host.reserve(length)
        ids = torch.randint(0, c.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        runs, backend = {arm: [] for arm, _ in arms}, ""
        for i in range(args.runs):
            for arm, params in arms:  # one engine at a time: the plan counts one set of pages
                engine = LayerMajorPrefill(model, plan.layout, plan.chunk_size, plan.attention_backend,
                                           memory.hidden_on_device, params)
                if device.type == "cuda" and i == 0:  # kernels build on first use: not inside the timed runs
                    engine.warm_up(host)
                runs[arm].append(engine.run(ids, host)[1])
                host.reset()
                backend = engine.backend
                del engine
        stats = {arm: median_stats(r) for arm, r in runs.items()}
        for arm, arm_stats in stats.items():
            speedup = f"{stats['dense'].seconds / arm_stats.seconds:.2f}x" if "dense" in stats else "-"
            each = "/".join(_seconds(r.seconds) for r in runs[arm])
            rows.append(_row(length, plan, arm, arm_stats, speedup, backend) + [each])
        del host
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(["prompt", "kv", "prefill", "density", "tok/s", "total s", "selection s", "attention s", "rest s",
                 "selection/attention", "hidden", "speedup", "peak GiB", "plan GiB", "peak/plan", "backend",
                 "each run s"], rows)
    return 0


def median_stats(runs: list[PrefillStats]) -> PrefillStats:
    """The run of median total seconds (the other columns are that run's)."""
    return sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]


def _row(length, plan, arm, stats, speedup, backend) -> list[str]:
    memory, peak = plan.memory, stats.peak_device_bytes
    densities = stats.density_per_layer
    density = f"{sum(densities) / len(densities) if densities else 1.0:.1%}"
    rest = stats.seconds - stats.attention_seconds - stats.selection_seconds
    share = f"{stats.selection_seconds / stats.attention_seconds:.1%}" if stats.attention_seconds else "-"
    return [f"{length // 1024}K", plan.kv_type, arm, density, f"{stats.tokens_per_second:,.0f}", _seconds(stats.seconds),
            f"{stats.selection_seconds:.2f}", _seconds(stats.attention_seconds), _seconds(rest), share,
            "GPU" if memory.hidden_on_device else "DRAM", speedup, f"{peak / GIB:.2f}", f"{memory.prefill_device / GIB:.2f}",
            f"{peak / memory.prefill_device:.3f}" if peak else "-", backend]


def _seconds(seconds: float) -> str:
    """Two decimals below 10 s, where one would hide a 5% difference."""
    return f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}"
