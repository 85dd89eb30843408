"""Prefill attention of one chunk over a long history: FlashInfer dense vs CompactAttention.

python -m ktlong.bench attention [--chunks 1024,4096] [--histories 32k,128k,512k]
    [--densities 0.1,0.2,0.3] [--backends fa2,fa3] [--selectors flashprefill,topk] [--layers 32]
    [--shape llama-3.1-8b|qwen2.5-0.5b] [--captured captured.npz]

CompactAttention time is split into selection with its Q-block and group unions (the FlashPrefill
selector on pooled keys, fused), page lists (one host sync), FlashInfer plan, and execution. Fixed densities keep a random
set of history blocks per group (random data makes every selector keep almost everything);
the topk selector keeps that share itself (keep_blocks), with page lists of equal lengths and
no host sync, and one plan serves at least the chunk's --layers layers (its plan column is the
plan's time over that many; in a prefill every chunk of that length shares it too);
--captured runs the selectors on q/k/v captured from a real model's prefill (see
`python -m ktlong.bench capture`) and reports the density they choose.
"""

from __future__ import annotations

import argparse
import zipfile

import numpy as np
import torch

from ktlong.bench.common import require_cuda, time_cuda
from ktlong.cli import parse_lengths, print_table
from ktlong.config import default_config
from ktlong.errors import KtlongError
from ktlong.regular_file import NotRegularFile, open_regular
from ktlong.models.random_model import SHAPES, random_config
from ktlong.session.settings import compact_params
from operators.block_union import build_page_lists, fixed_page_lists
from operators.chunk_attention import chunk_attention, flashinfer_available
from operators.compact_attention import CompactAttention, token_rows

B = 128


