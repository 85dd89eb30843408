"""Time to the first token of a follow-up question on a long document: re-prefill against reuse
of the cache in DRAM against loading a saved cache from disk.

python -m ktlong.bench follow-up --contexts 128k [--question 64] [--repeats 3] [--profile] [--shape llama-3.1-8b]
    [--folder DIR] [--set key=value]

Random weights of a real shape, the long-context session local_chat runs (plan, prefill,
decode), the same document for each row. Re-prefill: a fresh prefill of document + question.
Reuse: a question prefilled over the document already cached (a different question each
repeat, each over the same history; the first also fills the layers whose history stays on the
GPU between turns, resident_history, and is shown on its own). Load: a fresh session reads the cache saved to --folder,
then prefills the question. Re-prefill and reuse are medians of --repeats runs; load, save and
their rates are one run each (the file is dropped from the page cache before the load).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch

from ktlong.bench.call_sites import CallSites, print_call_sites
from ktlong.bench.common import RUNS, median
from ktlong.bench.profile_table import print_profile
from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.config import load_config, options_in, parse_set, refuse_unread
from ktlong.device import resolve_device
from ktlong.kv.memory_plan import GIB
from ktlong.models.random_model import SHAPES, num_weight_elements, random_config, random_model
from ktlong.session.long_context import LongContextSession
from ktlong.session.plan import apply_threads, plan_session
from ktlong.session.saved_cache import load_cache, save_cache

# what this bench reads of the config: a session's prefill and decode on random weights
READS = options_in("long-context prefill", "KV cache and sparse decode") | {
    "device", "gpu_memory_budget_gb", "use_cuda_graph", "resident_history"}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def evict(path: str):
    """Drop the (written and synced) file from the page cache, so loading reads the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def io_rates(contexts, plans, fp, folder, model_config, device, dtype, question: int) -> int:
    """Save and load rates of a host cache filled with random values (no weights, no prefill):
    loading read from the disk (the file dropped from the page cache first) and from the page
    cache; copied into the cache, and, where it is not pinned, mapped into it. Then the save
    after a follow-up of `question` tokens, which appends to the file."""
    from types import SimpleNamespace

    from ktlong.bench.decode import fill_random
    from ktlong.kv.host_cache import HostKVCache

    rows, append_rows = [], []
    for n, plan in zip(contexts, plans):
        host = HostKVCache(plan.layout, pin=device.type == "cuda")
        fill_random(host, n)
        ids = list(range(n))
        # what save_cache and load_cache read of a session
        session = SimpleNamespace(host=host, layout=plan.layout, ids=ids, reset=host.reset,
                                  model=SimpleNamespace(config=model_config, dtype=dtype))
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            path = f"{tmp}/doc.kv"
            nbytes, save_s = timed(lambda: save_cache(path, session, fp, []))
            gb = nbytes / 1e9
            for how in ("copied", "mapped") if host.maps_files else ("copied",):
                host.maps_files = how == "mapped"  # copied first: a copy into mapped pages would copy them on write
                times = []
                for from_disk in (True, False):
                    host.reset()
                    if from_disk:
                        evict(path)
                    times.append(timed(lambda: load_cache(path, session, fp))[1])
                rows.append([f"{n // 1024}K", plan.kv_type, how, f"{gb:.2f}", f"{save_s:.2f}", f"{gb / save_s:.2f}",
                             f"{times[0]:.2f}", f"{gb / times[0]:.2f}", f"{times[1]:.2f}", f"{gb / times[1]:.2f}"])
            host.reserve(host.num_tokens + question)
            host.advance(question)  # the follow-up's K/V (their values do not matter here)
            appended, append_s = timed(lambda: save_cache(path, session, fp, []))
            append_rows.append([f"{n // 1024}K", plan.kv_type, question, f"{save_s:.2f}", f"{appended / 1e6:.1f}",
                                f"{append_s:.3f}", f"{save_s / append_s:.0f}x"])
        del host
    print(f"saved cache of random values, {model_config.num_layers} layers x {model_config.num_kv_heads} kv heads x "
          f"{model_config.head_dim}; loaded from the disk (the file dropped from the page cache), then from the "
          "page cache; copied into the cache, or mapped into it (a cache that is not pinned)")
    print_table(["context", "kv", "load", "file GB", "save s", "save GB/s", "disk load s", "disk GB/s",
                 "page-cache load s", "page-cache GB/s"], rows)
    print("the save after a follow-up, appended to the file (each save flushed to disk):")
    print_table(["context", "kv", "follow-up tokens", "whole save s", "appended MB", "append s", "faster"], append_rows)
    return 0


