"""Layer-major prefill on random weights of a real shape under a GPU memory cap.

python -m ktlong.bench prefill --shape llama-3.1-8b --lengths 32k,128k --gpu_cap_gb 24
"""

from __future__ import annotations

import argparse

import torch

from ktlong.bench.common import parse_lengths, print_table
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.kv.memory_plan import GIB, plan_memory
from ktlong.prefill import LayerMajorPrefill
from ktlong.models.random_model import SHAPES, num_weight_elements, random_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ktlong.bench prefill", description=__doc__)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="32k,128k")
    p.add_argument("--chunk_size", type=int, default=8192)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--kv_type", default="bf16")
    p.add_argument("--gpu_cap_gb", type=float, default=24.0)
    p.add_argument("--backend", default="auto", choices=["auto", "fa2", "fa3", "torch"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = int(args.gpu_cap_gb * GIB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    model = random_model(args.shape, device, dtype)
    c = model.config
    print(f"{args.shape} random {dtype} weights on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"chunk {args.chunk_size}, block {args.block_size}, kv {args.kv_type}, GPU cap {args.gpu_cap_gb} GiB")
    rows = []
    for length in parse_lengths(args.lengths):
        layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, args.block_size, length, args.kv_type)
        plan = plan_memory(c, num_weight_elements(c), dtype.itemsize, layout, args.chunk_size, budget,
                           device.type == "cuda")
        host = HostKVCache(layout, pin=device.type == "cuda")
        engine = LayerMajorPrefill(model, layout, args.chunk_size, args.backend, plan.hidden_on_device)
        ids = torch.randint(0, c.vocab_size, (length,)).tolist()
        _, stats = engine.run(ids, host)
        peak = stats.peak_device_bytes
        rows.append([f"{length // 1024}K", f"{stats.tokens_per_second:,.0f}", f"{stats.seconds:.1f}",
                     f"{stats.attention_seconds:.1f}", f"{stats.seconds - stats.attention_seconds:.1f}",
                     f"{stats.bytes_to_host / 1e9:.1f}", f"{stats.bytes_to_device / 1e9:.1f}",
                     "GPU" if plan.hidden_on_device else "DRAM", f"{peak / GIB:.2f}",
                     f"{plan.prefill_device / GIB:.2f}", f"{peak / plan.prefill_device:.3f}" if peak else "-",
                     engine.backend])
        del engine, host
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(["prompt", "tok/s", "total s", "attention s", "rest s", "to DRAM GB", "to GPU GB",
                 "hidden", "peak GiB", "plan GiB", "peak/plan", "backend"], rows)
    return 0
