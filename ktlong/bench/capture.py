"""Capture one chunk's q and the layer's K/V pages from a real model's prefill, for the
attention benchmark's selector runs.

python -m ktlong.bench capture --model smollm2-135m --text_file F --tokens 8192 --layers 5,15,25 --out captured.npz
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.models.loader import load_model
from ktlong.prefill import LayerMajorPrefill


def capture_hook(layers: set[int], capture_start: int, block_size: int, captured: dict):
    """A prefill attention hook that keeps q and the pages of the chunk starting at capture_start."""
    def hook(layer, q, s, e, pages):
        if layer in layers and s == capture_start:
            nb = -(-e // block_size)
            captured[f"layer{layer:02d}_q"] = q.to(torch.float16).cpu().numpy()
            captured[f"layer{layer:02d}_k"] = pages.k[:, :nb].to(torch.float16).cpu().numpy()
            captured[f"layer{layer:02d}_v"] = pages.v[:, :nb].to(torch.float16).cpu().numpy()
            captured[f"layer{layer:02d}_start"] = np.array(s)
    return hook


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench capture", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text_file", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk_size", type=int, default=1024)
    p.add_argument("--layers", default="5,15,25")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    lm = load_model(args.model)
    text = open(args.text_file, encoding="utf-8").read()
    ids = lm.tokenizer.encode(text, parse_special=False)
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = ids[:args.tokens]
    c = lm.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, len(ids), "fp32")
    start = (len(ids) - 1) // args.chunk_size * args.chunk_size
    engine = LayerMajorPrefill(lm.model, layout, args.chunk_size, "torch", True)
    captured = {}
    engine.attention_hook = capture_hook({int(x) for x in args.layers.split(",")}, start, layout.block_size, captured)
    engine.run(ids, HostKVCache(layout, pin=False))
    np.savez(args.out, **captured)
    print(f"captured layers {args.layers} of {lm.path.name}: chunk at {start}..{len(ids)} -> {args.out}")
    return 0