def release_device_memory():
    """What a session that is gone held on the device, given back before the next one is made
    within the same budget: its decoder's graphs sit in reference cycles (about 7 GiB at 128K
    that only the collector frees), and the allocator's cached blocks, cut to the last
    session's sizes, would count against the cap beside the new session's plan."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench follow-up", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="128k")
    p.add_argument("--question", type=int, default=64, help="tokens of the follow-up question")
    p.add_argument("--repeats", type=int, default=3, help="runs of re-prefill and of reuse; medians are printed")
    p.add_argument("--profile", action="store_true", help="after the timed runs, profile one more reuse with "
                   "torch.profiler and print where its host and device time went, then count the torch "
                   "calls of another by the line that made them")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: llama-3.1-8b on a GPU, tiny on the CPU")
    p.add_argument("--folder", default=None, help="where the cache is saved (default: a temporary folder)")
    p.add_argument("--device", default="auto")
    p.add_argument("--io_only", action="store_true", help="only save and load a cache of random values "
                   "(no model): the disk rates, at any length, on any machine")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config option")
    args = p.parse_args(argv)
    in_range("--repeats", args.repeats, 1, RUNS, "the runs of re-prefill and of reuse")
    in_range("--question", args.question, 1, 1 << 16, "the follow-up question's tokens")
    overrides = parse_set(args.set)
    refuse_unread(overrides, READS, "python -m ktlong.bench follow-up",
                  "measures a session's prefill and follow-ups on random weights, without generating text")
    overrides.setdefault("device", (args.device, "--device"))
    config = load_config(overrides=overrides, write_user_file=False)
    device = resolve_device(config.device)
    shape = args.shape or ("llama-3.1-8b" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, config.gpu_memory_budget_gb * GIB / total), device)
    c = random_config(shape)
    contexts = parse_lengths(args.contexts)
    weight_bytes = num_weight_elements(c) * dtype.itemsize
    plans = [plan_session(config, c, weight_bytes, n + args.question + 8, device, dtype) for n in contexts]
    for plan in plans:
        plan.check()
    apply_threads(plans[0].threads, plans[0].torch_threads)
    fp = {"bench": shape}
    if args.io_only:
        return io_rates(contexts, plans, fp, args.folder, model_config=c, device=device, dtype=dtype,
                        question=args.question)
    model = random_model(shape, device, dtype)
    rows = []
    generator = torch.Generator().manual_seed(0)
    for n, plan in zip(contexts, plans):
        doc = torch.randint(0, c.vocab_size, (n,), generator=generator).tolist()
        questions = [torch.randint(0, c.vocab_size, (args.question,), generator=generator).tolist()
                     for _ in range(args.repeats)]
        question = questions[0]
        session = LongContextSession.from_plan(model, plan)
        session.host.reserve(n + args.question)  # its DRAM page-locked before anything is timed (as bench prefill)
        reprefill = []
        for _ in range(args.repeats):
            session.reset()
            reprefill.append(timed(lambda: session.prefill(doc + question))[1])
        session.reset()
        session.prefill(doc)
        reuse, history_s, setup_s = [], [], []
        for q in questions:  # each over the document alone: the questions differ from their first token
            assert session.reusable(doc + q) == n
            reuse.append(timed(lambda: session.prefill(doc + q))[1])
            history_s.append(session.last_stats.history_seconds)
            setup_s.append(session.last_decode_setup_seconds)
        kept, prefetched = session.last_follow_up
        resident = len(session.resident.layers) if session.resident is not None else 0
        first_reuse = reuse[0]  # the first follow-up fills the resident layers; later ones read them
        if args.profile:
            q = torch.randint(0, c.vocab_size, (args.question,), generator=generator).tolist()
            print_profile(lambda: session.prefill(doc + q))
            q = torch.randint(0, c.vocab_size, (args.question,), generator=generator).tolist()
            with CallSites() as sites:  # one more reuse: which lines its launches come from
                session.prefill(doc + q)
            print_call_sites(sites.counts, c.num_layers, "layer")
        reprefill, reuse = median(reprefill), median(reuse)
        session.prefill(doc)  # the cache holds the document alone again (its last token prefilled anew)
        with tempfile.TemporaryDirectory(dir=args.folder) as folder:
            path = f"{folder}/doc.kv"
            nbytes, save_s = timed(lambda: save_cache(path, session, fp, []))
            del session
            release_device_memory()  # the loading session gets the device as the first one did
            fresh = LongContextSession.from_plan(model, plan)
            evict(path)
            _, load_s = timed(lambda: load_cache(path, fresh, fp))
            _, after_load = timed(lambda: fresh.prefill(doc + question))
            del fresh
        release_device_memory()
        rows.append([f"{n // 1024}K", plan.kv_type, f"{reprefill:.2f}", f"{first_reuse:.3f}", f"{reuse:.3f}",
                     f"{median(history_s):.3f}", f"{median(setup_s):.3f}",
                     "yes" if kept else "no", "yes" if prefetched else "no",
                     f"{resident}/{c.num_layers}", f"{reprefill / reuse:.0f}x",
                     f"{load_s + after_load:.2f}", f"{nbytes / 1e9:.2f}", f"{nbytes / 1e9 / save_s:.2f}",
                     f"{nbytes / 1e9 / load_s:.2f}"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{shape} random {dtype} weights on {where}; follow-up of {args.question} tokens; seconds to its first "
          f"token's logits; re-prefill and reuse: medians of {args.repeats} runs")
    print_table(["document", "kv", "re-prefill s", "first reuse s", "reuse s", "of which history load s",
                 "of which decode setup s", "decoder kept", "history prefetched", "layers resident",
                 "reuse speedup", "load + prefill s", "file GB",
                 "save GB/s", "load GB/s"], rows)
    return 0
