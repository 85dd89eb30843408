"""A short prefill chunk's projections and MLP, layer by layer, replayed from CUDA graphs.

A cache hit prefills a question of a few dozen tokens over a long history. Per layer, the
kernels before attention (norm, q/k/v projections, RoPE) and after it (output projection,
residual, norm, MLP) are launched from Python one by one, and for so few rows the launches cost
the host more time than the GPU spends running them. Here each of the two parts of each layer
is captured once per size bucket as one CUDA graph: a chunk's rows are copied into the bucket's
inputs, the graph replayed, and the first rows of its outputs read. Rows past the chunk's hold
whatever an earlier chunk left; they are computed and never read, since every row of these
parts depends on its own row alone. Attention, which reads the history, runs outside.

Outputs are the bucket's buffers, shared by its layers: a layer's q, k, v and hidden states hold
until the same bucket replays the next layer, which is as long as prefill reads them on the
stream the graphs replay on.
"""

from __future__ import annotations

import torch

from ktlong.kv.pinned import collection_paused
from ktlong.models.llama import LlamaModel

BUCKETS = (16, 32, 64)  # chunk sizes captured; a longer chunk runs eagerly


class _Bucket:
    """One size's inputs, outputs and two graphs per layer."""

    def __init__(self, model: LlamaModel, size: int):
        c, device, dtype = model.config, model.device, model.dtype
        self.x = torch.zeros((size, c.hidden_size), dtype=dtype, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.o = torch.zeros((size, c.num_heads, c.head_dim), dtype=dtype, device=device)
        self.q = torch.empty((size, c.num_heads, c.head_dim), dtype=dtype, device=device)
        self.k = torch.empty((size, c.num_kv_heads, c.head_dim), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.out = torch.empty_like(self.x)
        self.before: list[torch.cuda.CUDAGraph] = []  # per layer: up to attention
        self.after: list[torch.cuda.CUDAGraph] = []  # per layer: from attention's output on


class ChunkGraphs:
    def __init__(self, model: LlamaModel):
        assert model.device.type == "cuda" and model.tp is None, "one device, no collectives to capture"
        self.model = model
        self.buckets: dict[int, _Bucket] = {}
        self._current: _Bucket | None = None

    @staticmethod
    def applies(num_tokens: int) -> bool:
        return num_tokens <= BUCKETS[-1]

    def capture(self):
        """Capture every bucket's graphs now (about 0.1 s a bucket on a small model), so that
        no request pays for it."""
        for size in BUCKETS:
            self._bucket(size)

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """model.qkv(layer, x, positions) from the layer's graph: q, k, v views of the bucket's
        outputs."""
        n = x.shape[0]
        bucket = self._current = self._bucket(n)
        bucket.x[:n].copy_(x)
        bucket.positions[:n].copy_(positions)
        bucket.before[layer].replay()
        return bucket.q[:n], bucket.k[:n], bucket.v[:n]

    def residual_block(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """model.residual_block(layer, x, o) for the x the last qkv() took: a view of the
        bucket's output."""
        n, bucket = o.shape[0], self._current
        bucket.o[:n].copy_(o)
        bucket.after[layer].replay()
        return bucket.out[:n]

    def _bucket(self, num_tokens: int) -> _Bucket:
        size = next(b for b in BUCKETS if b >= num_tokens)
        if size not in self.buckets:
            self.buckets[size] = self._captured(size)
        return self.buckets[size]

    @torch.inference_mode()  # as prefill runs: the buffers are inference tensors either way
    def _captured(self, size: int) -> _Bucket:
        model, bucket = self.model, _Bucket(self.model, size)
        layers = range(model.config.num_layers)

        def before(layer):
            q, k, v = model.qkv(layer, bucket.x, bucket.positions)
            bucket.q.copy_(q)
            bucket.k.copy_(k)
            bucket.v.copy_(v)

        def after(layer):
            bucket.out.copy_(model.residual_block(layer, bucket.x, bucket.o))

        device = model.device
        side = torch.cuda.Stream(device)  # a first run off the graphs: cuBLAS handles, Triton compiles
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for layer in layers:
                before(layer)
                after(layer)
        torch.cuda.current_stream(device).wait_stream(side)
        pool = None
        for layer in layers:
            for part, graphs in ((before, bucket.before), (after, bucket.after)):
                graph = torch.cuda.CUDAGraph()
                # thread_local: the commit helper page-locks DRAM on its own thread meanwhile, which
                # in the global mode invalidates the capture (a GPU test failed so at 78182e4)
                with collection_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    part(layer)
                pool = graph.pool()
                graphs.append(graph)
        return bucket
