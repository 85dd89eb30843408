"""Decode held to a JSON schema (llguidance's mask before each token) against free decode, on a
real model in long-context mode: what structured output costs a token at a long context.

python -m ktlong.bench structured --model NAME_OR_GGUF --lengths 128k [--tokens 48] [--runs 3] [--set key=value]

Each length: a passkey prompt of that many tokens in the model's chat template, asking for a
JSON answer. Each run prefills it and decodes --tokens tokens free (no stop token), then
prefills it again and decodes under the schema until the grammar ends; the runs alternate. The
table gives median milliseconds per decoded token of each arm, their difference and ratio, and
the mask's own share: llguidance's bitmask and its application to the logits, timed alone.
The session is what the config builds (CUDA graphs where use_cuda_graph says so).
"""

from __future__ import annotations

import argparse
import time

import torch

from ktlong.bench.common import RUNS, median
from ktlong.chat.constrained import JsonConstraint, json_grammar
from ktlong.chat.conversation import Conversation
from ktlong.chat.generate import generate
from ktlong.chat.sampling import Sampler
from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.config import greedy_session_options, load_config, parse_set, refuse_unread
from ktlong.device import resolve_device, resolve_dtype
from ktlong.errors import KtlongError
from ktlong.eval.runner import make_session
from ktlong.eval.tasks import make_sample
from ktlong.gguf.model_config import RopeOptions
from ktlong.gguf.weights import CpuWeights
from ktlong.gguf.chat_template import configured_template
from ktlong.models.loader import load_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["pass_key", "where", "sure"],
          "properties": {"pass_key": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "where": {"type": "string", "maxLength": 120},
                         "sure": {"enum": ["yes", "no"]}}}
QUESTION = (" Answer in JSON: the pass key, a sentence on where in the text it was, and whether you are sure.")


class TimedConstraint(JsonConstraint):
    """A JsonConstraint that times its mask (the device finishing it, so the time is its own)."""

    def __init__(self, tokenizer, grammar: str):
        super().__init__(tokenizer, grammar)
        self.seconds: list[float] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        start = time.perf_counter()
        out = super().mask(logits)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.seconds.append(time.perf_counter() - start)
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="packaged model name or GGUF path (default: the config's model)")
    p.add_argument("--lengths", default="128k", help="prompt lengths in the model's tokens")
    p.add_argument("--tokens", type=int, default=48, help="tokens the free arm decodes")
    p.add_argument("--runs", type=int, default=3, help="runs per arm and length, alternating; medians")
    p.add_argument("--device", default=None, help="auto, cpu, cuda")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config option")
    args = p.parse_args(argv)
    in_range("--runs", args.runs, 1, RUNS, "the runs per arm and length")
    in_range("--tokens", args.tokens, 2, 4096, "the tokens the free arm decodes")
    overrides = parse_set(args.set)
    refuse_unread(overrides, greedy_session_options(), "python -m ktlong.bench structured",
                  "decodes greedily in long-context mode at the --lengths given")
    if args.model:
        overrides["model"] = (args.model, "--model")
    if args.device:
        overrides["device"] = (args.device, "--device")
    config = load_config(overrides=overrides, write_user_file=False)
    lengths = parse_lengths(args.lengths)
    device = resolve_device(config.device)
    lm = load_model(config.model, device, resolve_dtype(config.dtype, device), RopeOptions.of(config),
                    chat_template=configured_template(config.chat_template_file), cpu=CpuWeights.of(config))
    if max(lengths) + args.tokens + 128 > lm.config.context_length:
        raise KtlongError(f"--lengths up to {max(lengths)} leave no room to decode in the model's context of "
                          f"{lm.config.context_length} tokens; use shorter lengths (or rope_scaling).")
    session = make_session(lm, config, "sparse", max(lengths) + 256)
    grammar = json_grammar(SCHEMA)
    conversation = Conversation(lm.tokenizer, lm.chat_template if config.use_chat_template else None)
    count = lambda text: len(conversation.render_ids([], text + QUESTION))
    print(f"{lm.path.name} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"kv {session.layout.kv_type}, CUDA graphs {'on' if session.use_cuda_graph else 'off'}, greedy")
    rows = []
    for length in lengths:
        ids = conversation.render_ids([], make_sample("passkey", length, 0.5, length, count).prompt + QUESTION)
        free, held, masks, answer = [], [], [], ""
        for _ in range(args.runs):
            session.reset()
            gen = generate(session, ids, args.tokens, Sampler(), frozenset(), lm.tokenizer, ctrl_c_ends_answer=False)
            free.append(gen.decode_seconds / max(len(gen.token_ids) - 1, 1))
            session.reset()
            constraint = TimedConstraint(lm.tokenizer, grammar)
            gen = generate(session, ids, 512, Sampler(), lm.tokenizer.stop_ids, lm.tokenizer,
                           constraint=constraint, ctrl_c_ends_answer=False)
            held.append(gen.decode_seconds / max(len(gen.token_ids) - 1, 1))
            masks.append(median(constraint.seconds))
            answer = gen.text
        f, h = median(free) * 1e3, median(held) * 1e3
        rows.append([f"{len(ids):,}", f"{f:.2f}", f"{h:.2f}", f"{h - f:+.2f}", f"{h / f:.3f}",
                     f"{median(masks) * 1e3:.3f}", answer[:70]])
    print_table(["prompt tokens", "free ms/token", "schema ms/token", "difference", "ratio", "mask ms", "answer"],
                rows)
    return 0
