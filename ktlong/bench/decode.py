"""Hybrid decode on random LLaMA-3.1-8B-shape weights, GPU capped at 24 GiB, DRAM cache filled
with random KV of each context length (decode speed does not depend on the values). On a
machine without a GPU (or with --device cpu) the same rows but CUDA graphs, on the tiny shape
by default, float32.

python -m ktlong.bench decode [--contexts 32k,128k,512k] [--tokens 32] [--set key=value] [--modes ...]
    [--batch 1,2,4,8] [--shape llama-3.1-8b|tiny] [--device auto|cpu|cuda]

--batch: conversations decoded together (ktlong/decode/batch.py), each over its own DRAM cache of
the context's length: one pass over the weights per step, each conversation's selected blocks
read apart. tok/s counts every conversation's tokens; the floors are the weights once per step
plus every conversation's K/V.

Rows: all blocks on the CPU (dense), sparse with every token on the CPU (no device window),
and hybrid (device window + CPU sparse blocks; `graphs-gpu-context`: the GPU reads every selected block from DRAM itself, `context_attention: gpu`,
and selects them too when block scoring is on the device: one graph a token, and its "wait"
column is the whole token's device time).
Times per token: total, CPU operator, selection, waiting for q from the device, and the rest (device work after the CPU part,
merge, Python). Beside them the two floors of a token, measured in the same run: the K/V
bytes the CPU operator read at the host's streaming-read rate (a Numba read of 1 GiB on the
decode threads) plus those the GPU read from DRAM at its pinned-copy rate (1 GiB to the device),
and the weights a token reads at the device's copy rate (1 GiB device to
device; on the CPU, a copy in DRAM).

A GPU row with `context_attention: gpu` keeps on the device the layers' rows a session would
keep after prefilling the context (`resident_history`, as many layers as the plan leaves room
for under --gpu_cap_gb): the GPU reads those layers' selected blocks there, and only the others'
cross PCIe and count towards the K/V floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ktlong.bench.common import time_cuda
from ktlong.bench.profile_table import print_profile
from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.bench.drifting_selection import DriftingSelection
from ktlong.config import load_config, options_in, parse_set, refuse_unread
from ktlong.device import resolve_device
from ktlong.errors import KtlongError
from ktlong.decode.batch import DecodeBatch
from ktlong.decode.decoder import Decoder, DecodeTimes
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from cpu_ops.anchors import anchors_per_block
from ktlong.decode.device_anchors import scores_on_device
from ktlong.kv.free_memory import GIB, available_dram_bytes
from ktlong.kv.memory_plan import plan_memory
from ktlong.kv.resident import ResidentHistory
from ktlong.kv.shared_prefix import dram_held, granularity, shareable_blocks
from ktlong.session.long_context import RESIDENT_MARGIN
from ktlong.models.random_model import SHAPES, num_weight_elements, random_config, random_model
from ktlong.parallel.group import join_ranks
from ktlong.parallel.launch import quiet_unless_main
from ktlong.session.plan import kept_blocks, resolve_block_scoring, resolve_chunk_size, resolve_kv_type, resolve_selection
from ktlong.session.settings import selection_settings
from operators.kv_quant import quantize_kv

# what this bench reads of the config: decode's KV layout and selection; each row sets its own
# context attention and graphs, and preselection is off (the cache holds random K/V, no prompt);
# resident_history and chunk_size decide the layers whose rows stay on the GPU (resident_copies)
PROFILE_STEPS = 8  # steps of a row run under torch.profiler with --profile
MAX_TIMED_TOKENS = 4096  # decode steps timed per row: each extends every conversation's cache by one
READS = (options_in("KV cache and sparse decode") - {"context_attention", "preselect_block", "preselect_block_count"}
         | {"resident_history", "chunk_size"})


def fill_random(host: HostKVCache, num_tokens: int, seed: int = 0):
    """Random K/V and side tables for the first num_tokens tokens, by tiling one random slab."""
    g = torch.Generator().manual_seed(seed)
    layout = host.layout
    host.reserve(num_tokens)
    slab = torch.randn(layout.num_kv_heads, 64, layout.block_size, layout.head_dim, generator=g).to(layout.dtype)
    planes = [(host.k + host.v, slab)]
    if layout.is_quantized:  # stored as DRAM stores them: GGML's blocks and their scales
        data, scales = quantize_kv(slab, layout.kv_type)
        planes = [(host.k + host.v, data), (host.k_scales + host.v_scales, scales)]
    blocks = -(-num_tokens // layout.block_size)
    for tensors, values in planes:
        for t in tensors:
            for b0 in range(0, blocks, 64):
                n = min(64, blocks - b0)
                t[:, b0:b0 + n].copy_(values[:, :n])
    for layer in layout.global_layers:
        for table in (host.key_mean, host.key_max, host.key_min, host.anchor_keys):
            table[layer][:, :blocks].normal_(generator=g)
    host.reset()
    host.advance(num_tokens)


def resident_copies(model, host: HostKVCache, config, settings, budget: int, local: int) -> ResidentHistory | None:
    """The layers' rows a GPU session keeps on the device after prefilling this cache as a new
    prompt (`resident_history`): as many layers as its plan leaves room for beside that
    prefill (LongContextSession._new_prompt_room), copied from DRAM. None on the CPU or when off."""
    if model.device.type != "cuda" or not config.resident_history:
        return None
    layout, c = host.layout, model.config
    anchors = anchors_per_block(config.anchor_type, config.anchor_num) if scores_on_device(settings) else 0
    chunk = resolve_chunk_size(config.chunk_size, config.block_size, model.device)
    act = model.dtype.itemsize
    memory = plan_memory(c, num_weight_elements(c) * act, act, layout, chunk, budget, True,
                         local, anchors, kept_blocks=kept_blocks(settings, c.num_layers))
    resident = ResidentHistory(layout, model.device)
    resident.fit(budget - memory.prefill_device - RESIDENT_MARGIN)
    n = host.num_tokens
    for layer in resident.layers:
        for which in "kv":
            data = getattr(host, which)[layer].view(layout.num_kv_heads, layout.capacity, -1)[:, :n]
            scales = (getattr(host, f"{which}_scales")[layer].view(layout.num_kv_heads, layout.capacity, -1)[:, :n]
                      if layout.is_quantized else None)
            resident.write(layer, which, 0, n, data.to(model.device),
                           None if scales is None else scales.to(model.device))
        resident.extend(layer, 0, n)
    return resident


MODES = {"dense": "dense (all blocks on CPU)", "cpu": "sparse, CPU only", "hybrid": "hybrid",
         "graphs": "hybrid + CUDA graphs",
         "graphs-gpu-context": "CUDA graphs, the GPU reads the selected blocks from DRAM",
         "graphs-cpu-scoring": "hybrid + CUDA graphs, CPU scoring"}


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_batches(text: str) -> list[int]:
    """--batch: comma-separated batch sizes from 1 to 256, in order."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or max(sizes) > 256:
        raise KtlongError(f"--batch takes comma-separated batch sizes from 1 to 256, such as 1,2,4,8 (not '{text}').")
    return sizes


