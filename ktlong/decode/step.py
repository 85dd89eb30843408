"""The device part of a decode step, one body run eagerly or replayed from CUDA graphs
(`use_cuda_graph`), as one model path serves both.

A decode step alternates device work and CPU attention, once per global layer, so it is
written (and, with graphs, captured) as segments that end where the CPU takes over: segment 0 is the embedding and the
layers up to the first global layer's q/k/v and window append; segment j merges the CPU result
of global layer j-1 with its window part, finishes that layer and runs on to the next global
layer; the last segment ends with the logits. A global layer's window attention is a part of its
own, queued after the segment: the host waits only for the segment's copies to host memory (an
event recorded between the two), so the device attends to the window while the CPU selects and
attends to the context blocks. Sliding-window layers
live wholly inside a segment. With `context_attention: gpu` and the host selecting, global layer j
also has a part that reads its selected blocks from DRAM, replayed after the host wrote their rows;
segment j + 1 merges its state too. With the selection on the device as well
(ktlong/decode/device_selection.py), nothing is left for the host between layers: the token is
one body (`_token`: each segment, then its layer's window and context parts), one graph.

Each global layer's q, new K/V (and block scores) leave through host buffers, and the CPU's
result comes back through others (where the device reads the DRAM cache itself, the new K/V go
straight into it: `writes_dram`): pinned and read by the captured copies with graphs, plain
tensors when the segments run eagerly. With graphs, everything that changes from step to
step is read from device memory at replay: the token,
its position, its slot in the window buffer and the valid key range there. Nothing is baked
into the graph as a Python number, so replay cannot freeze a counter (KTransformers' bug with
its step counters). Block selection, and the token_step / layer_step counters that drive it,
run on the host between segments and are never captured; with device block scoring the
segment that ends at a global layer also scores that layer's blocks (ktlong/decode/device_anchors.py).
"""

from __future__ import annotations

import sys

import torch

from ktlong.decode.dram_blocks import DramBlocks
from ktlong.decode.device_anchors import DeviceAnchors
from ktlong.decode.window import DeviceWindow
from ktlong.kv.pinned import PinnedTensors
from ktlong.models.llama import LlamaModel
from operators.kv_quant import quantize_kv
from operators import triton_installed
from operators.merge_state import merge_states
from operators.window_attention import attention_with_lse, masked_window_attention


