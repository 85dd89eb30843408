"""Run one evaluation through the long-context path, dense and sparse on the same prompts."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from ktlong.config import Config, parse_set
from ktlong.chat.conversation import Conversation
from ktlong.eval.tasks import first_integer, make_sample, score
from ktlong.chat.generate import generate
from ktlong.models.loader import LoadedModel
from ktlong.session.long_context import LongContextSession
from ktlong.session.plan import apply_threads, plan_session
from ktlong.chat.sampling import Sampler

MAX_NEW_TOKENS = {"passkey": 16, "needle": 32, "kvretrieval": 64, "multikey": 24, "multivalue": 64,
                  "multiquery": 64, "vartrack": 48, "commonwords": 96, "freqwords": 32, "qa": 32}


@dataclass
class Result:
    task: str
    attention: str
    length: int
    depth: float
    sample: int
    prompt_tokens: int
    answer: str
    output: str
    correct: bool
    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    density: float  # CompactAttention's kept history fraction, 1.0 when dense
    prefill_seconds: float = 0.0  # the prompt's prefill, end to end
    prefill_attention_seconds: float = 0.0  # of which attention and its block selection (0: not measured)
    decode_setup_seconds: float = 0.0  # after the prefill, before the first token: the decoder built


def split_variant(attention: str) -> tuple[str, list[str]]:
    """An arm with settings of its own, 'sparse@selector=xattention@threshold=0.95' ->
    ('sparse', ['selector=xattention', 'threshold=0.95']): several settings compared in one run."""
    arm, *settings = attention.split("@")
    return arm, settings


def variant_config(config: Config, attention: str) -> Config:
    """The config an arm runs with: its own options set over it (their source: the arm)."""
    overrides = parse_set(split_variant(attention)[1])
    return config.with_overrides({k: (v, f"--attention {attention}") for k, (v, _) in overrides.items()})


def make_session(lm: LoadedModel, config: Config, attention: str, max_seq_len: int) -> LongContextSession:
    device = lm.model.device
    plan = plan_session(config, lm.config, lm.weight_bytes, max_seq_len, device, lm.model.dtype, attention)
    plan.check()
    apply_threads(plan.threads, plan.torch_threads)
    return LongContextSession.from_plan(lm.model, plan)


WARM_UP_TOKENS = 2048  # an arm's untimed first run: long enough for decode to select blocks


def run_task(lm: LoadedModel, config: Config, task: str, lengths: list[int], depths: list[float],
             samples: int, attentions: list[str], seed: int, log=sys.stderr, on_result=None,
             warm_up_tokens: int = WARM_UP_TOKENS, earlier: list[Result] = ()) -> list[Result]:
    """on_result(results so far) after every sample (the CLI rewrites results.json there, so a
    run cut short keeps what it measured). warm_up_tokens: the length of each arm's untimed first
    run (where only the answers count, not the speed, it can be short). earlier: results of this
    run measured before (the same model, seed and options; a run cut short, or one split over
    processes), kept first in what it returns: their samples are not run again, and an arm with
    none left to run loads no session."""
    conversation = Conversation(lm.tokenizer, lm.chat_template if config.use_chat_template else None)
    count = lambda text: len(conversation.render_ids([], text))
    max_new = MAX_NEW_TOKENS[task]
    results = list(earlier)
    measured = {(r.attention, r.length, r.depth, r.sample) for r in earlier}
    prompts = {}  # (length, depth, i) -> (sample, ids): every arm gets the same prompts, built once

    def prompt(length: int, depth: float, i: int):
        if (length, depth, i) not in prompts:
            sample = make_sample(task, length, depth, seed * 100003 + length * 7 + int(depth * 1000) * 13 + i, count)
            prompts[length, depth, i] = sample, conversation.render_ids([], sample.prompt)
        return prompts[length, depth, i]

    for attention in attentions:
        todo = [(length, depth, i) for length in lengths for depth in depths for i in range(samples)
                if (attention, length, depth, i) not in measured]
        if not todo:
            continue
        max_seq_len = max(lengths) + max_new + 1
        if attention == "transformers":
            from ktlong.eval.transformers_session import TransformersSession

            session = TransformersSession(lm, max_seq_len)
        else:
            session = make_session(lm, variant_config(config, attention), split_variant(attention)[0], max_seq_len)
        # the head of the first sample, untimed: what compiles or loads on first use (kernels are
        # built per shape and type, not per length; the arm's graphs) is not counted as its speed
        t0 = time.perf_counter()
        session.reset()
        generate(session, prompt(*todo[0])[1][:warm_up_tokens], 2, Sampler(), lm.tokenizer.stop_ids,
                 lm.tokenizer, ctrl_c_ends_answer=False)
        print(f"[{task} {attention}: warm-up run, not timed ({time.perf_counter() - t0:.1f}s)]", file=log, flush=True)
        for length, depth, i in todo:
            sample, ids = prompt(length, depth, i)
            session.reset()
            t0 = time.perf_counter()
            gen = generate(session, ids, max_new, Sampler(), lm.tokenizer.stop_ids, lm.tokenizer,
                           ctrl_c_ends_answer=False)  # a cut answer is no result
            stats = session.last_stats
            densities = stats.density_per_layer if stats else []
            # the prefill itself, as the prefill bench times it; the rest of the session's
            # prefill call builds the decoder (its graphs), before the first token too
            prefill = stats.seconds if stats else gen.prefill_seconds
            r = Result(task, attention, length, depth, i, len(ids), sample.answer, gen.text,
                       score(task, sample.answer, gen.text), len(ids) / max(prefill, 1e-9),
                       gen.decode_tokens_per_second,
                       sum(densities) / len(densities) if densities else 1.0, prefill,
                       stats.attention_seconds + stats.selection_seconds if stats else 0.0,
                       gen.prefill_seconds - prefill)
            results.append(r)
            if on_result is not None:
                on_result(results)
            print(f"[{task} {attention} {length} depth {depth:.2f} #{i}] {'ok ' if r.correct else 'MISS'} "
                  f"expected {r.answer!r} got {gen.text.strip()[:60]!r} ({time.perf_counter() - t0:.1f}s)",
                  file=log, flush=True)
    return results


def answer_of(r: Result) -> str:
    """What two arms' answers are compared by: the first integer of the output for passkey, the
    stripped output otherwise."""
    return (first_integer(r.output) or "") if r.task == "passkey" else r.output.strip()


def same_answers(results: list[Result], a: str, b: str) -> dict[int, tuple[int, int]]:
    """Per length: (prompts on which arms a and b gave the same answer_of, prompts run by both)."""
    by_key = {(r.attention, r.length, r.depth, r.sample): r for r in results}
    out: dict[int, tuple[int, int]] = {}
    for (arm, length, depth, sample), r in sorted(by_key.items(), key=lambda kv: kv[0][1:]):
        other = by_key.get((b, length, depth, sample))
        if arm != a or other is None:
            continue
        same, total = out.get(length, (0, 0))
        out[length] = (same + (answer_of(r) == answer_of(other)), total + 1)
    return out
