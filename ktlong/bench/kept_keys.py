"""Where CompactAttention keeps or loses the blocks that hold a retrieval prompt's answer.

python -m ktlong.bench kept-keys --task multikey --model qwen2.5-coder-0.5b --length 32k [--samples 4]
    [--depth 0.5] [--set key=value]

For an evaluation prompt (ktlong/eval/tasks.py), the blocks that hold its answer are found in the
prompt's tokens; the prefill then records, for every layer and every chunk after such a block,
whether each execution group's page list kept it, and the block's rank among the chunk's history
blocks by what the topk selector ranks them by (topk_rank: operators/block_selector.group_margin
or group_mass: the blocks strictly ahead of it, the sinks and the window among them, and the
blocks tied with it: each query row's best block has margin 0, and top-k breaks ties as it will).
Per layer it prints the share of (chunk, group) pairs that kept an answer block, and where the
dropped ones ranked against the count kept, then each sample's greedy answer. A chunk that ran
dense (`dense_above`, the first `prefill_dense_layer_num` layers) keeps everything.

With --masses FILE.npz it also writes, for every selected chunk, layer and group, three values
per history block: the share of the exact attention of the chunk's sampled queries (every
--mass_stride-th, causal, over history and chunk) that falls on the block, the topk margin, and
the block-mean estimate of that share (each pooled query row's softmax over the history's pooled
keys); and whether the group kept it. From these an adaptive budget can be judged offline: how
much exact mass a rule keeps, at what density.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ktlong.cli import parse_lengths, print_table
from ktlong.bench.common import long_context_config
from ktlong.config import greedy_session_options
from ktlong.errors import KtlongError
from ktlong.regular_file import user_path, write_replacing
from operators.block_selector import RANKS, group_margin, group_share
from operators.compact_attention import token_rows
from operators.layer_budget import sampled_share

READS = greedy_session_options()


@dataclass(frozen=True)
class Kept:
    """One (layer, chunk, group) that had an answer block in its history."""
    layer: int
    chunk_start: int
    group: int
    block: int
    kept: bool
    rank: int | None  # blocks group_margin puts strictly ahead of it (0: none); None for a dense chunk
    tied: int  # other blocks with its margin exactly (every query row's best block has margin 0)
    num_keep: int  # history blocks the group kept


def answer_blocks(tokenizer, ids: list[int], answers: list[str], block_size: int) -> list[int]:
    """The block of the first token of each answer's first appearance in the prompt's text."""
    text = tokenizer.decode(ids)
    blocks = []
    for answer in answers:
        at = text.find(answer)
        if at < 0:
            raise KtlongError(f"the answer {answer!r} is not in the rendered prompt; this task hides no retrievable "
                              "answer, so choose passkey, needle, kvretrieval, multikey, multivalue, multiquery or qa.")
        lo, hi = 0, len(ids)  # the fewest tokens whose text reaches past `at`
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if len(tokenizer.decode(ids[:mid])) <= at else (lo, mid)
        blocks.append((lo - 1) // block_size)
    return sorted(set(blocks))


class KeyWatch:
    """Wraps a prefill engine's CompactAttention select, recording what happened to key_blocks."""

    def __init__(self, engine, key_blocks: list[int], scale: float, masses: "Masses | None" = None):
        self.key_blocks, self.scale, self.records, self.layer = key_blocks, scale, [], -1
        self.compact, self.block_size = engine.compact, engine.layout.block_size
        select = self.compact.select

        def on_layer(layer, q, start, end, pages):  # before each chunk's attention, every layer
            self.layer = layer
            if layer < self.compact.params.prefill_dense_layer_num:
                self._record(q, None, start, None)

        def watched(q, k_pages, pooled_keys, start, end, prompt_end=None, layer=0):
            pages, what = select(q, k_pages, pooled_keys, start, end, prompt_end, layer)
            self._record(q, pooled_keys, start, pages, k_pages.shape[1])
            if masses is not None and pages is not None and start:
                masses.add(self.layer, q, k_pages, pooled_keys, start, end, pages, self.compact)
            return pages, what

        engine.attention_hook, self.compact.select = on_layer, watched
        self.engine, self.select = engine, select

    def close(self) -> None:
        """Unwrap, so that the next prompt's watch wraps the original select (not this one too)."""
        self.engine.attention_hook, self.compact.select = None, self.select

    def _record(self, q, pooled_keys, start: int, pages, blocks_per_head: int = 0):
        num_hist = start // self.block_size
        keys = [b for b in self.key_blocks if b < num_hist]
        if not keys:
            return
        groups = self.compact.groups.shape[0]
        if pages is None:  # the chunk ran dense
            self.records += [Kept(self.layer, start, g, b, True, None, 0, num_hist) for b in keys for g in range(groups)]
            return
        p = self.compact.params
        margin = RANKS[p.topk_rank](q, pooled_keys[:, :num_hist], self.block_size, self.scale, p.sink_blocks,
                              p.window_blocks, self.compact.groups.shape[1])
        indptr, indices = pages.indptr.tolist(), pages.indices.cpu().numpy()
        for g in range(groups):
            held = set((indices[indptr[g]:indptr[g + 1]] % blocks_per_head).tolist())
            for b in keys:
                rank, tied = int((margin[g] > margin[g, b]).sum()), int((margin[g] == margin[g, b]).sum()) - 1
                self.records.append(Kept(self.layer, start, g, b, b in held, rank, tied, int(pages.num_hist_kept[g])))