def figures(decoders: list, per_step: list[float], stream_gbps: float, pcie_gbps: float | None,
            weight_floor: float) -> list[str]:
    """A row's figures for a batch: tok/s over every conversation; a step's time, CPU attention,
    selection, waiting and the rest (ms, medians and means per step); the K/V the step read
    (every conversation's) and the floors: K/V the CPU read at its stream rate and the GPU over
    PCIe (less what it read from its own copies of layers' rows and from the blocks it kept from
    the last tokens), the weights once per step."""
    per_step = sorted(per_step)
    med = per_step[len(per_step) // 2]
    n = decoders[0].times.steps
    total = lambda field: sum(getattr(d.times, field) for d in decoders)  # noqa: E731
    cpu, sel = total("cpu_attention") / n, total("selection") / n
    wait, step = decoders[0].times.device_wait / n, decoders[0].times.total / n  # each member waits the same
    gpu_read = (sum((d.times.device_read - d.times.near_read - d.times.kept_read) * d.block_bytes for d in decoders)
                if decoders[0].dram_blocks is not None else 0)
    cpu_read = total("kv_bytes")
    kv_floor = cpu_read / n / (stream_gbps * 1e9) + (gpu_read / n / (pcie_gbps * 1e9) if gpu_read else 0)
    floor = kv_floor + weight_floor
    selected = total("selected")
    return [f"{len(decoders) / med:.1f}", f"{med * 1e3:.1f}", f"{cpu * 1e3:.1f}", f"{sel * 1e3:.1f}",
            f"{wait * 1e3:.1f}", f"{(step - cpu - sel - wait) * 1e3:.1f}", f"{(cpu_read + gpu_read) / n / 1e6:.0f}",
            f"{kv_floor * 1e3:.1f}", f"{weight_floor * 1e3:.1f}", f"{floor * 1e3:.1f}", f"{floor / med:.0%}",
            f"{total('device_read') / selected:.0%}" if selected else "-"]


def weight_bytes_per_token(model) -> int:
    """Bytes of the weights one decode step reads: every layer's projections and the output
    head (the embedding table gives one row; the norms are negligible)."""
    c = model.config
    return (c.num_layers * c.layer_matrix_elements + c.vocab_size * c.hidden_size) * model.dtype.itemsize


def device_copy_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """The device memory's rate: bytes read plus written per second by a copy (median of 9)."""
    from ktlong.bench.decode_op import timed

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)

    def copy():
        dst.copy_(src)

    seconds = time_cuda(copy, reps=9, warmup=1) if device.type == "cuda" else timed(copy, 9)
    del src, dst
    if device.type == "cuda":  # the rows' "peak GPU" is the decoder's, not this copy's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return 2 * nbytes / seconds / 1e9


