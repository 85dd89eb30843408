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
from ktlong.gguf.loader import load_model
from ktlong.prefill import LayerMajorPrefill


class CapturingPrefill(LayerMajorPrefill):
    def __init__(self, *args, layers, capture_start, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers, self.capture_start, self.captured = set(layers), capture_start, {}
        self._layer = 0

    def _layer_chunk(self, layer, x, positions, s, e, host, stats):
        self._layer = layer
        return super()._layer_chunk(layer, x, positions, s, e, host, stats)

    def _attention(self, q, s, e):
        if self._layer in self.layers and s == self.capture_start:
            nb = -(-e // self.layout.block_size)
            self.captured[f"layer{self._layer:02d}_q"] = q.to(torch.float16).cpu().numpy()
            self.captured[f"layer{self._layer:02d}_k"] = self.pages.k[:, :nb].to(torch.float16).cpu().numpy()
            self.captured[f"layer{self._layer:02d}_v"] = self.pages.v[:, :nb].to(torch.float16).cpu().numpy()
            self.captured[f"layer{self._layer:02d}_start"] = np.array(s)
        return super()._attention(q, s, e)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ktlong.bench capture", description=__doc__.split("\n\n")[0])
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
    engine = CapturingPrefill(lm.model, layout, args.chunk_size, "torch", True,
                              layers=[int(x) for x in args.layers.split(",")], capture_start=start)
    engine.run(ids, HostKVCache(layout, pin=False))
    np.savez(args.out, **engine.captured)
    print(f"captured layers {args.layers} of {lm.path.name}: chunk at {start}..{len(ids)} -> {args.out}")
    return 0
