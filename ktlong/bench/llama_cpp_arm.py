"""One llama.cpp run for `python -m ktlong.bench cpu-weights --llama_cpp`, in a process that
imports neither torch nor ktlong's model code, so that its peak resident memory is llama.cpp's
own (torch alone holds about 220 MB).

python -m ktlong.bench.llama_cpp_arm GGUF_PATH LENGTH TOKENS THREADS  (prints one JSON line)
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

from ktlong.errors import KtlongError


def prompt_ids(vocab_size: int, length: int) -> list[int]:
    """The fixed prompt both sides of the bench read: no special tokens."""
    return [(i * 7919) % (vocab_size - 200) + 100 for i in range(length)]


def llama_class():
    """llama-cpp-python's Llama, or the one sentence that says how to get it (the bench asks
    before any arm runs)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise KtlongError("--llama_cpp needs llama-cpp-python (pip install llama-cpp-python); or leave the "
                          "option out.") from None
    return Llama


def run(path: str, length: int, tokens: int, threads: int) -> dict:
    """Prefill seconds, the median decode step's seconds and the peak resident bytes, as the
    bench measures ktlong's runs; decode steps are fed fixed ids (a step's time does not depend
    on which)."""
    llm = llama_class()(model_path=path, n_ctx=length + tokens + 8, n_threads=threads, n_threads_batch=threads,
                        n_batch=512, verbose=False)
    start = time.perf_counter()
    llm.eval(prompt_ids(llm.n_vocab(), length))
    prefill = time.perf_counter() - start
    steps = []
    for i in range(tokens):
        start = time.perf_counter()
        llm.eval([100 + i])
        steps.append(time.perf_counter() - start)
    return {"prefill_s": prefill, "decode_s": statistics.median(steps),
            "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    try:
        print(json.dumps(run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
    except KtlongError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
