"""How much decode's block selection changes from one token to the next, on a real model.

python -m ktlong.bench selection-drift --model qwen2.5-coder-0.5b --length 8k --tokens 64

If each token's top-k blocks were mostly the previous tokens', blocks selected recently could
stay in GPU memory and only the changed ones be read from DRAM. This prefills a needle prompt of the evaluation (real prose), decodes greedily, and records every
global layer's selected blocks per kv head at every token. Per layer it prints: of a token's
selected blocks, the share the previous token also selected, the share any of the last W
tokens selected (a cache of W tokens' blocks), and the new blocks per token and kv head.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.bench.common import long_context_config
from ktlong.config import greedy_session_options
from ktlong.errors import KtlongError

READS = greedy_session_options()  # the decode selection options above all


def selected_sets(selector, layers: list[int]) -> dict[int, list[frozenset]]:
    """layer -> per kv head, the blocks the last step selected (from the selector's cache)."""
    out = {}
    for layer in layers:
        if layer in selector.cache:
            blocks, counts, _ = selector.cache[layer]
            out[layer] = [frozenset(blocks[h, :counts[h]].tolist()) for h in range(blocks.shape[0])]
    return out


def drift(history: list[dict[int, list[frozenset]]], window: int) -> dict[int, tuple[float, float, float, int]]:
    """Per layer, over steps 1..: (share also selected by the previous token, share selected by
    any of the last `window` tokens, new blocks per token and kv head, blocks selected per head)."""
    out = {}
    for layer in history[0]:
        prev_share, window_share, new, size = [], [], [], []
        for t in range(1, len(history)):
            for h, now in enumerate(history[t][layer]):
                if not now:
                    continue
                seen = set().union(*(history[s][layer][h] for s in range(max(0, t - window), t)))
                prev_share.append(len(now & history[t - 1][layer][h]) / len(now))
                window_share.append(len(now & seen) / len(now))
                new.append(len(now - seen))
                size.append(len(now))
        if size:
            out[layer] = (float(np.mean(prev_share)), float(np.mean(window_share)), float(np.mean(new)),
                          int(np.median(size)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench selection-drift", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="packaged model name or GGUF path")
    p.add_argument("--length", default="8k", help="prompt length in the model's tokens")
    p.add_argument("--tokens", type=int, default=64, help="decode steps recorded")
    p.add_argument("--window", type=int, default=8, help="tokens whose blocks a cache would keep")
    p.add_argument("--device", default=None, help="auto, cpu, cuda")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config option (the decode selection options above all)")
    args = p.parse_args(argv)
    from ktlong.chat.conversation import Conversation
    from ktlong.eval.tasks import make_sample
    from ktlong.session.startup import start

    config = long_context_config(args, READS, "selection-drift",
                                 "records decode's block selection on a long-context needle prompt, greedily")
    length = parse_lengths(args.length)[0]
    in_range("--tokens", args.tokens, 2, 1 << 16, "the tokens decoded")
    in_range("--window", args.window, 1, args.tokens, "the tokens whose blocks a cache would keep, at most --tokens")
    started = start(config)
    lm, session = started.lm, started.session
    if length + args.tokens >= started.max_seq_len:
        raise KtlongError(f"--length {length} plus --tokens exceeds max_seq_len {started.max_seq_len}; "
                          "use a shorter length.")
    conversation = Conversation(lm.tokenizer, lm.chat_template if config.use_chat_template else None)
    sample = make_sample("needle", length, 0.5, 1, lambda text: len(conversation.render_ids([], text)))
    ids = conversation.render_ids([], sample.prompt)
    logits = session.prefill(ids, show_progress=True)
    decoder = session.decoder
    layers = decoder.global_layers
    history, tokens = [], []
    for _ in range(args.tokens):  # greedy, on past the end of the answer: the selection is what is measured
        tokens.append(int(torch.argmax(logits)))
        logits = session.step(tokens[-1])
        history.append(selected_sets(decoder.selector, layers))
    first, last = decoder.window.context_blocks
    rows = [[layer, size, f"{prev:.0%}", f"{win:.0%}", f"{new:.2f}"]
            for layer, (prev, win, new, size) in sorted(drift(history, args.window).items())]
    if not rows:
        raise KtlongError("decode selected no blocks (the context fits the local window); use a longer "
                          "--length or --set local_windows_len=... lower.")
    s = config
    print(f"{lm.path.name}, {len(ids):,}-token needle prompt, {args.tokens} greedy tokens; top-{s.second_select_num} of "
          f"{last - first} context blocks (block {s.block_size}, local window {s.local_windows_len}), anchors "
          f"{s.anchor_type}, {s.head_select_mode}, preselect {s.preselect_block} ({s.preselect_block_count}), "
          f"token_step {s.token_step}; answer {lm.tokenizer.decode(tokens)[:40]!r}")
    print_table(["layer", "blocks per kv head", "also the previous token's", f"in the last {args.window} tokens'",
                 "new per token and kv head"], rows)
    prev = np.mean([float(r[2][:-1]) for r in rows])
    win = np.mean([float(r[3][:-1]) for r in rows])
    print(f"all layers: {prev:.0f}% of a token's blocks were the previous token's, {win:.0f}% were among "
          f"the last {args.window} tokens'")
    t = decoder.times
    print(f"decode: {t.steps / t.total:.1f} tok/s; per token CPU attention {t.cpu_attention / t.steps * 1e3:.2f} ms, "
          f"selection {t.selection / t.steps * 1e3:.2f} ms, waiting for the device {t.device_wait / t.steps * 1e3:.2f} ms")
    return 0
