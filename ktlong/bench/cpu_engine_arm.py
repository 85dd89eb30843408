"""One run of the torch-free CPU engine (ktlong/models/cpu_llama.py) for `python -m ktlong.bench
cpu-weights`, in a process that never imports torch, so that its peak resident memory is the
engine's own; and the timing that every arm of that bench shares.

python -m ktlong.bench.cpu_engine_arm MODEL LENGTH TOKENS [KEY=VALUE ...]  (prints one JSON line)
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

from ktlong.bench.llama_cpp_arm import prompt_ids
from ktlong.errors import KtlongError


def time_session(session, vocab_size: int, length: int, tokens: int) -> dict:
    """Prefill a fixed prompt of `length` ids, then decode `tokens` tokens greedily: prefill
    seconds, the median decode step's seconds, the process's peak resident bytes."""
    ids = prompt_ids(vocab_size, length)
    start = time.perf_counter()
    logits = session.prefill(ids)
    prefill = time.perf_counter() - start
    steps = []
    for _ in range(tokens):
        start = time.perf_counter()
        logits = session.step(int(logits.argmax()))
        steps.append(time.perf_counter() - start)
    return {"prefill_s": prefill, "decode_s": statistics.median(steps),
            "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run(model: str, length: int, tokens: int, sets: list[str]) -> dict:
    from ktlong.config import load_config, parse_set
    from ktlong.gguf.model_config import RopeOptions
    from ktlong.models.loader import load_cpu_model, open_model
    from ktlong.session.chunked import dense_session
    from ktlong.session.startup import cpu_engine_refusal

    overrides = parse_set(sets) | {"device": ("cpu", "the cpu_engine arm")}
    config = load_config(overrides=overrides, write_user_file=False)
    gf, model_config = open_model(model, RopeOptions.of(config))
    refusal = cpu_engine_refusal(config, gf, model_config)
    if refusal is not None:
        raise KtlongError(f"the cpu_engine arm cannot run {model}: {refusal}; leave that arm out.")
    if length + tokens > model_config.context_length:
        raise KtlongError(f"--lengths {length} plus {tokens} tokens exceed the model's context of "
                          f"{model_config.context_length}; use shorter lengths.")
    lm = load_cpu_model(gf, model_config)
    return time_session(dense_session(lm.model, config, length + tokens), model_config.vocab_size, length, tokens)


if __name__ == "__main__":
    try:
        print(json.dumps(run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])))
    except KtlongError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
