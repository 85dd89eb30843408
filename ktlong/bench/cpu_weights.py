"""CPU-only decode and prefill on a real GGUF model in normal mode: torch's model with the GGUF's
matrices kept as stored and multiplied in place (stored), the same with them dequantised to
float32 (float32), the torch-free CPU engine (cpu_engine, ktlong/models/cpu_llama.py), and
llama.cpp.

python -m ktlong.bench cpu-weights --model smollm2-135m --lengths 4k,16k [--tokens 32] [--runs 2]
                                    [--arms float32,stored,cpu_engine,llama.cpp] [--llama_cpp]
                                    [--set kv_type=fp32] [--set chunk_size=1024]

Each run of each arm is a process of its own, so that its peak resident memory is its own (the
cpu_engine and llama.cpp arms import no torch); the arms alternate. A run loads the model on the
CPU, prefills a prompt of the length (fixed token ids) and decodes --tokens tokens greedily. The
table gives medians over the runs: prefill and decode tokens per second, the peak resident
memory, and the decode ratio to the first arm. The cache is normal mode's as the config sets it:
kv_type (auto: bfloat16 on the CPU; the cpu_engine arm takes bf16 only) and chunk_size (0: 512
tokens on the CPU). --llama_cpp adds an arm of llama.cpp (llama-cpp-python, installed
separately) on the same GGUF file, the same prompt ids and as many threads as torch uses,
`n_batch` 512 (its default); it feeds its decode steps fixed ids (a step's time does not depend
on which).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from ktlong.bench.common import RUNS, median
from ktlong.bench.cpu_engine_arm import time_session
from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.config import load_config, parse_set, refuse_unread
from ktlong.errors import KtlongError
from ktlong.gguf.weights import CpuWeights
from ktlong.session.chunked import resolve_chunk_size

ARMS = {"float32": CpuWeights(), "stored": CpuWeights(stored=True)}


LLAMA_CPP, CPU_ENGINE = "llama.cpp", "cpu_engine"
CHILD_ARMS = (CPU_ENGINE, LLAMA_CPP)  # run by modules of their own
READS = frozenset({"kv_type", "chunk_size"})


def run_arm(model: str, length: int, tokens: int, cpu: CpuWeights, config) -> dict:
    """One run of torch's model in this process: prefill and decode seconds, peak resident bytes."""
    from ktlong.models.loader import load_model
    from ktlong.session.dense import DenseSession
    from ktlong.session.plan import resolve_dense_kv_dtype

    resolve_dense_kv_dtype(config.kv_type, torch.device("cpu"), torch.float32)  # refused before loading
    lm = load_model(model, "cpu", torch.float32, cpu=cpu)
    if length + tokens > lm.config.context_length:
        raise KtlongError(f"--lengths {length} plus {tokens} tokens exceed the model's context of "
                          f"{lm.config.context_length}; use shorter lengths.")
    return time_session(DenseSession.from_config(lm.model, config, length + tokens), lm.config.vocab_size, length,
                        tokens)


def command(arm: str, model: str, length: int, tokens: int, sets: list[str]) -> list[str]:
    """The child process of one run: torch's arms through this bench; the CPU engine's and
    llama.cpp's through modules that import no torch (ktlong/bench/cpu_engine_arm.py,
    ktlong/bench/llama_cpp_arm.py)."""
    if arm == CPU_ENGINE:
        return [sys.executable, "-m", "ktlong.bench.cpu_engine_arm", model, str(length), str(tokens), *sets]
    if arm != LLAMA_CPP:
        return [sys.executable, "-m", "ktlong.bench", "cpu-weights", "--model", model, "--lengths", str(length),
                "--tokens", str(tokens), "--arm", arm, *(a for item in sets for a in ("--set", item))]
    from ktlong.gguf.registry import resolve_model_path

    return [sys.executable, "-m", "ktlong.bench.llama_cpp_arm", str(resolve_model_path(model)), str(length),
            str(tokens), str(torch.get_num_threads())]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench cpu-weights", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="packaged model name or GGUF path")
    p.add_argument("--lengths", default="4k", help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per run (the median step is reported)")
    p.add_argument("--runs", type=int, default=2, help="runs per arm and length, alternating")
    p.add_argument("--arms", default="stored,cpu_engine",
                   help=f"arms to run, in this order, comma-separated, from {', '.join([*ARMS, *CHILD_ARMS])}; the "
                        "decode ratio is to the first")
    p.add_argument("--llama_cpp", action="store_true", help="add an arm of llama.cpp (llama-cpp-python) on the same file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="kv_type (the cache's storage) or chunk_size")
    p.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # one run, in a child process
    args = p.parse_args(argv)
    in_range("--runs", args.runs, 1, RUNS, "the runs per arm and length")
    in_range("--tokens", args.tokens, 1, 4096, "the tokens decoded per run")
    lengths = parse_lengths(args.lengths)
    overrides = parse_set(args.set)
    refuse_unread(overrides, READS, "python -m ktlong.bench cpu-weights", "runs normal mode at fixed lengths")
    config = load_config(overrides=overrides, write_user_file=False)
    if args.arm:
        print(json.dumps(run_arm(args.model, lengths[0], args.tokens, ARMS[args.arm], config)))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in (*ARMS, *CHILD_ARMS)]
    if unknown or not arms:
        raise KtlongError(f"--arms {args.arms}: choose from {', '.join([*ARMS, *CHILD_ARMS])}, comma-separated.")
    if args.llama_cpp and LLAMA_CPP not in arms:
        arms.append(LLAMA_CPP)
    if LLAMA_CPP in arms:  # before minutes of the other arms, not after
        from ktlong.bench.llama_cpp_arm import llama_class

        llama_class()
    rows = []
    for length in lengths:
        runs = {arm: [] for arm in arms}
        for _ in range(args.runs):
            for arm in arms:
                child = subprocess.run(command(arm, args.model, length, args.tokens, args.set), capture_output=True,
                                       text=True)
                if child.returncode != 0:
                    lines = (child.stderr or child.stdout).strip().splitlines()  # its own one-sentence error
                    raise KtlongError(lines[-1].removeprefix("error: ") if lines else
                                      f"the {arm} run failed (exit {child.returncode}); run it alone to see why.")
                runs[arm].append(json.loads(child.stdout.strip().splitlines()[-1]))
        decode = {arm: median([r["decode_s"] for r in runs[arm]]) for arm in arms}
        for arm in arms:
            rs = runs[arm]
            rows.append([f"{length:,}", arm, f"{length / median([r['prefill_s'] for r in rs]):,.0f}",
                         f"{1 / decode[arm]:.1f}", f"{median([r['peak_bytes'] for r in rs]) / 2**30:.2f}",
                         f"{decode[arms[0]] / decode[arm]:.2f}x"])
    chunk = resolve_chunk_size(config.chunk_size, config.block_size, torch.device("cpu"))
    print(f"{args.model}, CPU, kv_type {config.kv_type}, prefill chunks of {chunk}, {args.runs} runs per arm, medians")
    print_table(["prompt", "weights", "prefill tok/s", "decode tok/s", "peak RSS GiB", f"decode vs {arms[0]}"], rows)
    return 0
