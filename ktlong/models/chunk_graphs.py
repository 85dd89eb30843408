"""CUDA graphs of a layer's dense work on one full prefill chunk.

A small model's prefill is bound by the host's kernel launches, not by the GPU: per chunk and
layer, q/k/v (norm, three projections, RoPE) and the rest of the layer (output projection,
residual, norm, gate/up/down and the activation) are about fifteen launches, each costing the
host more than the GPU needs to run it. Each layer's two parts are captured once for a chunk of
chunk_size tokens and replayed: two launches instead. Attention stays eager between them (its
page lists change every chunk).

The graphs read their inputs from, and write their outputs to, fixed buffers; every
intermediate lives in one memory pool that all of a model's graphs share, which is safe because
nothing in it outlives the graph that made it and the graphs run one at a time on one stream.
The memory plan counts them (ktlong/kv/memory_plan.graph_bytes).
"""

from __future__ import annotations

import weakref

import torch

from ktlong.models.llama import LlamaModel

_BUILT: "weakref.WeakKeyDictionary[LlamaModel, dict[int, ChunkGraphs]]" = weakref.WeakKeyDictionary()


@torch.inference_mode()
def chunk_graphs(model: LlamaModel, chunk: int) -> "ChunkGraphs":
    """The model's graphs for chunks of `chunk` tokens, captured on first use and kept with the
    model (every prefill engine over it, dense or compact, replays the same ones)."""
    built = _BUILT.setdefault(model, {})
    if chunk not in built:
        built[chunk] = ChunkGraphs(model, chunk)
    return built[chunk]


class ChunkGraphs:
    """qkv() then residual_block() per layer, as LlamaModel's, for exactly `chunk` tokens."""

    def __init__(self, model: LlamaModel, chunk: int):
        assert model.device.type == "cuda" and model.tp is None, "one process on a GPU"
        c, device, dtype = model.config, model.device, model.dtype
        self.model, self.chunk = model, chunk
        self.x = torch.zeros((chunk, c.hidden_size), dtype=dtype, device=device)
        self.positions = torch.arange(chunk, device=device)
        self.o = torch.zeros((chunk, c.num_heads, c.head_dim), dtype=dtype, device=device)
        self.q = torch.empty((chunk, c.num_heads, c.head_dim), dtype=dtype, device=device)
        self.k = torch.empty((chunk, c.num_kv_heads, c.head_dim), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.out = torch.empty_like(self.x)
        self.qkv_graphs: list[torch.cuda.CUDAGraph] = []
        self.rest_graphs: list[torch.cuda.CUDAGraph] = []
        self._capture()

    def _qkv(self, layer: int):
        q, k, v = self.model.qkv(layer, self.x, self.positions)
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)

    def _rest(self, layer: int):
        self.out.copy_(self.model.residual_block(layer, self.x, self.o))

    def _capture(self):
        device = self.model.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: Triton builds, cuBLAS's choices, its workspace
            self._qkv(0)
            self._rest(0)
        torch.cuda.current_stream(device).wait_stream(stream)
        pool = None
        for layer in range(self.model.config.num_layers):
            for part, graphs in ((self._qkv, self.qkv_graphs), (self._rest, self.rest_graphs)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    part(layer)
                pool = graph.pool()
                graphs.append(graph)

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        """LlamaModel.qkv for one chunk. The q, k, v returned are this object's buffers: the next
        call overwrites them (in stream order, after whatever was queued to read them)."""
        self.x.copy_(x)
        self.positions.copy_(positions)
        self.qkv_graphs[layer].replay()
        return self.q, self.k, self.v

    def residual_block(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """LlamaModel.residual_block over the x of the last qkv() and the attention output o; a
        new tensor (a copy stream may still read it after the next chunk's replay)."""
        self.o.copy_(o)
        self.rest_graphs[layer].replay()
        return self.out.clone()
