"""Perplexity of a text, as llama.cpp's perplexity tool measures it.

`python -m ktlong.perplexity --gguf_path P --text_file F --ctx N [--json]`: the text is cut into
non-overlapping windows of N tokens; in each, every token after the first is scored.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from ktlong.chat.text_file import read_text_file
from ktlong.cli import interrupted, print_error
from ktlong.device import resolve_device, resolve_dtype
from ktlong.errors import KtlongError
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.models.loader import LoadedModel, load_model
from ktlong.gguf.model_config import RopeOptions


@torch.inference_mode()
def window_nll(lm: LoadedModel, window: list[int]) -> tuple[float, int]:
    """Sum of -log p(token | earlier tokens of the window) over window[1:], and the count."""
    c, model = lm.config, lm.model
    cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(window), model.device, model.dtype)
    logits = model.forward(torch.tensor(window), cache, 0)  # [N, vocab] float32
    log_probs = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(window[1:], device=log_probs.device)
    return float(-log_probs.gather(1, targets[:, None]).sum()), len(window) - 1


def perplexity(lm: LoadedModel, text: str, ctx: int, max_windows: int = 0) -> dict:
    ids = lm.tokenizer.encode(text, parse_special=False)
    if lm.tokenizer.add_bos:
        ids = ids[1:]  # each window gets its own BOS below
    step = ctx - 1 if lm.tokenizer.add_bos else ctx
    num_windows = len(ids) // step
    if max_windows:
        num_windows = min(num_windows, max_windows)
    if num_windows == 0:
        raise KtlongError(f"The text has {len(ids)} tokens, fewer than one window of {ctx}; "
                          "lower --ctx or give a longer text.")
    total_nll, total_tokens = 0.0, 0
    start = time.perf_counter()
    for w in range(num_windows):
        window = ids[w * step:(w + 1) * step]
        if lm.tokenizer.add_bos:
            window = [lm.tokenizer.bos_id] + window
        nll, count = window_nll(lm, window)
        total_nll += nll
        total_tokens += count
        print(f"[{w + 1}/{num_windows}] ppl so far {math.exp(total_nll / total_tokens):.4f}",
              file=sys.stderr, flush=True)
    return {"ppl": math.exp(total_nll / total_tokens), "tokens": total_tokens,
            "windows": num_windows, "ctx": ctx, "seconds": time.perf_counter() - start}


FLAGGED = ("model", "device", "rope_scaling", "rope_scale", "yarn_orig_ctx")  # options of the configuration


def main(argv=None) -> int:
    from ktlong.config import load_config
    from ktlong.options import OPTIONS
    from ktlong.session.startup import add_option_flag

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.perplexity",
                                description=__doc__.split("\n\n")[0],
                                epilog="--model, --device and the RoPE flags default to the configuration's "
                                       "(~/.config/ktlong/config.yaml over configs/default.yaml).")
    p.add_argument("--text_file", required=True, help="UTF-8 text to score")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--max_windows", type=int, default=0, help="score at most this many windows (0 = all)")
    p.add_argument("--json", action="store_true", help='print {"ppl": ..., "tokens": ...} only')
    for name in FLAGGED:
        add_option_flag(p, OPTIONS[name], *(["--gguf_path"] if name == "model" else []))
    args = p.parse_args(argv)
    try:
        if args.ctx < 2:
            raise KtlongError(f"--ctx {args.ctx} is too small; a window needs at least 2 tokens.")
        if args.max_windows < 0:
            raise KtlongError(f"--max_windows {args.max_windows} is negative; give 0 (every window) or a count.")
        config = load_config(overrides={name: (getattr(args, name), f"--{name}") for name in FLAGGED
                                        if getattr(args, name) is not None}, write_user_file=False)
        text = read_text_file(args.text_file, "--text_file")
        device = resolve_device(config.device)
        lm = load_model(config.model, device, resolve_dtype("auto", device),
                        RopeOptions(config.rope_scaling, config.rope_scale, config.yarn_orig_ctx))
        result = perplexity(lm, text, args.ctx, args.max_windows)
    except KtlongError as e:
        print_error(e)
        return 2
    except KeyboardInterrupt:
        return interrupted()
    if args.json:
        print(json.dumps({"ppl": result["ppl"], "tokens": result["tokens"]}))
    else:
        print(f"{lm.path.name}: perplexity {result['ppl']:.4f} over {result['tokens']} scored tokens "
              f"({result['windows']} windows of {args.ctx}) in {result['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
