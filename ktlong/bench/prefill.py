"""Layer-major prefill on random weights of a real shape under a GPU memory cap.

python -m ktlong.bench prefill --shape llama-3.1-8b --lengths 32k,128k --gpu_cap_gb 24
"""

from __future__ import annotations

import argparse

import torch

from ktlong.bench.common import parse_lengths, print_table
from ktlong.config import load_config, parse_set
from ktlong.device import resolve_device
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.memory_plan import GIB
from ktlong.models.random_model import SHAPES, num_weight_elements, random_config, random_model
from ktlong.parallel.group import join_ranks, quiet_unless_main
from ktlong.parallel.shard import shard_config
from ktlong.prefill import LayerMajorPrefill
from ktlong.session.plan import plan_session


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ktlong.bench prefill", description=__doc__)
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
    args = p.parse_args(argv)
    quiet_unless_main()
    overrides = parse_set(args.set)
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
    plans = [plan_session(config, c, num_weight_elements(c), length, device, dtype) for length in lengths]
    for plan in plans:  # refuse what cannot fit before any weight is made
        plan.check()
    model = random_model(args.shape, device, dtype, tp=tp)
    ranks = f", tensor parallel {tp.world} (rank 0's figures)" if tp is not None else ""
    print(f"{args.shape} random {dtype} weights on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"chunk {config.chunk_size}, block {config.block_size}, GPU cap {config.gpu_memory_budget_gb} GiB"
          f"{' per GPU' if tp is not None else ''}{ranks}")
    rows = []
    for length, plan in zip(lengths, plans):
        memory = plan.memory
        host = HostKVCache(plan.layout, pin=device.type == "cuda")
        engine = LayerMajorPrefill(model, plan.layout, config.chunk_size, config.attention_backend,
                                   memory.hidden_on_device)
        ids = torch.randint(0, c.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        if device.type == "cuda":  # FlashInfer's kernels build on first use: not inside the timed run
            engine.run(ids[:config.block_size], host)
            host.reset()
        _, stats = engine.run(ids, host)
        peak = stats.peak_device_bytes
        rows.append([f"{length // 1024}K", plan.kv_type, f"{stats.tokens_per_second:,.0f}", f"{stats.seconds:.1f}",
                     f"{stats.attention_seconds:.1f}", f"{stats.seconds - stats.attention_seconds:.1f}",
                     f"{stats.bytes_to_host / 1e9:.1f}", f"{stats.bytes_to_device / 1e9:.1f}",
                     "GPU" if memory.hidden_on_device else "DRAM", f"{peak / GIB:.2f}",
                     f"{memory.prefill_device / GIB:.2f}", f"{peak / memory.prefill_device:.3f}" if peak else "-",
                     engine.backend])
        del engine, host
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(["prompt", "kv", "tok/s", "total s", "attention s", "rest s", "to DRAM GB", "to GPU GB",
                 "hidden", "peak GiB", "plan GiB", "peak/plan", "backend"], rows)
    return 0