class DecodeStep:
    def __init__(self, model: LlamaModel, window: DeviceWindow, global_layers: list[int], capture: bool,
                 anchors: DeviceAnchors | None = None, dram_blocks: DramBlocks | None = None):
        """capture: replay the segments from CUDA graphs; otherwise run them eagerly.
        anchors: score every block of each global layer right after its q (`block_scoring`).
        dram_blocks: attend each global layer's selected blocks where they lie in DRAM (`_dram_part`, a
        part of its own between segment j and j + 1)."""
        self.model, self.window, self.capturing, self.anchors = model, window, capture, anchors
        self.dram_blocks = dram_blocks
        # the device selects too (ktlong/decode/device_selection.py): a token is one body, `_token`
        self.device_selects = dram_blocks is not None and dram_blocks.selection is not None
        self.global_layers = global_layers
        c, layout, dev = model.config, window.layout, model.device
        self.append_kernel = None  # operators/decode_append_kernel.py where it applies
        self.window_kernel = None  # operators/window_attention_kernel.py, for the captured (masked) window
        if dev.type == "cuda" and triton_installed():
            from operators.decode_append_kernel import append_token, kernel_applies
            from operators import window_attention_kernel

            self.append_kernel = append_token if kernel_applies(layout.kv_type, c.head_dim) else None
            if window_attention_kernel.kernel_applies(layout.dtype, c.head_dim):
                self.window_kernel = window_attention_kernel.window_attention
        self.num_layers = c.num_layers
        # with the device selecting on a GPU, a global layer's window part runs on this second
        # stream, beside its selection and its DRAM reads, which need only the same q (`_token`)
        self.beside = torch.cuda.Stream(dev) if self.device_selects and dev.type == "cuda" else None
        # inputs, written before each replay
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.zero = torch.zeros(1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # buffer index of the new token
        self.lo = torch.zeros((), dtype=torch.long, device=dev)  # valid keys: lo..hi-1
        self.hi = torch.zeros((), dtype=torch.long, device=dev)
        self.valid = (0, 0)  # the same range as numbers, for eager runs
        n = len(global_layers)
        # the exchange with the CPU part of each global layer, in host memory that the captured
        # copies read and write at replay (pinned), so a layer costs one sync and no copy calls
        self._pinned = PinnedTensors(dev.type == "cuda")
        self.q_host = self._host((n, c.num_heads, c.head_dim), torch.float32)
        # k, v of the new token as DRAM stores them (q8_0 / q4_0: quantised here, on the device):
        # where the device reads the DRAM cache, the append kernel writes them there itself
        # (`writes_dram`); otherwise into these rows, which the host writes through
        self.writes_dram = self.append_kernel is not None and dram_blocks is not None
        row, groups = layout.stored_row
        self.kv_host = None if self.writes_dram else self._host((n, 2, c.num_kv_heads, row), layout.stored_dtype)
        self.kv_scales_host = None if self.writes_dram else self._host((n, 2, c.num_kv_heads, groups), torch.int16)
        self.stored_rows = [self._stored_rows(j) for j in range(n)] if self.append_kernel is not None else []
        self.o_host = self._host((n, c.num_heads, c.head_dim), torch.float32)
        self.lse_host = self._host((n, c.num_heads), torch.float32)
        self.scores_host = self._host((n, anchors.num_rows, anchors.num_blocks), torch.float32) if anchors else None
        # device state between segments
        self.o_cpu = torch.zeros((n, c.num_heads, c.head_dim), device=dev)
        self.lse_cpu = torch.full((n, c.num_heads), float("-inf"), device=dev)
        self.x = torch.zeros((1, c.hidden_size), dtype=model.dtype, device=dev)
        self.o_dev = torch.zeros((n, c.num_heads, c.head_dim), device=dev)
        self.lse_dev = torch.zeros((n, c.num_heads), device=dev)
        # q of each global layer, for its window part (and its selected blocks)
        self.q_dev = torch.zeros((n, c.num_heads, c.head_dim), dtype=model.dtype, device=dev)
        if dram_blocks is not None:  # the state of each global layer's selected blocks
            self.o_hit = torch.zeros((n, c.num_heads, c.head_dim), device=dev)
            self.lse_hit = torch.full((n, c.num_heads), float("-inf"), device=dev)
        self.dram_graphs: list[torch.cuda.CUDAGraph] = []
        self.window_graphs: list[torch.cuda.CUDAGraph] = []
        # recorded after each segment's copies to host memory: what the host waits for
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.logits = torch.zeros(c.vocab_size, device=dev)
        self.rope = None  # the step's cos and sin (segment 0 computes them; later segments read them)
        self.q_now = None  # with the device selecting: the q of the global layer the last segment ended at
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.replays = 0

    def _host(self, shape, dtype) -> torch.Tensor:
        return self._pinned.pin(torch.zeros(shape, dtype=dtype))

    def _stored_rows(self, j: int):
        """Where the append kernel puts global layer j's new K/V: its DRAM tables at the token's
        position, or the exchange rows (one row, position 0)."""
        from operators.decode_append_kernel import StoredRows

        if self.writes_dram:
            return StoredRows(*self.dram_blocks.token_rows(j), self.position)
        quant = self.window.layout.is_quantized
        kv, scales = self.kv_host[j][:, :, None], self.kv_scales_host[j][:, :, None]  # [2, KV, 1, R]
        return StoredRows(kv[0], kv[1], scales[0] if quant else None, scales[1] if quant else None, self.zero)

    # ---- the device work, as captured ----------------------------------------------------
    def _segment(self, j: int):
        """Segment j: finish global layer j-1 (if any), run to global layer j's attention (or
        to the logits after the last global layer)."""
        model, g = self.model, self.global_layers
        if j == 0:
            self.x.copy_(model.embed(self.token))
            self.rope = model.rope_tables(self.position)  # every layer's cos and sin, once a token
            start = 0
        else:
            layer = g[j - 1]
            if self.device_selects:  # the device attended to the window and every selected block: one state
                o = self.o_hit[j - 1]
            else:
                self.o_cpu[j - 1].copy_(self.o_host[j - 1], non_blocking=True)  # written by the host before replay
                self.lse_cpu[j - 1].copy_(self.lse_host[j - 1], non_blocking=True)
                o, lse = merge_states(self.o_dev[j - 1], self.lse_dev[j - 1], self.o_cpu[j - 1], self.lse_cpu[j - 1])
                if self.dram_blocks is not None:
                    o, _ = merge_states(o, lse, self.o_hit[j - 1], self.lse_hit[j - 1])
            self._finish(layer, o)
            start = layer + 1
        stop = g[j] if j < len(g) else self.num_layers
        for layer in range(start, stop):  # sliding-window layers: all on the device
            q = self._append(layer)
            o, _ = self._window_attention(layer, q, model.config.sliding_window)
            self._finish(layer, o)
        if j < len(g):
            q = self._append(g[j], j)
            if self.anchors is not None and not self.device_selects:
                self.scores_host[j].copy_(self.anchors.scores(g[j], q), non_blocking=True)
            if self.device_selects:  # the token's own body reads it next (_token)
                self.q_now = q
            else:  # the window's and the DRAM blocks' parts read it, captured apart
                self.q_dev[j].copy_(q)
        else:
            self.logits.copy_(model.logits(self.x)[0])

    def _window(self, j: int):
        """Global layer j's window part: its q over its sinks and window -> o_dev, lse_dev."""
        o, lse = self._window_attention(self.global_layers[j], self.q_dev[j])
        self.o_dev[j].copy_(o)
        self.lse_dev[j].copy_(lse)

    def _token(self):
        """A whole token when the device selects: every segment with its layer's window and
        context parts, no host work in between; then the selection's counts to the host."""
        for j in range(len(self.global_layers) + 1):
            self._segment(j)
            if j < len(self.global_layers):  # the window's state merged into the selected blocks'
                window = self._window_beside(self.global_layers[j], self.q_now)
                self.dram_blocks.attend(j, self.q_now, base=window, out=self.o_hit[j])
        self.dram_blocks.selection.report()

    def _window_beside(self, layer: int, q: torch.Tensor):
        """The layer's window part, queued on the second stream when there is one (it then
        overlaps the selection's kernels and the DRAM reads, which wait on PCIe more than they
        use the SMs) -> its state, or a function that joins the streams and returns it, for the
        merge to call when it needs it. The state's memory comes from the second stream's pool
        and is read by the main one before the next layer's window is queued there: the next q
        depends on this merge."""
        if self.beside is None:
            return self._window_attention(layer, q)
        main = torch.cuda.current_stream(q.device)
        self.beside.wait_stream(main)
        with torch.cuda.stream(self.beside):
            state = self._window_attention(layer, q)

        def joined():
            main.wait_stream(self.beside)
            return state
        return joined

    def _dram_part(self, j: int):
        """Global layer j's selected blocks, read from DRAM."""
        _, lse = self.dram_blocks.attend(j, self.q_dev[j], out=self.o_hit[j])
        self.lse_hit[j].copy_(lse)

    def _append(self, layer: int, j: int | None = None) -> torch.Tensor:
        q, k, v = self.model.qkv(layer, self.x, self.position, self.rope)
        dtype = self.window.layout.dtype
        keys, values = self.window.layer_buffers(layer)
        if j is not None and not self.device_selects:  # a global layer's q goes to the host, unless the device selects
            self.q_host[j].copy_(q[0].float(), non_blocking=True)
        if self.append_kernel is not None:  # one kernel: the window's rows and, for a global layer, the stored ones
            self.append_kernel(k[0], v[0], self.slot, keys, values, None if j is None else self.stored_rows[j])
            return q[0]
        keys.index_copy_(1, self.slot, k[0].to(dtype)[:, None])
        values.index_copy_(1, self.slot, v[0].to(dtype)[:, None])
        if j is not None:  # a global layer: k/v through to DRAM
            kv = torch.stack([k[0], v[0]]).to(dtype)  # [2, KV, D]
            if self.window.layout.is_quantized:
                data, scales = quantize_kv(kv, self.window.layout.kv_type)
                self.kv_host[j].copy_(data, non_blocking=True)
                self.kv_scales_host[j].copy_(scales, non_blocking=True)
            else:
                self.kv_host[j].copy_(kv, non_blocking=True)
        return q[0]

    def _window_attention(self, layer: int, q: torch.Tensor, last: int = 0):
        """q [H, D] over the layer's sinks and window (its `last` keys only, when given) -> out
        [H, D], lse [H] float32. Captured: the whole buffer with the invalid keys masked, fixed
        shapes read from device memory; eager: the valid keys only."""
        keys, values = self.window.layer_buffers(layer)
        if self.capturing and self.window_kernel is not None:
            return self.window_kernel(q, keys, values, self.lo, self.hi, self.model.scale, last)
        if self.capturing:
            lo = torch.maximum(self.lo, self.hi - last) if last else self.lo
            return masked_window_attention(q, keys, values, lo, self.hi, self.model.scale)
        lo, hi = self.valid
        lo = max(lo, hi - last) if last else lo
        return attention_with_lse(q, keys[:, lo:hi], values[:, lo:hi], self.model.scale)

    def _finish(self, layer: int, o: torch.Tensor):
        self.model.residual_block(layer, self.x, o[None], out=self.x)

    # ---- capture and replay -------------------------------------------------------------
    def capture(self):
        """Capture every segment. The inputs must hold the current step (warm-up runs execute
        it; replaying the same step again is idempotent)."""
        if self.device_selects:
            self._capture_token()
            return
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for j in range(len(self.global_layers) + 1):  # warm-up: allocations, kernel choice
                self._segment(j)
                if j < len(self.global_layers):
                    self._window(j)
                    if self.dram_blocks is not None:
                        self._dram_part(j)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        pool = None
        try:
            for j in range(len(self.global_layers) + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._segment(j)
                pool = graph.pool()
                self.graphs.append(graph)
                if j < len(self.global_layers):
                    self.window_graphs.append(self._capture_part(self._window, j, pool))
                    if self.dram_blocks is not None:
                        self.dram_graphs.append(self._capture_part(self._dram_part, j, pool))
        except RuntimeError as e:  # e.g. a collective of tensor parallelism this build cannot capture
            self.graphs, self.window_graphs, self.dram_graphs, self.capturing = [], [], [], False
            torch.cuda.synchronize(self.model.device)
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            print(f"[CUDA graphs could not be captured ({reason}); decode runs eagerly]", file=sys.stderr)

    def _capture_token(self):
        """One graph for the whole token (after a warm-up run of it)."""
        device = self.model.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._token()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._token()
        self.graphs = [graph]

    def forget_graphs(self):
        """Drop the captured graphs (they hold addresses that changed); the next step captures again."""
        self.graphs, self.window_graphs, self.dram_graphs = [], [], []

    @staticmethod
    def _capture_part(part, j: int, pool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            part(j)
        return graph

    def set_step(self, token_id: int, position: int):
        w = self.window
        self.token.fill_(token_id)
        self.position.fill_(position)
        index = w.sink_tokens + position - w.window_start
        self.slot.fill_(index)
        self.valid = (0 if w.window_start else w.sink_tokens, index + 1)
        if self.capturing:
            self.lo.fill_(self.valid[0])
            self.hi.fill_(self.valid[1])

    @property
    def ready(self) -> bool:
        return bool(self.graphs) or not self.capturing

    def wait(self):
        """Until the last segment's copies to host memory are done (its window part may still run)."""
        if self.copied is not None:
            self.copied.synchronize()

    def replay_dram_blocks(self, j: int):
        """The device's part over global layer j's selected blocks. It reads the rows the host
        wrote just before; the host writes them again only at the next step, after waiting for
        this step's segments."""
        if self.capturing:
            self.dram_graphs[j].replay()
        else:
            self._dram_part(j)

    def replay_token(self):
        """The whole token when the device selects; the host waits for it (`wait`) once."""
        if self.capturing:
            self.graphs[0].replay()
        else:
            self._token()
        if self.copied is not None:
            self.copied.record()
        self.replays += 1

    def replay(self, j: int):
        """Segment j, then (before the logits) global layer j's window part, with the event the
        host waits for between them."""
        window = j < len(self.global_layers)
        if self.capturing:
            self.graphs[j].replay()
        else:
            self._segment(j)
        if self.copied is not None:
            self.copied.record()
        if window and self.capturing:
            self.window_graphs[j].replay()
        elif window:
            self._window(j)
        self.replays += 1