class Masses:
    """Per selected (chunk, layer, group): each history block's exact attention share (mean over
    the group's heads and the chunk's sampled queries), topk margin, block-mean estimate of the
    share, and whether the group kept it; written flat with offsets (no pickle)."""

    def __init__(self, stride: int, scale: float):
        self.answers: list[tuple[int, int]] = []  # (sample, answer block)
        self.stride, self.scale, self.rows, self.arrays = stride, scale, [], {"exact": [], "margin": [],
                                                                             "estimate": [], "kept": []}

    def add(self, layer: int, q, k_pages, pooled_keys, start: int, end: int, pages, compact) -> None:
        import torch

        block, blocks_per_head = compact.block_size, k_pages.shape[1]
        num_hist = start // block
        at = torch.arange(0, q.shape[0], self.stride, device=q.device)
        p, group_size = compact.params, compact.groups.shape[1]
        exact = sampled_share(q[at], token_rows(k_pages)[:, :end], num_hist, block, self.scale, group_size,
                              positions=start + at)  # [G, num_hist], causal over history and chunk
        estimate = group_share(q, pooled_keys[:, :num_hist], block, self.scale, group_size)  # [G, num_hist]
        margin = group_margin(q, pooled_keys[:, :num_hist], block, self.scale, p.sink_blocks, p.window_blocks,
                              group_size)
        indptr, indices = pages.indptr.tolist(), pages.indices.cpu().numpy()
        for g in range(exact.shape[0]):
            kept = np.zeros(num_hist, np.int8)
            held = indices[indptr[g]:indptr[g + 1]] % blocks_per_head
            kept[held[held < num_hist]] = 1
            self.rows.append((layer, start, g, num_hist))
            self.arrays["exact"].append(exact[g].cpu().numpy().astype(np.float16))
            self.arrays["estimate"].append(estimate[g].cpu().numpy().astype(np.float16))
            self.arrays["margin"].append(margin[g].clamp(max=1.0).cpu().numpy().astype(np.float16))
            self.arrays["kept"].append(kept)

    def save(self, path: Path, sample_rows: list[int]) -> None:
        """rows: [n, 5] (sample, layer, chunk start, group, history blocks); answers: [m, 2] (sample,
        answer block); each array flat, the n-th record's values at offsets[n]:offsets[n + 1]."""
        rows = np.array([(s,) + r for s, r in zip(sample_rows, self.rows)], np.int64).reshape(-1, 5)
        offsets = np.concatenate([[0], np.cumsum(rows[:, 4])])
        arrays = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self.arrays.items()}
        write_replacing(path, lambda f: np.savez_compressed(
            f, rows=rows, offsets=offsets, answers=np.array(self.answers, np.int64).reshape(-1, 2), **arrays))


def layer_rows(records: list[Kept]) -> list[list]:
    rows = []
    for layer in sorted({r.layer for r in records}):
        mine = [r for r in records if r.layer == layer]
        dropped = [r for r in mine if not r.kept]
        ranks, ties = [r.rank for r in dropped], [r.tied for r in dropped]
        rows.append([layer, len(mine), f"{1 - len(dropped) / len(mine):.0%}",
                     f"{int(np.median(ranks))}" if ranks else "-", f"{max(ranks)}" if ranks else "-",
                     f"{int(np.median(ties))}" if ties else "-", f"{int(np.median([r.num_keep for r in mine]))}"])
    return rows


