"""CUDA-graph replay of the device part of a hybrid decode step (`use_cuda_graph`).

A decode step alternates device work and CPU attention, once per global layer, so it is
captured as segments that end where the CPU takes over: segment 0 is the embedding and the
layers up to the first global layer's q/k/v, window append and window attention; segment j
merges the CPU result of global layer j-1 with its window part, finishes that layer and runs
on to the next global layer; the last segment ends with the logits. Sliding-window layers
live wholly inside a segment.

Everything that changes from step to step is read from device memory at replay: the token,
its position, its slot in the window buffer and the valid key range there. Nothing is baked
into the graph as a Python number, so replay cannot freeze a counter (KTransformers' bug with
its step counters). Block selection, and the token_step / layer_step counters that drive it,
run on the host between segments and are never captured; with device block scoring the
segment that ends at a global layer also scores that layer's blocks (ktlong/decode/device_anchors.py).
"""

from __future__ import annotations

import torch

from ktlong.decode.device_anchors import DeviceAnchors
from ktlong.decode.window import DeviceWindow
from ktlong.kv.pinned import PinnedTensors
from ktlong.models.llama import LlamaModel
from operators.merge_state import merge_states


def masked_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
                            hi: torch.Tensor, scale: float):
    """q: [H, D]; k, v: [KV, N, D], a whole window buffer of which keys lo..hi-1 are valid (lo,
    hi: 0-dim device tensors) -> out [H, D] float32, lse [H] float32. Fixed shapes, no sync."""
    num_heads, dim = q.shape
    num_kv, n, _ = k.shape
    group = num_heads // num_kv
    scores = torch.bmm(q.to(k.dtype).view(num_kv, group, dim), k.transpose(1, 2)).float() * scale
    index = torch.arange(n, device=q.device)
    scores = scores.masked_fill(((index < lo) | (index >= hi))[None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse[..., None]).to(v.dtype), v).float()
    return out.reshape(num_heads, dim), lse.reshape(num_heads)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, window: DeviceWindow, global_layers: list[int], capture: bool = True,
                 anchors: DeviceAnchors | None = None):
        """capture=False runs the same segments eagerly (the CPU tests check the segmentation).
        anchors: score every block of each global layer right after its q (`block_scoring`)."""
        self.model, self.window, self.capturing, self.anchors = model, window, capture, anchors
        self.global_layers = global_layers
        c, layout, dev = model.config, window.layout, model.device
        self.num_layers = c.num_layers
        # inputs, written before each replay
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # buffer index of the new token
        self.lo = torch.zeros((), dtype=torch.long, device=dev)  # valid keys: lo..hi-1
        self.hi = torch.zeros((), dtype=torch.long, device=dev)
        n = len(global_layers)
        # the exchange with the CPU part of each global layer, in host memory that the captured
        # copies read and write at replay (pinned), so a layer costs one sync and no copy calls
        self._pinned = PinnedTensors()
        self.q_host = self._host((n, c.num_heads, c.head_dim), torch.float32)
        self.kv_host = self._host((n, 2, c.num_kv_heads, c.head_dim), layout.dtype)  # k, v of the new token
        self.o_host = self._host((n, c.num_heads, c.head_dim), torch.float32)
        self.lse_host = self._host((n, c.num_heads), torch.float32)
        self.scores_host = self._host((n, anchors.num_rows, anchors.num_blocks), torch.float32) if anchors else None
        # device state between segments
        self.o_cpu = torch.zeros((n, c.num_heads, c.head_dim), device=dev)
        self.lse_cpu = torch.full((n, c.num_heads), float("-inf"), device=dev)
        self.x = torch.zeros((1, c.hidden_size), dtype=model.dtype, device=dev)
        self.o_dev = torch.zeros((n, c.num_heads, c.head_dim), device=dev)
        self.lse_dev = torch.zeros((n, c.num_heads), device=dev)
        self.logits = torch.zeros(c.vocab_size, device=dev)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.replays = 0

    def _host(self, shape, dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        return self._pinned.pin(t) if self.capturing else t

    # ---- the device work, as captured ----------------------------------------------------
    def _segment(self, j: int):
        """Segment j: finish global layer j-1 (if any), run to global layer j's attention (or
        to the logits after the last global layer)."""
        model, g = self.model, self.global_layers
        if j == 0:
            self.x.copy_(model.embed(self.token))
            start = 0
        else:
            layer = g[j - 1]
            self.o_cpu[j - 1].copy_(self.o_host[j - 1], non_blocking=True)  # written by the host before replay
            self.lse_cpu[j - 1].copy_(self.lse_host[j - 1], non_blocking=True)
            o, _ = merge_states(self.o_dev[j - 1], self.lse_dev[j - 1], self.o_cpu[j - 1], self.lse_cpu[j - 1])
            self._finish(layer, o)
            start = layer + 1
        stop = g[j] if j < len(g) else self.num_layers
        for layer in range(start, stop):  # sliding-window layers: all on the device
            q = self._append(layer)
            w = model.config.sliding_window
            o, _ = masked_window_attention(q, *self.window.layer_buffers(layer),
                                           torch.maximum(self.lo, self.hi - w), self.hi, model.scale)
            self._finish(layer, o)
        if j < len(g):
            q = self._append(g[j], j)
            if self.anchors is not None:
                self.scores_host[j].copy_(self.anchors.scores(g[j], q), non_blocking=True)
            o, lse = masked_window_attention(q, *self.window.layer_buffers(g[j]), self.lo, self.hi, model.scale)
            self.o_dev[j].copy_(o)
            self.lse_dev[j].copy_(lse)
        else:
            self.logits.copy_(model.logits(self.x)[0])

    def _append(self, layer: int, j: int | None = None) -> torch.Tensor:
        q, k, v = self.model.qkv(layer, self.x, self.position)
        dtype = self.window.layout.dtype
        keys, values = self.window.layer_buffers(layer)
        keys.index_copy_(1, self.slot, k[0].to(dtype)[:, None])
        values.index_copy_(1, self.slot, v[0].to(dtype)[:, None])
        if j is not None:  # a global layer: q goes to the CPU, k/v through to DRAM
            self.q_host[j].copy_(q[0].float(), non_blocking=True)
            self.kv_host[j, 0].copy_(k[0].to(dtype), non_blocking=True)
            self.kv_host[j, 1].copy_(v[0].to(dtype), non_blocking=True)
        return q[0]

    def _finish(self, layer: int, o: torch.Tensor):
        model = self.model
        x = self.x + model.attention_output(layer, o[None].to(self.x.dtype))
        self.x.copy_(x + model.mlp(layer, x))

    # ---- capture and replay -------------------------------------------------------------
    def capture(self):
        """Capture every segment. The inputs must hold the current step (warm-up runs execute
        it; replaying the same step again is idempotent)."""
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for j in range(len(self.global_layers) + 1):  # warm-up: allocations, kernel choice
                self._segment(j)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        pool = None
        for j in range(len(self.global_layers) + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._segment(j)
            pool = graph.pool()
            self.graphs.append(graph)

    def set_step(self, token_id: int, position: int):
        w = self.window
        self.token.fill_(token_id)
        self.position.fill_(position)
        index = w.sink_tokens + position - w.window_start
        self.slot.fill_(index)
        self.lo.fill_(0 if w.window_start else w.sink_tokens)
        self.hi.fill_(index + 1)

    @property
    def ready(self) -> bool:
        return bool(self.graphs) or not self.capturing

    def wait(self):
        """Until the last replayed segment, and its copies to host memory, are done."""
        if self.capturing:
            torch.cuda.current_stream(self.model.device).synchronize()

    def replay(self, j: int):
        if self.capturing:
            self.graphs[j].replay()
        else:
            self._segment(j)
        self.replays += 1
