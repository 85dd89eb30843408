"""The device part of a decode step, one body run eagerly or replayed from CUDA graphs
(`use_cuda_graph`), as one model path serves both. The body is batch-first: it steps every
sequence of a batch (ktlong/decode/batch.py) together, one row each through the weights' products,
while each sequence's attention reads its own window, anchors and DRAM blocks; one sequence is a
batch of one. With graphs, a body is captured for its members; where the device selects, every
part finds a member's tensors through the kernels' tables (operators/member_tables.py), so the
body and its graphs serve as many other members after `rebind`.

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

import contextlib
import sys

import torch

from ktlong.decode.dram_blocks import DramBlocks, attend
from ktlong.decode.device_anchors import DeviceAnchors
from ktlong.decode.window import DeviceWindow
from ktlong.errors import first_line
from ktlong.kv.pinned import PinnedTensors, collection_paused
from ktlong.models.llama import LlamaModel
from operators.kv_quant import quantize_kv
from operators.member_tables import Bases, MemberTables
from operators import triton_installed
from operators.merge_state import merge_states
from operators.window_attention import attention_with_lse, masked_window_attention


class DecodeStep:
    def __init__(self, model: LlamaModel, sequences: list, capture: bool):
        """sequences: the decoders stepped together (ktlong/decode/decoder.py), the batch's rows
        in order; the body keeps their device parts (window, anchors, DRAM reads), not them.
        capture: replay the segments from CUDA graphs; otherwise run them eagerly. A sequence's
        anchors score every block of each global layer right after its q (`block_scoring`); its
        DRAM reads attend each global layer's selected blocks where they lie in DRAM
        (`_dram_part`, a part of its own between segment j and j + 1)."""
        first = sequences[0]
        parts = lambda s: (s.layout, s.device_anchors is None, s.dram_blocks is None, s.selection is None)  # noqa: E731
        assert all(parts(s) == parts(first) for s in sequences), "one batch: one KV layout, one selection plan"
        self.model, self.capturing = model, capture
        self.windows: list[DeviceWindow] = [s.window for s in sequences]
        self.anchors: list[DeviceAnchors | None] = [s.device_anchors for s in sequences]
        self.dram: list[DramBlocks | None] = [s.dram_blocks for s in sequences]
        self.scores_blocks = first.device_anchors is not None
        self.reads_dram = first.dram_blocks is not None
        # the device selects too (ktlong/decode/device_selection.py): a token is one body, `_token`
        self.device_selects = self.reads_dram and first.dram_blocks.selection is not None
        self.roles = first.dram_blocks.selection.role if self.device_selects else None  # each global layer's
        self.global_layers = global_layers = first.global_layers
        c, layout, dev = model.config, first.layout, model.device
        self.layout = layout
        B = self.batch = len(sequences)
        self.append_kernel = None  # operators/decode_append_kernel.py where it applies
        self.window_kernel = None  # operators/window_attention_kernel.py, for the captured (masked) window
        if dev.type == "cuda" and triton_installed():
            from operators.decode_append_kernel import append_token, kernel_applies
            from operators import window_attention_kernel

            self.append_kernel = append_token if kernel_applies(layout.kv_type, c.head_dim) else None
            if window_attention_kernel.kernel_applies(layout.dtype, c.head_dim):
                self.window_kernel = window_attention_kernel.window_attention
        self.num_layers = c.num_layers
        # the body's own tensors that the kernels' offsets count from, whoever the members are
        self.bases = Bases()
        # where the kernels find each sequence's window buffers: per layer, its offsets (one launch
        # for the batch) from the body's base of the buffers' dtype (window_at)
        self.window_at: tuple | None = None
        self.window_members = None  # [layers, B, 2]
        # with the device selecting on a GPU, a global layer's window parts run on a stream of their
        # own (one launch for the batch; else each sequence's on one of its own), beside the
        # selections and the DRAM reads, which need only the same q (`_token`); where the
        # selection's kernels do not apply, the sequences' selections run side by side, one stream
        # each (`lanes`: device_selection.select_batch). A window part is three small kernels, 33
        # us at 8B shapes on the H200: eight one after another were 8 ms of a step at batch 8.
        # (at the priority of the stream the steps are queued on: ktlong/session/sliced_prefill.decode_first)
        streams = self.device_selects and dev.type == "cuda"
        priority = torch.cuda.current_stream(dev).priority if streams else 0
        self.beside = [torch.cuda.Stream(dev, priority=priority) for _ in range(1 if self._one_launch else B)
                       ] if streams else []
        self.lanes = [torch.cuda.Stream(dev, priority=priority) for _ in range(B)] if streams and B > 1 else []
        # inputs, one row per sequence, written before each replay
        self.token = torch.zeros(B, dtype=torch.long, device=dev)
        self.position = torch.zeros(B, dtype=torch.long, device=dev)
        self.zeros = torch.zeros(B, dtype=torch.long, device=dev)  # the exchange rows' position, every sequence's
        self.slot = torch.zeros(B, dtype=torch.long, device=dev)  # buffer index of each new token
        self.lo = torch.zeros(B, dtype=torch.long, device=dev)  # valid keys of sequence b: lo[b]..hi[b]-1
        self.hi = torch.zeros(B, dtype=torch.long, device=dev)
        self.valid = [(0, 0)] * B  # the same ranges as numbers, for eager runs
        n = len(global_layers)
        # the exchange with the CPU part of each global layer, in host memory that the captured
        # copies read and write at replay (pinned), so a layer costs one sync and no copy calls;
        # [global layer, sequence, ...]: a layer's copy of every sequence's rows is one contiguous
        # block (a captured copy to or from pinned memory must be: a strided one goes through a
        # host-side step that replay would skip)
        self._pinned = PinnedTensors(dev.type == "cuda")
        self.q_host = self._host((n, B, c.num_heads, c.head_dim), torch.float32)
        # k, v of the new token as DRAM stores them (q8_0 / q4_0: quantised here, on the device):
        # where the device reads the DRAM cache, the append kernel writes them there itself
        # (`writes_dram`); otherwise into these rows, which the host writes through
        self.writes_dram = self.append_kernel is not None and self.reads_dram
        row, groups = layout.stored_row
        self.kv_host = None if self.writes_dram else self._host((B, n, 2, c.num_kv_heads, row), layout.stored_dtype)
        self.kv_scales_host = None if self.writes_dram else self._host((B, n, 2, c.num_kv_heads, groups), torch.int16)
        # the stored rows of each global layer as the append kernel finds them: the body's bases
        # (stored_at), each member's offsets from them (stored_rows)
        self.stored_at: list[tuple] = []
        self.stored_rows: list[tuple] = []
        self._bind_members()
        self.o_host = self._host((n, B, c.num_heads, c.head_dim), torch.float32)
        self.lse_host = self._host((n, B, c.num_heads), torch.float32)
        if self.scores_blocks:  # per sequence [global layer, rows, the blocks it can reach]
            self.scores_host = [self._host((n, a.num_rows, a.num_blocks), torch.float32) for a in self.anchors]
        # device state between segments
        self.o_cpu = torch.zeros((n, B, c.num_heads, c.head_dim), device=dev)
        self.lse_cpu = torch.full((n, B, c.num_heads), float("-inf"), device=dev)
        self.x = torch.zeros((B, c.hidden_size), dtype=model.dtype, device=dev)
        self.o_dev = torch.zeros((n, B, c.num_heads, c.head_dim), device=dev)
        self.lse_dev = torch.zeros((n, B, c.num_heads), device=dev)
        # q of each global layer, for its window part (and its selected blocks)
        self.q_dev = torch.zeros((n, B, c.num_heads, c.head_dim), dtype=model.dtype, device=dev)
        if self.reads_dram:  # the state of each global layer's selected blocks
            self.o_hit = torch.zeros((n, B, c.num_heads, c.head_dim), device=dev)
            self.lse_hit = torch.full((n, B, c.num_heads), float("-inf"), device=dev)
        self.dram_graphs: list[torch.cuda.CUDAGraph] = []
        self.window_graphs: list[torch.cuda.CUDAGraph] = []
        # recorded after each segment's copies to host memory: what the host waits for
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.logits = torch.zeros((B, c.vocab_size), device=dev)
        self.rope = None  # the step's cos and sin (segment 0 computes them; later segments read them)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._captured_near: list = []  # the DRAM reads' device copies the graphs hold addresses of
        # the kernels' tables of where each sequence's tensors lie (operators/member_tables.py)
        self.tables = MemberTables(self.bases)
        self.rebound = False  # members changed since the last step: its next token runs eagerly, rewriting the tables
        if self.device_selects:  # what each sequence's step read, gathered for the host (one launch each)
            first_dram = first.dram_blocks
            self.selected_dev = torch.zeros((B, n * c.num_kv_heads), dtype=torch.int64, device=dev)
            self.selected_host = self._host((B, n, c.num_kv_heads), torch.int64)
            self.kept_dev = None if first_dram.plans is None else torch.zeros(B, dtype=torch.int64, device=dev)
            self.kept_host = self._host((B,), torch.int64)
        self.replays = 0

    def _host(self, shape, dtype) -> torch.Tensor:
        return self._pinned.pin(torch.zeros(shape, dtype=dtype))

    def _stored_rows(self, j: int) -> list:
        """Where the append kernel puts every sequence's new K/V of global layer j: each one's
        StoredRows, its DRAM tables at its token's position, or its exchange rows (one row,
        position 0)."""
        from operators.decode_append_kernel import StoredRows

        if self.writes_dram:
            return [StoredRows(*dram.token_rows(j), self.position) for dram in self.dram]
        quant = self.layout.is_quantized
        rows = []
        for b in range(self.batch):
            kv, scales = self.kv_host[b, j][:, :, None], self.kv_scales_host[b, j][:, :, None]  # [2, KV, 1, R]
            rows.append(StoredRows(kv[0], kv[1], scales[0] if quant else None, scales[1] if quant else None,
                                   self.zeros))
        return rows

    def _bind_members(self):
        """The window kernels' and the append kernel's tables of the current members, counted
        from the body's bases; written in place when the tables exist, so the graphs that read
        them serve the new members."""
        from operators.decode_append_kernel import stored_offsets
        from operators.window_attention_kernel import member_offsets

        device = self.model.device
        if self.append_kernel is not None or self.window_kernel is not None:
            base = self.bases.like(self.windows[0].layer_buffers(0)[0])
            self.window_at = (base, base)
            tables = []
            for layer in range(self.num_layers):
                buffers = [w.layer_buffers(layer) for w in self.windows]
                tables.append(member_offsets([k for k, _ in buffers], [v for _, v in buffers], self.window_at))
            self.window_members = _rewritten(self.window_members, torch.stack(tables))
        if self.append_kernel is None:
            return
        for j in range(len(self.global_layers)):
            rows = self._stored_rows(j)
            if len(self.stored_at) <= j:
                self.stored_at.append(tuple(None if t is None else self.bases.like(t) for t in rows[0][:4]))
                self.stored_rows.append(None)
            table = stored_offsets(rows, device, self.stored_at[j])
            # the first member's rows stand for the layout (shapes, strides) the launch checks
            self.stored_rows[j] = (rows[0], _rewritten(None if self.stored_rows[j] is None else self.stored_rows[j][1],
                                                       table))

    def rebindable(self, sequences: list) -> bool:
        """Whether this body can step these members in place of its own: as many, with one KV
        layout and selection plan, the device selecting. Run eagerly, every step finds its
        members anew; with graphs, every part they run must find a member's tensors through the
        tables: the append and window kernels, the selection's batch kernels at every global
        layer, which scores its own blocks, and no bench drift."""
        if len(sequences) != self.batch or not self.device_selects:
            return False

        def fits(s) -> bool:
            selection = s.dram_blocks.selection if s.dram_blocks is not None else None
            if s.layout != self.layout or s.global_layers != self.global_layers or selection is None:
                return False
            if selection.role != self.roles:
                return False
            return not self.capturing or (self.append_kernel is not None and self._one_launch and selection.kernel
                                          and selection.adjust is None and all(r == "score" for r in selection.role))
        return all(fits(s) for s in sequences)

    def rebind(self, sequences: list):
        """Step these members from now on (rebindable): the tables that the body makes once are
        rewritten now, the others by the next token, which runs eagerly; the graphs stay, unless
        that token finds a part they baked in changed (MemberTables.matches)."""
        assert self.rebindable(sequences)
        self.windows = [s.window for s in sequences]
        self.anchors = [s.device_anchors for s in sequences]
        self.dram = [s.dram_blocks for s in sequences]
        self._bind_members()
        self._captured_near = self._near_addresses()  # the rebound token writes their copies' places too
        self.rebound = True

    def release(self):
        """Let the members go (the body keeps its tables, not their tensors) until `rebind`
        names the next ones."""
        self.windows, self.anchors, self.dram = [], [], []
        self.stored_rows = [(None, table) for _, table in self.stored_rows]

    # ---- the device work, as captured ----------------------------------------------------
    def _segment(self, j: int):
        """Segment j: finish global layer j-1 (if any), run to global layer j's attention (or
        to the logits after the last global layer), every sequence of the batch at once."""
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
                if self.reads_dram:
                    o, _ = merge_states(o, lse, self.o_hit[j - 1], self.lse_hit[j - 1])
            self._finish(layer, o)
            start = layer + 1
        stop = g[j] if j < len(g) else self.num_layers
        for layer in range(start, stop):  # sliding-window layers: all on the device
            q = self._append(layer)
            o, _ = self._windows(layer, q, model.config.sliding_window)
            self._finish(layer, o)
        if j < len(g):
            q = self._append(g[j], j)
            if self.scores_blocks and not self.device_selects:
                for b, anchors in enumerate(self.anchors):
                    self.scores_host[b][j].copy_(anchors.scores(g[j], q[b]), non_blocking=True)
            self.q_dev[j].copy_(q)  # the window's and the DRAM blocks' parts read it (captured apart, or next in _token)
        else:
            self.logits.copy_(model.logits(self.x, decoding=True))

    def _window(self, j: int, streams: list = ()):
        """Global layer j's window part: each sequence's q over its sinks and window -> o_dev, lse_dev;
        one launch for the batch where the kernel runs (on streams[0] when given), otherwise
        sequence b's on streams[b % len(streams)] when given."""
        layer = self.global_layers[j]
        if self._one_launch:
            with torch.cuda.stream(streams[0]) if streams else contextlib.nullcontext():
                self._windows(layer, self.q_dev[j], out=(self.o_dev[j], self.lse_dev[j]))
            return
        for b in range(self.batch):
            with torch.cuda.stream(streams[b % len(streams)]) if streams else contextlib.nullcontext():
                self._window_attention(b, layer, self.q_dev[j, b], out=(self.o_dev[j, b], self.lse_dev[j, b]))

    @property
    def _one_launch(self) -> bool:
        """The window parts run as one kernel launch for the batch (captured, where the kernel applies)."""
        return self.capturing and self.window_kernel is not None

    def _windows(self, layer: int, q: torch.Tensor, last: int = 0, out: tuple | None = None):
        """Every sequence's q [B, H, D] over its sinks and window (its `last` keys only, when
        given) -> (o [B, H, D], lse [B, H]) float32, into `out` when given: one launch for the
        batch where the kernel runs, otherwise sequence by sequence."""
        if self._one_launch:
            keys, values = self.windows[0].layer_buffers(layer)
            return self.window_kernel(q, keys, values, self.window_members[layer], self.lo, self.hi, self.model.scale,
                                      last, *(out or (None, None)), at=self.window_at)
        states = [self._window_attention(b, layer, q[b], last, None if out is None else (out[0][b], out[1][b]))
                  for b in range(self.batch)]
        return out or (torch.stack([o for o, _ in states]), torch.stack([lse for _, lse in states]))

    def _token(self):
        """A whole token when the device selects: every segment with its layer's window and
        context parts, no host work in between; then the selections' counts to the host."""
        from operators.member_gather_kernel import gather_members, kept_reads

        for j in range(len(self.global_layers) + 1):
            self._segment(j)
            if j < len(self.global_layers):  # the windows' states merged into the selected blocks'
                attend(self.dram, j, self.q_dev[j], self.tables, base=self._windows_beside(j), out=self.o_hit[j],
                       lanes=self.lanes)
        # what each read: its tokens per global layer and kv head, and the (kv head, block) pairs
        # read from kept slots (its own, or a conversation's sharing its document that read it)
        gather_members([d.selection.valid for d in self.dram], self.selected_dev, self.tables)
        self.selected_host.view(self.batch, -1).copy_(self.selected_dev, non_blocking=True)
        if self.kept_dev is not None:
            kept_reads([d.plans for d in self.dram], self.kept_dev, self.tables)
            self.kept_host.copy_(self.kept_dev, non_blocking=True)

    def _windows_beside(self, j: int):
        """Global layer j's window parts, each sequence's queued on its own stream when there are
        (they then overlap each other, the selections' kernels and the DRAM reads, which wait on
        PCIe more than they use the SMs) -> their state (o_dev[j], lse_dev[j]), or a function that
        joins the streams and returns it, for the merge to call when it needs it."""
        if not self.beside:
            self._window(j)
            return self.o_dev[j], self.lse_dev[j]
        main = torch.cuda.current_stream(self.q_dev.device)
        for stream in self.beside:
            stream.wait_stream(main)
        self._window(j, self.beside)

        def joined():
            for stream in self.beside:
                main.wait_stream(stream)
            return self.o_dev[j], self.lse_dev[j]
        return joined

    def _dram_part(self, j: int):
        """Global layer j's selected blocks, read from DRAM, for every sequence."""
        _, lse = attend(self.dram, j, self.q_dev[j], self.tables, out=self.o_hit[j])
        self.lse_hit[j].copy_(lse)

    def _append(self, layer: int, j: int | None = None) -> torch.Tensor:
        """The layer's q, k, v of every sequence -> q [B, H, D]; each sequence's k/v into its
        window (and, for a global layer, toward DRAM)."""
        q, k, v = self.model.qkv(layer, self.x, self.position, self.rope, decoding=True)
        dtype = self.layout.dtype
        if j is not None and not self.device_selects:  # a global layer's q goes to the host, unless the device selects
            self.q_host[j].copy_(q.float(), non_blocking=True)
        if self.append_kernel is not None:  # one launch: the window's rows and, for a global layer, the stored ones
            keys, values = self.windows[0].layer_buffers(layer)
            self.append_kernel(k, v, self.slot, keys, values, self.window_members[layer],
                               *((None, None) if j is None else self.stored_rows[j]), at=self.window_at,
                               stored_at=None if j is None else self.stored_at[j])
            return q
        for b, window in enumerate(self.windows):
            keys, values = window.layer_buffers(layer)
            keys.index_copy_(1, self.slot[b:b + 1], k[b].to(dtype)[:, None])
            values.index_copy_(1, self.slot[b:b + 1], v[b].to(dtype)[:, None])
            if j is not None:  # a global layer: k/v through to DRAM
                kv = torch.stack([k[b], v[b]]).to(dtype)  # [2, KV, D]
                if self.layout.is_quantized:
                    data, scales = quantize_kv(kv, self.layout.kv_type)
                    self.kv_host[b, j].copy_(data, non_blocking=True)
                    self.kv_scales_host[b, j].copy_(scales, non_blocking=True)
                else:
                    self.kv_host[b, j].copy_(kv, non_blocking=True)
        return q

    def _window_attention(self, b: int, layer: int, q: torch.Tensor, last: int = 0, out: tuple | None = None):
        """Sequence b's q [H, D] over the layer's sinks and window (its `last` keys only, when
        given) -> out [H, D], lse [H] float32, written into `out` (out, lse) when given, by torch's
        ops (the kernel: `_windows`). Captured: the whole buffer with the invalid keys masked,
        fixed shapes read from device memory; eager: the valid keys only."""
        keys, values = self.windows[b].layer_buffers(layer)
        if self.capturing:
            lo = torch.maximum(self.lo[b], self.hi[b] - last) if last else self.lo[b]
            state = masked_window_attention(q, keys, values, lo, self.hi[b], self.model.scale)
        else:
            lo, hi = self.valid[b]
            lo = max(lo, hi - last) if last else lo
            state = attention_with_lse(q, keys[:, lo:hi], values[:, lo:hi], self.model.scale)
        if out is not None:
            out[0].copy_(state[0])
            out[1].copy_(state[1])
        return state

    def _finish(self, layer: int, o: torch.Tensor):
        self.model.residual_block(layer, self.x, o, out=self.x, decoding=True)

    # ---- capture and replay -------------------------------------------------------------
    def capture(self):
        """Capture every segment. The inputs must hold the current step (warm-up runs execute
        it; replaying the same step again is idempotent). The tables are made anew by the warm-up."""
        self._captured_near = self._near_addresses()
        self._drop_graphs()
        if self.device_selects:
            self._capture_token()
            return
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            self.tables.start()
            for j in range(len(self.global_layers) + 1):  # warm-up: allocations, kernel choice
                self._segment(j)
                if j < len(self.global_layers):
                    self._window(j)
                    if self.reads_dram:
                        self._dram_part(j)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        pool = None
        self.tables.start()
        try:
            for j in range(len(self.global_layers) + 1):
                graph = _captured(lambda: self._segment(j), self.model.device, pool)
                pool = graph.pool()
                self.graphs.append(graph)
                if j < len(self.global_layers):
                    self.window_graphs.append(_captured(lambda: self._window(j), self.model.device, pool))
                    if self.reads_dram:
                        self.dram_graphs.append(_captured(lambda: self._dram_part(j), self.model.device, pool))
        except RuntimeError as e:  # e.g. a collective of tensor parallelism this build cannot capture
            self._drop_graphs()
            self.capturing = False
            torch.cuda.synchronize(self.model.device)
            print(f"[CUDA graphs could not be captured ({first_line(e)}); decode runs eagerly]", file=sys.stderr)

    def _capture_token(self):
        """One graph for the whole token (after a warm-up run of it)."""
        device = self.model.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.tables.start()
            self._token()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.tables.start()
        self.graphs = [_captured(self._token, device)]

    def _near_addresses(self) -> list:
        return [None if dram is None else dram.near_addresses for dram in self.dram]

    def set_step(self, b: int, token_id: int, position: int):
        """Sequence b's token and position for the next step."""
        w = self.windows[b]
        self.token[b] = token_id
        self.position[b] = position
        index = w.sink_tokens + position - w.window_start
        self.slot[b] = index
        self.valid[b] = (0 if w.window_start else w.sink_tokens, index + 1)
        if self.capturing:
            self.lo[b], self.hi[b] = self.valid[b]

    @property
    def ready(self) -> bool:
        """Graphs captured (or none wanted) over device copies of the history that are still
        where they were: captured parts hold the copies' addresses (ktlong/kv/resident.py), and
        a copy that moved between turns drops them, to be captured again."""
        if self._near_addresses() != self._captured_near:  # the tables name the copies too: made anew
            self._drop_graphs()
            self._captured_near = self._near_addresses()
        return bool(self.graphs) or not self.capturing

    def _drop_graphs(self):
        """No graphs, and no tables for them (the next capture's warm-up, or eager run, makes
        them anew); the members are the body's current ones."""
        self.graphs, self.window_graphs, self.dram_graphs = [], [], []
        self.tables, self.rebound = MemberTables(self.bases), False

    def done(self) -> bool:
        """Whether what `wait` waits for is done already."""
        return self.copied is None or self.copied.query()

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
        """The whole token when the device selects; the host waits for it (`wait`) once. After
        `rebind` it runs eagerly, writing the new members' tables in place; the graph stays
        if every part found the launch it baked in."""
        if self.capturing and not self.rebound:
            self.graphs[0].replay()
        else:
            self.tables.start(rebinding=self.rebound)
            self._token()
            if self.rebound and not self.tables.matches:
                self._drop_graphs()
            self.rebound = False
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
            if j == 0:
                self.tables.start()
            self._segment(j)
        if self.copied is not None:
            self.copied.record()
        if window and self.capturing:
            self.window_graphs[j].replay()
        elif window:
            self._window(j)
        self.replays += 1


def _captured(work, device: torch.device, pool=None) -> "torch.cuda.CUDAGraph":
    """work() captured into a CUDA graph (its memory from `pool`, shared with other graphs, if
    given), on a stream of its own with nothing queued. torch.cuda.graph would first synchronise
    the device, collect Python's garbage and empty the allocator's cache: beside a prefill's
    chunks that made a join into a running batch take 2.1-2.6 s on the H200. Only this thread's
    calls are checked during the capture (thread_local): a prefill's commit helper page-locks
    DRAM on its own thread meanwhile, which in the global mode invalidates the capture. No
    garbage is collected meanwhile (collection_paused)."""
    graph = torch.cuda.CUDAGraph()
    with collection_paused(), torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            work()
        finally:
            graph.capture_end()
    return graph


def _rewritten(table: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """`new`'s values in `table` (in place: graphs read it), or `new` where there is none yet."""
    if table is None:
        return new
    table.copy_(new)
    return table