def main(argv=None) -> int:
    from ktlong.eval.tasks import TASKS

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench kept-keys",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="multikey", choices=sorted(TASKS))
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="packaged model name or GGUF path (default: %(default)s)")
    p.add_argument("--length", default="8k", help="prompt length in the model's tokens, e.g. 32k (default: %(default)s)")
    p.add_argument("--depth", type=float, default=0.5, help="where the asked needle sits, 0 to 1 (default: %(default)s)")
    p.add_argument("--samples", type=int, default=1, help="prompts, seeds 0.. (default: %(default)s)")
    p.add_argument("--device", default=None, help="auto, cpu, cuda")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config option")
    p.add_argument("--masses", default=None, metavar="FILE.npz",
                   help="also write each selected block's exact and estimated attention share there")
    p.add_argument("--mass_stride", type=int, default=32, help="--masses: every Nth query of a chunk (default: %(default)s)")
    args = p.parse_args(argv)
    from ktlong.chat.conversation import Conversation
    from ktlong.chat.generate import generate
    from ktlong.chat.sampling import Sampler
    from ktlong.eval.runner import MAX_NEW_TOKENS
    from ktlong.eval.tasks import make_sample, references, score
    from ktlong.session.startup import start

    if not 0 <= args.depth <= 1 or not 1 <= args.samples <= 1000 or not 1 <= args.mass_stride <= 4096:
        raise KtlongError("--depth must lie in 0..1, --samples in 1..1000 and --mass_stride in 1..4096.")
    if args.masses and not args.masses.endswith(".npz"):
        raise KtlongError(f"--masses {args.masses}: name a file ending in .npz.")
    masses_path = user_path(args.masses) if args.masses else None
    if masses_path is not None and masses_path.exists():
        raise KtlongError(f"--masses {args.masses} exists; give a new file name (it is never overwritten).")
    if masses_path is not None and not masses_path.resolve().parent.is_dir():
        raise KtlongError(f"--masses {args.masses}: its folder does not exist; make it first.")
    config = long_context_config(args, READS, "kept-keys",
                                 "records CompactAttention's selection of the answer's blocks in long-context prefill")
    length = parse_lengths(args.length)[0]
    started = start(config)
    lm, session = started.lm, started.session
    if length + MAX_NEW_TOKENS[args.task] >= started.max_seq_len:
        raise KtlongError(f"--length {length} and the answer exceed max_seq_len {started.max_seq_len}; "
                          "use a shorter length or --set max_seq_len higher.")
    if session.engine.compact is None:
        raise KtlongError("prefill_attention is dense here: nothing is selected; leave prefill_attention at compact.")
    conversation = Conversation(lm.tokenizer, lm.chat_template if config.use_chat_template else None)
    count = lambda text: len(conversation.render_ids([], text))  # noqa: E731
    records, answers = [], []
    masses, mass_samples = (Masses(args.mass_stride, lm.model.scale) if args.masses else None), []
    for seed in range(args.samples):
        sample = make_sample(args.task, length, args.depth, seed, count)
        ids = conversation.render_ids([], sample.prompt)
        blocks = answer_blocks(lm.tokenizer, ids, references(args.task, sample.answer), config.block_size)
        session.reset()
        watch = KeyWatch(session.engine, blocks, lm.model.scale, masses)
        gen = generate(session, ids, MAX_NEW_TOKENS[args.task], Sampler(), lm.tokenizer.stop_ids, lm.tokenizer,
                       ctrl_c_ends_answer=False)
        watch.close()
        records += watch.records
        if masses is not None:
            mass_samples += [seed] * (len(masses.rows) - len(mass_samples))
            masses.answers += [(seed, b) for b in blocks]
        answers.append([seed, len(ids), " ".join(map(str, blocks)), "right" if score(args.task, sample.answer, gen.text)
                        else "wrong", sample.answer[:40], gen.text.strip()[:40]])
    c = session.engine.compact.params
    print(f"{lm.path.name}, {args.task} at {length:,} tokens, depth {args.depth}; selector {c.selector}, keep_blocks "
          f"{c.keep_blocks}, block {config.block_size}, chunk {session.engine.chunk_size}, "
          f"{c.prefill_dense_layer_num} dense layers")
    print_table(["layer", "(chunk, group) pairs after an answer block", "kept it", "dropped: median rank",
                 "dropped: worst rank", "dropped: median tied", "blocks kept"], layer_rows(records))
    print_table(["sample", "tokens", "answer blocks", "answer", "expected", "got"], answers)
    if masses is not None:
        masses.save(masses_path, mass_samples)
        print(f"wrote {len(masses.rows):,} (chunk, layer, group) records to {args.masses}")
    return 0
