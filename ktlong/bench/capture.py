"""Capture one chunk's q and the layer's K/V pages from a real model's prefill, for the
attention benchmark's selector runs.

python -m ktlong.bench capture --model smollm2-135m --text_file F --tokens 8192 --layers 5,15,25 --out captured.npz
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from ktlong.chat.text_file import read_text_file
from ktlong.errors import KtlongError
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.models.loader import load_model
from ktlong.prefill import LayerMajorPrefill
from ktlong.regular_file import user_path, write_replacing


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


MAX_TEXT_BYTES = 64 << 20  # a text file past this is refused before it is read


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench capture", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="packaged model name or GGUF path (default: %(default)s)")
    p.add_argument("--text_file", required=True, help="UTF-8 text to prefill, repeated up to --tokens")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens (default: %(default)s)")
    p.add_argument("--chunk_size", type=int, default=1024, help="prefill chunk; the last chunk is captured, a "
                   "multiple of 128 (default: %(default)s)")
    p.add_argument("--layers", default="5,15,25", help="layers to capture, comma-separated (default: %(default)s)")
    p.add_argument("--out", required=True, help="the .npz file to write; an existing file is refused")
    args = p.parse_args(argv)
    block_size = 128
    if args.chunk_size < block_size or args.chunk_size % block_size:
        raise KtlongError(f"--chunk_size {args.chunk_size}: use a positive multiple of {block_size}.")
    if args.tokens < 2:
        raise KtlongError(f"--tokens {args.tokens}: use at least 2.")
    out = user_path(args.out)
    if out.suffix != ".npz":
        raise KtlongError(f"--out {args.out}: name a file ending in .npz.")
    if not out.resolve().parent.is_dir():
        raise KtlongError(f"--out {args.out}: its folder does not exist; make it first.")
    if out.exists():
        raise KtlongError(f"--out {args.out} exists; give a new file name (a capture never overwrites one).")
    try:
        layers = sorted({int(x) for x in args.layers.split(",")})
    except ValueError:
        raise KtlongError(f"--layers {args.layers!r}: give layer numbers, comma-separated, e.g. 5,15,25.") from None
    text = read_text_file(args.text_file, "--text_file", MAX_TEXT_BYTES)
    lm = load_model(args.model)
    c = lm.config
    if layers[0] < 0 or layers[-1] >= c.num_layers:
        raise KtlongError(f"--layers {args.layers}: {lm.path.name} has layers 0 to {c.num_layers - 1}.")
    if args.tokens > c.context_length:
        raise KtlongError(f"--tokens {args.tokens} exceeds {lm.path.name}'s context of {c.context_length} tokens.")
    ids = lm.tokenizer.encode(text, parse_special=False)
    if not ids:
        raise KtlongError(f"--text_file {args.text_file} holds no tokens; give a text to prefill.")
    ids = (ids * -(-args.tokens // len(ids)))[:args.tokens]
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, len(ids), "fp32")
    start = (len(ids) - 1) // args.chunk_size * args.chunk_size
    engine = LayerMajorPrefill(lm.model, layout, args.chunk_size, "torch", True)
    captured = {}
    engine.attention_hook = capture_hook(set(layers), start, layout.block_size, captured)
    engine.run(ids, HostKVCache(layout, pin=False))
    write_replacing(out, lambda f: np.savez(f, **captured))  # never half a file under its name
    print(f"captured layers {','.join(map(str, layers))} of {lm.path.name}: chunk at {start}..{len(ids)} -> {out}")
    return 0