def host_to_device_gbps(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """The rate at which the GPU reads pinned DRAM (a copy of 1 GiB to the device, median of 9):
    the floor of the blocks `context_attention: gpu` reads over PCIe. None without a GPU."""
    if device.type != "cuda":
        return None
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = time_cuda(lambda: dst.copy_(src, non_blocking=True), reps=9, warmup=1)
    del src, dst
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return nbytes / seconds / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32k,128k,512k")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per row (after 4 warm-up steps)")
    p.add_argument("--gpu_cap_gb", type=float, default=24.0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--modes", default=None,
                   help="rows to run, comma-separated, of: " + ", ".join(MODES) + " (default: all; on the CPU "
                   "those without graphs)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: llama-3.1-8b on a GPU, tiny on the CPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--selection_drift", type=float, default=None, metavar="SHARE",
                   help="keep each of the previous token's selected blocks with this probability, the rest "
                        "from the real selection (random weights select nearly new blocks every token; real "
                        "text keeps most: 0.72 at 128K on Qwen2.5, docs/measurements/2026-11-decode.md), on the "
                        "device's selection or the host's; 0 to 1, default: the real selection")
    p.add_argument("--batch", default="1", metavar="SIZES",
                   help="conversations decoded together, comma-separated batch sizes (default: 1), each "
                        "conversation over its own cache of the context's length")
    p.add_argument("--shared_document", action="store_true",
                   help="the batch's conversations share one document of the context's length: DRAM holds its "
                        "blocks once (ktlong/kv/shared_prefix.py), each conversation's own tokens after it")
    p.add_argument("--profile", action="store_true", help=f"after each row's timed tokens, run {PROFILE_STEPS} more "
                   "under torch.profiler and print where their host and device time went (kernels by device time)")
    p.add_argument("--tensor_parallel", type=int, default=1, metavar="N",
                   help="split heads and MLP columns over N ranks; start with torchrun --nproc_per_node N")
    args = p.parse_args(argv)
    quiet_unless_main()
    overrides = parse_set(args.set)
    refuse_unread(overrides, READS, "python -m ktlong.bench decode", "measures decode on random weights with "
                  "each --modes row's own context attention and graphs, without preselection, under --gpu_cap_gb")
    config = load_config(overrides={**overrides, "device": (args.device, "--device")}, write_user_file=False)
    device = resolve_device(config.device)
    cuda = device.type == "cuda"
    modes = (args.modes or ",".join(m for m in MODES if cuda or not m.startswith("graphs"))).split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    in_range("--tokens", args.tokens, 1, MAX_TIMED_TOKENS, "the decode steps timed per row")
    if args.selection_drift is not None and not 0.0 <= args.selection_drift <= 1.0:
        raise KtlongError(f"--selection_drift is the share of blocks kept, from 0 to 1 (got {args.selection_drift}).")
    if not cuda and any(m.startswith("graphs") for m in modes):
        raise KtlongError("The graphs modes replay CUDA graphs, which need a GPU; leave them out of --modes "
                          "or run on a GPU.")
    contexts = parse_lengths(args.contexts)
    batches = parse_batches(args.batch)
    shape = args.shape or ("llama-3.1-8b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    tp, device = join_ranks(args.tensor_parallel, random_config(shape), device)
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gb * GIB / total), device)
    model = random_model(shape, device, dtype, tp=tp)
    c = model.config
    # room for the timed tokens (kv_layout rounds the capacity to whole pages of each head's tables,
    # so that the caches can share: ktlong/kv/shared_prefix.py)
    layouts = {context: kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, config.block_size,
                                  context + 4 + args.tokens + PROFILE_STEPS * args.profile + 1,
                                  resolve_kv_type(config.kv_type, dtype),
                                  anchor_type=config.anchor_type, anchor_num=config.anchor_num) for context in contexts}
    free = available_dram_bytes()
    for context, layout in layouts.items():  # every row's caches fit, before any row runs
        if args.shared_document and shareable_blocks(layout, context) * layout.block_size < context:
            raise KtlongError(f"A {context:,}-token document does not fill whole shared pages of this KV layout; "
                              f"give --contexts in multiples of {granularity(layout) * layout.block_size} tokens, "
                              f"or leave out --shared_document.")
        plan = plan_memory(c, num_weight_elements(c) * dtype.itemsize, dtype.itemsize, layout, 1, 1 << 62, cuda,
                           conversations=max(batches), shared_tokens=context if args.shared_document else 0)
        fit = plan.conversations_that_fit(1 << 62, free, available_dram_bytes("MemTotal"))
        each = f" ({plan.dram_shared / GIB:.1f} GiB of it shared)" if args.shared_document else ""
        print(f"{context // 1024}K: {plan.dram_cache / GIB:.1f} GiB of DRAM a conversation{each}; {fit} fit in "
              f"the {free / GIB:.0f} GiB free", flush=True)
        if max(batches) > fit:
            pinned = " (CUDA page-locks each cache whole, shared blocks too)" if cuda and args.shared_document else ""
            raise KtlongError(f"--batch {max(batches)} needs {plan.dram_total / GIB:.1f} GiB of DRAM at "
                              f"{context // 1024}K, and {fit} conversations fit in this machine's DRAM{pinned}; "
                              f"give --batch sizes up to {fit} or shorter --contexts.")
    from cpu_ops.threads import set_decode_threads

    ranks = f"tensor parallel {tp.world}, per rank: " if tp is not None else ""
    where = f"{torch.cuda.get_device_name(device)}, GPU cap {args.gpu_cap_gb} GiB" if cuda else "CPU only"
    print(f"{ranks}{where} + {set_decode_threads(config.threads_num)} CPU threads; {shape} random "
          f"{str(dtype).removeprefix('torch.')}; kv {config.kv_type}, block {config.block_size}, top-k "
          f"{config.second_select_num}, local {config.local_windows_len}, anchors {config.anchor_type}, "
          f"{config.head_select_mode}, dense layers {config.dense_layer_num}, block scoring "
          f"{resolve_block_scoring(config.block_scoring, device)}, "
          f"selection {'real' if args.selection_drift is None else f'drifting, {args.selection_drift:.0%} kept'}; "
          f"ms per token, medians over "
          f"{args.tokens} tokens")
    from ktlong.bench.decode_op import stream_read_gbps

    stream_gbps, hbm_gbps, pcie_gbps = stream_read_gbps(1 << 30), device_copy_gbps(device), host_to_device_gbps(device)
    weight_bytes = weight_bytes_per_token(model)
    weight_floor = weight_bytes / (hbm_gbps * 1e9)
    rows = []
    sparse = dataclasses.replace(selection_settings(config, c.num_layers), preselect_block=False,
                                 context_attention="cpu")  # gpu: its own mode
    sparse = resolve_selection(sparse, device, None)
    local = config.local_windows_len
    dense = dataclasses.replace(selection_settings(config, c.num_layers, "dense"), block_scoring="cpu",
                                context_attention="cpu")  # this mode's row: the CPU operator over every block
    settings = {"dense": (dense, local, False),
                "cpu": (sparse, 0, False), "hybrid": (sparse, local, False), "graphs": (sparse, local, True),
                "graphs-gpu-context": (dataclasses.replace(sparse, context_attention="gpu"), local, True),
                "graphs-cpu-scoring": (dataclasses.replace(sparse, block_scoring="cpu"), local, True)}
    modes = [(MODES[m], *settings[m]) for m in modes]
    for context, layout in layouts.items():
        hosts = []  # one DRAM cache per conversation, for the largest batch
        for i in range(max(batches)):
            if args.shared_document and hosts:  # the first one's document, one copy
                hosts.append(HostKVCache(layout, pin=cuda, prefix=(hosts[0], context // layout.block_size)))
                continue
            hosts.append(HostKVCache(layout, pin=cuda))
            fill_random(hosts[-1], context, seed=i)
        for name, settings, local, graphs in modes:
            for size in batches:
                if name.startswith("dense") and context > 128 * 1024:
                    rows.append([f"{context // 1024}K", size, name, *["-"] * 12, "skipped (minutes per token)"])
                    continue
                for host in hosts[:size]:  # the previous row's tokens go
                    host.truncate(context)
                # a conversation alone keeps the layers' rows its session would keep on the GPU; a
                # batch's conversations read every block from DRAM
                resident = (resident_copies(model, hosts[0], config, settings, int(args.gpu_cap_gb * GIB), local)
                            if settings.context_attention == "gpu" and size == 1 else None)
                decoders = [Decoder(model, host, settings, local, use_cuda_graph=graphs, resident=resident)
                            for host in hosts[:size]]
                # (indices, not loop variables: none is left holding a decoder into the next row)
                if args.selection_drift is not None:
                    for i in range(size):
                        if decoders[i].selection is not None:  # the device selects: the drift runs there too
                            from ktlong.bench.device_drift import DeviceDrift  # needs triton

                            decoders[i].selection.adjust = DeviceDrift(decoders[i].selection, args.selection_drift, i)
                        else:
                            decoders[i].selector.select = DriftingSelection(decoders[i].selector.select,
                                                                            args.selection_drift, i)
                batch = DecodeBatch(model, decoders, graphs and cuda)
                for t in range(4):
                    batch.step(decoders, [t] * size)
                for i in range(size):
                    decoders[i].times = DecodeTimes()
                synchronize(device)
                per_step = []
                for t in range(args.tokens):
                    t0 = time.perf_counter()
                    batch.step(decoders, [100 + t + 7 * i for i in range(size)])  # each its own token
                    synchronize(device)
                    per_step.append(time.perf_counter() - t0)
                rows.append(row := [f"{context // 1024}K", size, name, *figures(decoders, per_step, stream_gbps,
                                                                             pcie_gbps, weight_floor)])
                row.append((f"peak GPU {torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB, " if cuda else "")
                           + f"caches in DRAM {dram_held(hosts[:size]) / GIB:.1f} GiB"
                           + (f", {len(resident.layers)}/{len(layout.global_layers)} layers' rows on the GPU"
                              if resident is not None else ""))
                print("partial:", " | ".join(map(str, row)), flush=True)
                if args.profile:  # after the row's figures: these steps count in none of them
                    print(f"profile of {PROFILE_STEPS} steps: {context // 1024}K, batch {size}, {name}", flush=True)
                    print_profile(lambda: [batch.step(decoders, [200 + t + 7 * i for i in range(size)])
                                           for t in range(PROFILE_STEPS)], device_rows=25)
                del batch, decoders, resident
                if cuda:
                    torch.cuda.empty_cache()
        del hosts
    pcie = f", by the GPU (gpu-context) at its pinned-copy rate of {pcie_gbps:.1f} GB/s" if pcie_gbps else ""
    print(f"floors: K/V read at the host's stream of {stream_gbps:.1f} GB/s{pcie}; {weight_bytes / 1e9:.2f} GB of weights "
          f"read at the {'GPU' if cuda else 'DRAM'} copy rate of {hbm_gbps:,.0f} GB/s = {weight_floor * 1e3:.2f} ms")
    print_table(["context", "batch", "mode", "tok/s", "ms/step", "CPU attention", "selection", "wait for q",
                 "rest (GPU, merge, Python)", "K/V read from DRAM MB", "K/V floor", "weights floor", "floors summed",
                 "of the floor", "read by the GPU", "note"], rows)
    return 0