def fixed_density_keep(num_groups, num_hist, density, sink, window, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(num_groups, num_hist, device=device, generator=g)
    scores[:, :sink] = 2
    scores[:, num_hist - window:] = 2
    count = max(int(round(density * num_hist)), sink + window)
    keep = torch.zeros(num_groups, num_hist, dtype=torch.bool, device=device)
    keep.scatter_(1, scores.topk(count, dim=1).indices, True)
    return keep


def table_row(label, chunk, start, dense_s, density, select_s, pages_s, plan_s, exec_s) -> list:
    """One row of the table: times in microseconds, the speedup over dense and the fixed cost
    (selection, page lists, plan) as a share of the dense time."""
    total = select_s + pages_s + plan_s + exec_s
    us = lambda s: f"{s * 1e6:,.0f}"
    return [label, chunk, f"{start // 1024}K", us(dense_s), f"{density:.0%}", us(select_s), us(pages_s), us(plan_s),
            us(exec_s), us(total), f"{dense_s / total:.2f}x", f"{(select_s + pages_s + plan_s) / dense_s:.1%}"]


def measure(q, k, v, start, backend, keep_groups, op: CompactAttention, pooled, dense_s):
    end = start + q.shape[0]
    num_hist = start // B
    select_s = time_cuda(lambda: op.group_keep(q, k, pooled, start))  # the real selection; the fixed density is kept

    def page_lists():  # as CompactAttention.page_lists, without its dense_above choice
        return build_page_lists(keep_groups, op.groups, op.num_heads, op.num_kv_heads, k.shape[1],
                                num_hist, end - start, B)

    pages_s = time_cuda(page_lists)
    pages = page_lists()
    plan = lambda: op.executor.plan(q.shape[0], op.groups, pages, q.shape[-1], B, op.scale, q.dtype)
    plan_s = time_cuda(plan)
    plan()
    exec_s = time_cuda(lambda: op.executor.run(q, k, v, op.groups))
    return table_row(backend, q.shape[0], start, dense_s, pages.density, select_s, pages_s, plan_s, exec_s)


def measure_topk(q, k, v, start, backend, density, op: CompactAttention, pooled, dense_s, num_layers):
    """The topk selector keeping density of the history: selection, page lists written into the
    planned indices, one plan per chunk shared by num_layers layers, execution."""
    end, num_hist = start + q.shape[0], start // B
    p = op.params
    num_keep = max(round(density * num_hist), p.sink_blocks + p.window_blocks)
    select = lambda: op.topk_indices(q, pooled, num_hist, num_keep, k.shape[1], end - start, None)
    select_s = time_cuda(select)  # the selection and its page indices
    pages = fixed_page_lists(select(), op.groups.shape[0], num_keep, num_hist, end - start, B)
    pages_s = time_cuda(lambda: fixed_page_lists(pages.indices, op.groups.shape[0], num_keep, num_hist,
                                                 end - start, B))
    plan_s = time_cuda(lambda: op.executor.plan(q.shape[0], op.groups, pages, q.shape[-1], B, op.scale,
                                                q.dtype)) / num_layers
    exec_s = time_cuda(lambda: op.executor.run(q, k, v, op.groups))
    return table_row(f"{backend} topk", q.shape[0], start, dense_s, pages.density, select_s, pages_s, plan_s, exec_s)


def dense_time(q, k, v, start, backend, op_all):
    end = start + q.shape[0]
    if backend == "fa2":
        keys, values = token_rows(k)[:, :end], token_rows(v)[:, :end]
        return time_cuda(lambda: chunk_attention(q, keys, values, op_all.scale, "fa2"))
    keep = torch.ones(op_all.groups.shape[0], start // B, dtype=torch.bool, device=q.device)
    pages = build_page_lists(keep, op_all.groups, op_all.num_heads, op_all.num_kv_heads, k.shape[1],
                             start // B, end - start, B)
    op_all.executor.plan(q.shape[0], op_all.groups, pages, q.shape[-1], B, op_all.scale, q.dtype)
    return time_cuda(lambda: op_all.executor.run(q, k, v, op_all.groups))


def synthetic_rows(args, device):
    rows = []
    c = random_config(args.shape)
    params = compact_params(default_config(prefill_attention="compact"))
    for backend in args.backends.split(","):
        op = CompactAttention(params, c.num_heads, c.num_kv_heads, B, c.head_dim ** -0.5, backend, device)
        for chunk in parse_lengths(args.chunks):
            for start in parse_lengths(args.histories):
                nb = (start + chunk) // B
                g = torch.Generator(device=device).manual_seed(0)
                k = torch.randn(c.num_kv_heads, nb, B, c.head_dim, device=device, dtype=torch.bfloat16, generator=g)
                v = torch.randn(c.num_kv_heads, nb, B, c.head_dim, device=device, dtype=torch.bfloat16, generator=g)
                q = torch.randn(chunk, c.num_heads, c.head_dim, device=device, dtype=torch.bfloat16, generator=g)
                pooled = k.float().mean(2)
                dense_s = dense_time(q, k, v, start, backend, op)
                for density in [float(d) for d in args.densities.split(",")]:
                    if "flashprefill" in args.selectors.split(","):
                        keep = fixed_density_keep(op.groups.shape[0], start // B, density, 1, 2, device)
                        rows.append(measure(q, k, v, start, backend, keep, op, pooled, dense_s))
                    if "topk" in args.selectors.split(","):
                        rows.append(measure_topk(q, k, v, start, backend, density, op, pooled, dense_s,
                                                args.layers or c.num_layers))
                del k, v, q, pooled
                torch.cuda.empty_cache()
    return rows


def read_captured(path: str) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """`bench capture`'s file -> {layer: (q [T, H, D], k, v [KV, NB, B, D], chunk start)}, every
    array checked against the others before any is used; no pickle."""
    bad = f"--captured {path} is not a file that `python -m ktlong.bench capture` wrote"
    try:
        f, _ = open_regular(path)
    except NotRegularFile as e:
        raise KtlongError(f"--captured {path} {e}; give a file that `python -m ktlong.bench capture` wrote.") from None
    try:
        with f, np.load(f, allow_pickle=False) as data:
            names = sorted({n.split("_")[0] for n in data.files if n.startswith("layer")})
            layers = {name: tuple(data[f"{name}_{part}"] for part in ("q", "k", "v", "start")) for name in names}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise KtlongError(f"{bad} ({e}); capture one again.") from None
    if not layers:
        raise KtlongError(f"{bad} (it holds no layer); capture one again.")
    out = {}
    for name, (q, k, v, start) in layers.items():
        if not (q.ndim == 3 and k.ndim == 4 and k.shape == v.shape and k.shape[2] == B and q.shape[2] == k.shape[3]
                and q.shape[1] % k.shape[0] == 0 and start.shape == () and np.issubdtype(start.dtype, np.integer)
                and 0 <= int(start) and int(start) % B == 0 and int(start) + q.shape[0] <= k.shape[1] * B):
            raise KtlongError(f"{bad} ({name}'s arrays do not fit one another); capture one again.")
        out[name] = (q, k, v, int(start))
    return out


def captured_rows(layers: dict, device, backend):
    rows = []
    for name, (q, k, v, start) in layers.items():
        q = torch.from_numpy(q).to(device, torch.bfloat16)  # [T, H, D]
        k = torch.from_numpy(k).to(device, torch.bfloat16)  # [KV, NB, B, D]
        v = torch.from_numpy(v).to(device, torch.bfloat16)
        num_heads, num_kv, dim = q.shape[1], k.shape[0], q.shape[2]
        pooled = k.float().mean(2)
        for params in (compact_params(default_config(prefill_attention="compact")),
                       compact_params(default_config(prefill_attention="compact", selector="xattention"))):
            op = CompactAttention(params, num_heads, num_kv, B, dim ** -0.5, backend, device)
            dense_s = dense_time(q, k, v, start, backend, op)
            out, pages = op(q, k, v, pooled, start, start + q.shape[0])
            compact_s = time_cuda(lambda: op(q, k, v, pooled, start, start + q.shape[0]))
            rows.append([name, params.selector, f"{start}", f"{dense_s * 1e6:,.0f}", f"{pages.density:.0%}",
                         f"{compact_s * 1e6:,.0f}", f"{dense_s / compact_s:.2f}x"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="1024,4096")
    p.add_argument("--histories", default="32k,128k,512k")
    p.add_argument("--densities", default="0.1,0.2,0.3")
    p.add_argument("--backends", default="fa2,fa3")
    p.add_argument("--selectors", default="flashprefill,topk", help="flashprefill: its selection timed, the "
                   "fixed density's random blocks executed; topk: its own selection at each density")
    p.add_argument("--layers", type=int, default=None, help="layers that share one topk plan per chunk "
                   "(default: the shape's)")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES),
                   help="the attention heads of this model (qwen2.5-0.5b: the evaluation's model)")
    p.add_argument("--captured", help="npz of q/k/v captured by `python -m ktlong.bench capture`")
    args = p.parse_args(argv)
    captured = read_captured(args.captured) if args.captured else None  # refused before the GPU is asked
    require_cuda("the attention benchmark")
    if not flashinfer_available():
        raise KtlongError("the attention benchmark measures FlashInfer, which is not installed; "
                          "pip install flashinfer-python (pip install -e \".[gpu]\").")
    device = torch.device("cuda", torch.cuda.current_device())
    c = random_config(args.shape)
    print(f"{torch.cuda.get_device_name(device)}, bf16, {args.shape}: {c.num_heads} q heads / {c.num_kv_heads} kv "
          f"heads / d {c.head_dim}, block {B}; "
          "times are medians of 20 runs in microseconds")
    print_table(["backend", "chunk", "history", "dense", "density", "select+unions", "page lists", "plan",
                 "execute", "compact total", "speedup", "overhead/dense"], synthetic_rows(args, device))
    if args.captured:
        print(f"\nselectors on q/k/v captured from a real prefill ({args.captured}), fa2, default settings")
        print_table(["layer", "selector", "history", "dense", "density", "compact total", "speedup"],
                    captured_rows(captured, device, "fa2"))
    return 0
