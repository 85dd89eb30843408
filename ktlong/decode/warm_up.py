"""Compile the CPU decode kernels before anything is timed.

Numba compiles a kernel for each argument type on its first call, and the first decode step of
a fresh install would otherwise spend about 25 s there and count it as decoding. Here every
kernel decode uses runs once on a few blocks of the session's own storage type, head shape and
anchor type, through the same selector and operator calls as decode, so that the real first
step finds them compiled. Each kernel is `cache=True`: the next process loads it from Numba's
on-disk cache instead of compiling it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numba
import numpy as np

import cpu_ops.anchors
import cpu_ops.block_select
import cpu_ops.sparse_attention
from cpu_ops.sparse_attention import sparse_attention
from ktlong.decode.selection import DecodeBlockSelector, SelectionSettings, stored_view
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import KVLayout

KERNEL_MODULES = (cpu_ops.anchors, cpu_ops.block_select, cpu_ops.sparse_attention)


@dataclass(frozen=True)
class CompileReport:
    seconds: float
    compiled: int  # kernel signatures compiled in this process
    loaded: int  # kernel signatures loaded from Numba's cache


def kernel_dispatchers() -> list:
    """The Numba kernels decode calls directly (inlined helpers compile into their callers), the
    partial attention of every storage kind among them."""
    found = [obj for module in KERNEL_MODULES for obj in vars(module).values()
             if isinstance(obj, numba.core.registry.CPUDispatcher) and obj.targetoptions.get("inline") != "always"]
    return found + list(cpu_ops.sparse_attention.PARTIAL_ATTENTION.values())


def _counts() -> tuple[int, int]:
    compiled = loaded = 0
    for dispatcher in kernel_dispatchers():
        compiled += sum(dispatcher.stats.cache_misses.values())
        loaded += sum(dispatcher.stats.cache_hits.values())
    return compiled, loaded


def compile_decode_kernels(layout: KVLayout, settings: SelectionSettings, num_heads: int,
                           scale: float) -> CompileReport:
    """Run selection and sparse attention once on 4 blocks shaped like `layout`."""
    start = time.perf_counter()
    compiled0, loaded0 = _counts()
    num_blocks = 4
    small = dataclasses.replace(layout, num_layers=1, num_blocks=num_blocks, sliding=(), sliding_blocks=0)
    host = HostKVCache(small, pin=False)
    host.reserve(small.capacity)
    rng = np.random.default_rng(0)
    for t in (host.k[0], host.v[0], host.key_mean[0], host.key_max[0], host.key_min[0], host.anchor_keys[0]):
        t.copy_(t.new_tensor(rng.standard_normal(tuple(t.shape))))  # any values of the right type
    for t in (host.k_scales[0], host.v_scales[0]):  # float16 1.0 (q8_0 / q4_0)
        t.fill_(0x3C00)
    num_tokens = small.capacity
    # every block scored and one picked, whatever the session's settings
    scored = dataclasses.replace(settings, second_select_num=1, dense_layer_num=0, preselect_block=False,
                                 token_step=1, layer_step=1)
    selector = DecodeBlockSelector(scored, host, num_heads)
    selector.build_all(num_tokens, [0])
    q = rng.standard_normal((num_heads, small.head_dim)).astype(np.float32)
    blocks, counts = selector.select(0, 0, q, 0, num_blocks)
    k, v = stored_view(host, 0, "k"), stored_view(host, 0, "v")
    sparse_attention(q, k, v, blocks, counts, num_tokens, small.block_size, scale)
    compiled, loaded = _counts()
    return CompileReport(time.perf_counter() - start, compiled - compiled0, loaded - loaded0)
