"""Layer-major chunked prefill over the head-major KV cache, offloading every layer to DRAM.

For layer l, the prompt goes through in chunks: q/k/v, k/v into the layer's device pages,
attention of the chunk over everything up to its end, the MLP. Each chunk's K/V and block
side tables stream to DRAM on a copy stream while the next chunk computes; layer l+1 reuses
the same pages. Host<->device traffic is O(prompt) per layer.

A follow-up prefills only its new tokens: each layer's pages first receive the history already
in DRAM (widened on the device when it is q8_0 / q4_0) and the pooled keys of its blocks, then
the new chunks run as above; the block the history ended in is summarised again. With
`prefetch_history` (when the plan leaves room for a second layer of pages) the next layer's
history loads into the other pages on a stream of its own while this layer computes.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from ktlong.errors import ConfigError
from ktlong.kv.commit_ahead import CommitAhead
from ktlong.kv.device_pages import DevicePages
from ktlong.kv.history_load import HistoryLoader
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import KVLayout
from ktlong.kv.host_memory import mapped_empty
from ktlong.kv.pinned import PinnedTensors, copy_heads
from ktlong.kv.resident import ResidentHistory
from ktlong.models.chunk_graphs import ChunkGraphs
from ktlong.models.llama import LlamaModel
from operators import triton_installed
from operators.block_summary import anchor_keys, block_summaries, token_importance
from operators.chunk_attention import chunk_attention, flashinfer_available
from operators.compact_attention import CompactAttention, CompactParams
from operators.kv_quant import quantize_kv
from operators.observation_scores import observation_block_mass

IMPORTANCE_QUERIES = 64  # last queries of each chunk that score its keys for DYNAMIC anchors
OBSERVATION_QUERIES = 32  # last prompt queries that score blocks for decode-time preselection
# the most query-key pairs (over every query head) one dense attention launch takes where a
# prefill takes turns with decode steps on the device (ktlong/session/sliced_prefill.py), which wait
# for its launches: 16e9 is about 16 ms of FlashInfer's fa3 on an H200 (a chunk of 4,096 queries
# over 256K keys at 8B shapes, 3.4e10 pairs: 33 ms); a chunk's queries over more keys than that go
# in pieces (whole waves of the SMs: over 1M keys a wave of 4 tiles of 128 rows, ~17e9 pairs, is the
# least), a boundary between each
LAUNCH_PAIRS = 16_000_000_000
PIECE_ROWS = 128  # a piece's queries come in multiples of this (fa3's query tile), and of the block size
JOINT_QUANTIZE_TOKENS = 1024  # a chunk this short (a follow-up's question) quantises K and V in one pass


def resolve_backend(requested: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """The attention_backend option for a session (ktlong/session/plan.py calls this). auto: fa3
    on compute capability 9.x (Hopper) where it builds, else fa2; torch without
    FlashInfer or a GPU."""
    if device.type != "cuda" or requested == "torch":
        return "torch"
    if not flashinfer_available():
        if requested != "auto":
            raise ConfigError(f"attention_backend '{requested}' needs FlashInfer; pip install "
                              "flashinfer-python, or set attention_backend to auto or torch.")
        return "torch"
    if requested != "auto":
        return requested
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "fa2"
    from operators.flashinfer_paged import fa3_build_error

    error = fa3_build_error(device, head_dim, dtype)
    if error is not None:
        print(f"[attention_backend auto: fa3 does not build here ({error}); using fa2]", file=sys.stderr)
        return "fa2"
    return "fa3"


@dataclass
class PrefillStats:
    num_tokens: int = 0
    seconds: float = 0.0
    attention_seconds: float = 0.0  # attention kernels (CompactAttention: execution, not selection)
    selection_seconds: float = 0.0  # CompactAttention's block selection and page lists
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    peak_device_bytes: int = 0
    density_per_layer: list[float] = field(default_factory=list)  # kept history fraction (compact)
    dense_chunks: int = 0  # compact chunks run dense because the selector kept nearly everything
    history_seconds: float = 0.0  # a follow-up: loading the history from DRAM into the pages
    # global layer -> [KV, blocks] float32: the attention mass the prompt's last queries put on
    # each block, which decode's preselection reads
    block_mass: dict[int, np.ndarray] = field(default_factory=dict)
    _events: list = field(default_factory=list, repr=False)  # (stats field, start, end) CUDA events

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0


@dataclass
class _Run:
    """The state of one prefill call."""
    num_tokens: int
    host: HostKVCache
    stats: PrefillStats
    densities: list[float] = field(default_factory=list)  # CompactAttention's kept fraction, this layer
    # (layer, [KV, blocks] on the device): decode's preselection masses, to the host after the
    # last layer (fetching each as it is made would sync the host with the device every layer)
    masses: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    resident: ResidentHistory | None = None  # layers whose rows also go to device copies
    # the most query-key pairs of a dense attention launch (0: a chunk's in one), and what runs
    # between two of them (a boundary: a sliced prefill may hand back there)
    launch_pairs: int = 0
    between: Callable[[], None] | None = None


def launch_pieces(s: int, e: int, num_heads: int, launch_pairs: int, align: int, slots: int = 1) -> list[tuple[int, int]]:
    """The chunk s..e's queries split into pieces (a, b) of equal rows (the last shorter), each
    piece's query-key pairs, (b - a) * e * num_heads, within launch_pairs; [(s, e)] where one
    launch keeps within it or launch_pairs is 0. A piece's rows come in tiles of align rows, each
    tile num_heads programs of the kernel, and in whole waves of `slots` programs (the SMs, that
    run them at once; at least one wave, even past launch_pairs): a launch of a part of a wave
    takes a wave's time and leaves the other SMs idle."""
    if not launch_pairs or (e - s) * e * num_heads <= launch_pairs:
        return [(s, e)]
    wave = max(1, slots // num_heads)  # the tiles of one wave
    tiles = max(wave, launch_pairs // (align * e * num_heads) // wave * wave)
    rows = tiles * align
    return [(a, min(a + rows, e)) for a in range(s, e, rows)]


class _Timer:
    """Accumulates the time of a code region: CUDA events on the GPU, wall clock on the CPU."""

    def __init__(self, stats: PrefillStats, device: torch.device, into: str = "attention_seconds"):
        self.stats, self.cuda, self.into = stats, device.type == "cuda", into

    def __enter__(self):
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats._events.append((self.into, self.start, end))
        else:
            setattr(self.stats, self.into, getattr(self.stats, self.into) + time.perf_counter() - self.t0)


class LayerMajorPrefill:
    def __init__(self, model: LlamaModel, layout: KVLayout, chunk_size: int, backend: str,
                 hidden_on_device: bool, compact: CompactParams | None = None, use_cuda_graph: bool = False):
        """use_cuda_graph: short chunks (a follow-up's question) run their projections and MLP
        from CUDA graphs (ktlong/models/chunk_graphs.py), on one GPU."""
        assert chunk_size % layout.block_size == 0
        self.model, self.layout, self.chunk_size = model, layout, chunk_size
        self.device = model.device
        assert backend == "torch" or (backend in ("fa2", "fa3") and self.device.type == "cuda"), \
            "resolve_backend first (the plan does)"
        self.backend = backend
        self.hidden_on_device = hidden_on_device or self.device.type == "cpu"
        self.pages = DevicePages(layout, self.device)
        self.compact, self.dense_paged, self.is_sparse = None, None, compact is not None
        c = model.config
        if compact is not None:
            self.compact = CompactAttention(compact, c.num_heads, c.num_kv_heads, layout.block_size, model.scale,
                                            self.backend, self.device)
        if self.backend == "fa3":  # fa3 runs dense as "every page kept"
            self.dense_paged = CompactAttention(CompactParams.keep_all(), c.num_heads, c.num_kv_heads,
                                                layout.block_size, model.scale, self.backend, self.device)
        # pooled (mean) key of every block of the current layer, for the block selector
        self.pooled_keys = torch.zeros((layout.num_kv_heads, layout.num_blocks, layout.head_dim),
                                       dtype=torch.float32, device=self.device)
        self.cuda = self.device.type == "cuda"
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 1
        # the block summaries in Triton kernels (operators/block_summary_kernel.py) where they run
        self.summary_kernel = False
        if self.cuda and triton_installed():
            from operators.block_summary_kernel import kernel_applies

            self.summary_kernel = kernel_applies(layout.block_size, layout.head_dim)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.graphs = ChunkGraphs(model) if use_cuda_graph and self.cuda and model.tp is None else None
        self.compute_stream = None  # a run's current stream on a GPU
        # called with (layer, q, chunk start, chunk end, pages) before each chunk's attention
        self.attention_hook: Callable[[int, torch.Tensor, int, int, DevicePages], None] | None = None

    @torch.inference_mode()
    def run(self, token_ids: list[int], host: HostKVCache, progress=None, history: int = 0,
            prefetch_history: bool = False, resident: ResidentHistory | None = None,
            short_launches: bool = False) -> tuple[torch.Tensor, PrefillStats]:
        """Prefill token_ids at positions history.. into `host`, which holds the first `history`
        tokens (0: a new prompt; more: a follow-up over the cache). Returns the last token's
        logits [vocab] and stats. prefetch_history: a follow-up loads layer l+1's history into
        a second set of pages while layer l computes (one more layer of pages on the device).
        resident: layers whose history the device keeps between turns (ktlong/kv/resident.py).
        short_launches: decode steps wait for its launches (it takes turns with them), so a
        chunk's dense attention goes in pieces of at most LAUNCH_PAIRS, progress.pace() between."""
        num_tokens = history + len(token_ids)
        assert history < num_tokens <= self.layout.capacity and host.num_tokens == history
        assert not (history and self.layout.sliding), "sliding-window layers keep only a tail: re-prefill"
        stats = PrefillStats(num_tokens=len(token_ids))
        run = _Run(num_tokens, host, stats, resident=resident)
        if short_launches and progress is not None:
            run.launch_pairs, run.between = LAUNCH_PAIRS, progress.pace
        if not history:
            host.place_tails(num_tokens)
        if self.compact is not None:
            self.compact.new_prompt()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.compute_stream = torch.cuda.current_stream(self.device)  # asked once: each ask costs host time
        start = time.perf_counter()
        positions = torch.arange(num_tokens, device=self.device)
        # chunk boundaries stay on multiples of chunk_size, so a follow-up's chunks are a
        # re-prefill's chunks, but for the first one, which starts where the history ends
        first = min(num_tokens, (history // self.chunk_size + 1) * self.chunk_size)
        chunks = [(history, first)] + [(s, min(s + self.chunk_size, num_tokens))
                                       for s in range(first, num_tokens, self.chunk_size)]
        # each global layer's memory in DRAM committed whole on a helper thread while the layer
        # before computes (ktlong/kv/commit_ahead.py), from before the hidden states are made; the
        # hidden states for this call only, a tensor per chunk
        spans = [(s - history, e - history) for s, e in chunks]
        with CommitAhead(host, num_tokens) as ahead, self._hidden_states(token_ids, spans, stats, progress) as hidden:
            loader = None
            if history:
                loader = HistoryLoader(self.layout, self.model.config.num_layers, host, history,
                                       (self.pages, self.pooled_keys), prefetch_history,
                                       (self.compute_stream, self.copy_stream) if self.cuda else None,
                                       lambda: _Timer(stats, self.device, "history_seconds"), resident)
            for layer in range(self.model.config.num_layers):
                is_global = not self.layout.is_sliding(layer)
                if self.cuda:  # the pages are about to be overwritten: last layer's copies must be done
                    self.compute_stream.wait_stream(self.copy_stream)
                if loader is not None:
                    self.pages, self.pooled_keys = loader.take(layer)
                run.densities = []
                if is_global:  # the layer's memory in DRAM, before it is written there
                    ahead.wait(layer)
                for rows, (s, e) in zip(hidden, chunks):
                    x = rows.to(self.device, non_blocking=True)
                    if not self.hidden_on_device:
                        stats.bytes_to_device += x.numel() * x.element_size()
                    x = self._layer_chunk(layer, x, positions[s:e], s, e, run)
                    self._store_hidden(rows, x, stats)
                    if progress is not None:
                        progress.update(e - s)
                if self.is_sparse:  # fa3 runs dense prefill through CompactAttention too: no density to report
                    d = run.densities
                    stats.density_per_layer.append(sum(d) / len(d) if d else 1.0)
            if loader is not None:
                self.pages, self.pooled_keys = loader.close()
                stats.bytes_to_device += loader.bytes_to_device
            if self.cuda:  # the last layer's rows reach DRAM on the copy stream: read them after it
                self.compute_stream.wait_stream(self.copy_stream)
            last = hidden[-1][-1:].to(self.device)
            logits = self.model.logits(last)[0]
            if self.cuda:
                torch.cuda.synchronize(self.device)
                for name, a, b in stats._events:
                    setattr(stats, name, getattr(stats, name) + a.elapsed_time(b) / 1e3)
                stats.peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
            if run.masses:  # one copy to the host (each layer's own would wait for the device once each)
                masses = torch.stack([mass for _, mass in run.masses]).cpu().numpy()
                stats.block_mass = {layer: masses[i] for i, (layer, _) in enumerate(run.masses)}
            host.advance(len(token_ids))
            stats.seconds = time.perf_counter() - start
            return logits, stats

    def warm_up(self, host: HostKVCache):
        """Build, before anything is timed, the kernels a prefill of this model uses (FlashInfer
        and Triton compile on first use: up to 90 s on a fresh machine, then a load from the
        disk cache): a prompt of one block (the dense and paged attention kernels, the block
        summaries, the observation scores, the quantiser), a short follow-up over it (fa2 where
        fa3 runs long chunks), the dense rows CompactAttention gives the prompt's last queries,
        and topk's selection kernels. The selected chunks run the paged kernel the first prompt
        built. `host` is left empty."""
        first = min(self.layout.block_size, self.layout.capacity)
        if self.graphs is not None:
            self.graphs.capture()
        self.run([0] * first, host)
        if not self.layout.sliding and first + 8 <= self.layout.capacity:
            self.run([0] * 8, host, history=first)
        if self.cuda and self.compact is not None and self.compact.params.dense_tail:
            rows = self.pages.tokens(self.pages.k)[:, :first]  # [KV, first, D]
            q = rows.new_zeros((min(8, first), self.model.config.num_heads, rows.shape[-1]))
            chunk_attention(q, rows, rows, self.model.scale, self.backend)
        if self.cuda and self.compact is not None and self.compact.params.selector == "topk":
            # the selection's Triton kernels: a one-block prompt selects nothing
            c, num_hist = self.model.config, self.layout.num_blocks
            q = torch.zeros((self.chunk_size, c.num_heads, c.head_dim), dtype=self.layout.dtype, device=self.device)
            self.compact.topk_indices(q, self.pooled_keys, num_hist, self.compact.num_keep(num_hist),
                                      self.pages.k.shape[1], self.chunk_size, None)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        host.reset()

    def dram_bytes(self, num_new: int) -> int:
        """DRAM a prefill of num_new tokens holds while it runs besides the cache: its hidden
        states, where they live in DRAM (8 GiB for 1M tokens at 8B shapes)."""
        return 0 if self.hidden_on_device else num_new * self.model.config.hidden_size * self.model.dtype.itemsize

    @contextmanager
    def _hidden_states(self, token_ids, spans, stats, progress) -> Iterator[list[torch.Tensor]]:
        """The prompt's embeddings, a tensor [b - a, hidden] for each chunk's rows a..b of
        token_ids (spans), on the device or in DRAM. In DRAM each chunk's are page-locked in place
        at their own size, for the block only (torch's pinned allocator would round 8.01 GiB, 1M
        tokens at 8B shapes, up to 16 and keep it cached after), a chunk at a time with a boundary
        after each (progress.update(0): a sliced prefill hands back there; locked at once, 1M
        tokens' took 3.4 s on the H200, a step of 3.9 s for the streams decoding beside it), and
        unlocked so at the end (progress.pace() after each). No copy into them is left in flight
        when it ends (a stop mid-way)."""
        ids = torch.tensor(token_ids, device=self.device)
        if self.hidden_on_device:
            yield [self.model.embed(ids[a:b]) for a, b in spans]
            return
        pinned = PinnedTensors()
        try:
            hidden = []
            for a, b in spans:
                rows = pinned.pin(mapped_empty((b - a, self.model.config.hidden_size), self.model.dtype))
                self._store_hidden(rows, self.model.embed(ids[a:b]), stats)
                hidden.append(rows)
                if progress is not None:
                    progress.update(0)
            yield hidden
        finally:
            torch.cuda.synchronize(self.device)
            pinned.close(progress.pace if progress is not None else None)

    def _store_hidden(self, rows, x, stats):
        """A chunk's hidden states x into its rows (on the device, or queued on the copy stream)."""
        if self.hidden_on_device:
            rows.copy_(x)
            return
        with self._after_compute():
            rows.copy_(x, non_blocking=True)
            x.record_stream(self.copy_stream)
        stats.bytes_to_host += x.numel() * x.element_size()

    def _layer_chunk(self, layer, x, positions, s, e, run: _Run) -> torch.Tensor:
        model = self.model
        graphs = self.graphs if self.graphs is not None and self.graphs.applies(e - s) else None
        q, k, v = graphs.qkv(layer, x, positions) if graphs is not None else model.qkv(layer, x, positions)
        self.pages.write(s, k.to(self.layout.dtype), v.to(self.layout.dtype))
        if e == run.num_tokens and not self.layout.is_sliding(layer):  # every key of the layer is in pages
            mass = observation_block_mass(q[-OBSERVATION_QUERIES:], self.pages.k, e, model.scale)
            run.masses.append((layer, mass))
        o = self._attention(layer, q.to(self.layout.dtype), s, e, run)
        self._offload(layer, q, s, e, run)
        if graphs is None:
            return model.residual_block(layer, x, o)
        x = graphs.residual_block(layer, o)  # the graphs' buffer, which the next layer overwrites:
        return x if self.hidden_on_device else x.clone()  # a copy to DRAM must read its own

    def _attention(self, layer, q, s, e, run: _Run) -> torch.Tensor:
        """The chunk's attention, timed in two parts: selection (CompactAttention's choice of
        blocks and page lists) and attention (the kernels that read the KV)."""
        if self.attention_hook is not None:
            self.attention_hook(layer, q, s, e, self.pages)
        timed = lambda into="attention_seconds": _Timer(run.stats, self.device, into)
        window = self.model.config.sliding_window if self.layout.is_sliding(layer) else 0
        if window:  # sliding layers: dense over their window, never selected
            lo = max(0, s - window)
            keys, values = self.pages.tokens(self.pages.k)[:, lo:e], self.pages.tokens(self.pages.v)[:, lo:e]
            with timed():
                return chunk_attention(q, keys, values, self.model.scale, self.backend, window)
        paged = s % self.layout.block_size == 0  # a follow-up's first chunk may start mid-block
        if self.compact is not None and layer < self.compact.params.prefill_dense_layer_num:
            if s:
                run.densities.append(1.0)
        elif self.compact is not None and paged:
            with timed("selection_seconds"):
                pages, what = self.compact.select(q, self.pages.k, self.pooled_keys, s, e, run.num_tokens, layer)
            if pages is not None:
                if pages.num_hist:
                    run.densities.append(pages.density)
                with timed():
                    return self.compact.attend(q, self.pages.k, self.pages.v, pages, what, s, e, run.num_tokens)
            run.densities.append(1.0)  # kept nearly everything: dense is cheaper (dense_above)
            run.stats.dense_chunks += 1
        pieces = launch_pieces(s, e, q.shape[1], run.launch_pairs, math.lcm(PIECE_ROWS, self.layout.block_size),
                               self.sms)
        if len(pieces) == 1:
            with timed():
                return self._dense(q, s, e, paged)
        o = torch.empty_like(q)
        for i, (a, b) in enumerate(pieces):
            if i:
                run.between()
            with timed():
                o[a - s:b - s] = self._dense(q[a - s:b - s], a, b, paged)
        return o

    def _dense(self, q, s, e, paged: bool) -> torch.Tensor:
        """Queries s..e over every key up to each (causal)."""
        if self.dense_paged is not None and paged:
            return self.dense_paged(q, self.pages.k, self.pages.v, self.pooled_keys, s, e)[0]
        keys, values = self.pages.tokens(self.pages.k)[:, :e], self.pages.tokens(self.pages.v)[:, :e]
        return chunk_attention(q, keys, values, self.model.scale, self.backend)

    def _offload(self, layer, q, s, e, run: _Run):
        """Summarise the chunk's blocks and copy its K/V and side tables to DRAM. Sliding-window
        layers copy only their DRAM tail, what the decoder's device window loads (no side tables)."""
        host, stats = run.host, run.stats
        if self.layout.is_sliding(layer):
            s = max(s, host.first_token(layer))
            if s >= e:
                return
            with self._after_compute():
                self._copy_kv(layer, s, e, run)
            return
        B = self.layout.block_size
        b0, b1 = s // B, -(-e // B)
        summaries = self._summaries(q, b0, b1, e)
        tables = [(getattr(host, name)[layer][:, b0:b1], values) for name, values in summaries.items()]
        with self._after_compute():  # K/V and side tables after one wait for the compute stream
            self._copy_kv(layer, s, e, run)
            for dst, values in tables:
                copy_heads(dst, values)  # block ranges of head-major tables: one range per head
                if self.cuda:
                    values.record_stream(self.copy_stream)
        stats.bytes_to_host += sum(values.numel() * 4 for _, values in tables)

    def _summaries(self, q, b0: int, b1: int, e: int) -> dict[str, torch.Tensor]:
        """The side tables of blocks b0..b1 (keys up to e; a follow-up's first block holds history
        too), by HostKVCache table name, float32; the means also become the selector's pooled keys."""
        layout = self.layout
        k_blocks = self.pages.k[:, b0:b1]  # [KV, nb, B, D]
        valid = e - b0 * layout.block_size
        dynamic = layout.anchor_keys and layout.anchor_type == "DYNAMIC"
        if self.summary_kernel:  # a few launches instead of forty (ktlong's prefill is launch-bound on small models)
            from operators.block_summary_kernel import summarize_blocks

            one_anchor = dynamic and layout.anchor_num == 1
            mean = self.pooled_keys[:, b0:b1]
            q_last = q[-IMPORTANCE_QUERIES:].to(k_blocks.dtype) if one_anchor else None
            kmax, kmin, anchors = summarize_blocks(k_blocks, valid, mean, self.model.scale, q_last)
        else:
            mean, kmax, kmin = block_summaries(k_blocks, valid)
            self.pooled_keys[:, b0:b1] = mean
            anchors = None
        tables = {"key_mean": mean, "key_max": kmax, "key_min": kmin}
        if layout.anchor_keys:
            if anchors is None:
                importance = None
                if dynamic:
                    keys = self.pages.tokens(self.pages.k)[:, b0 * layout.block_size:e]
                    importance = token_importance(q[-IMPORTANCE_QUERIES:], keys, self.model.scale)  # [KV, valid]
                anchors = anchor_keys(k_blocks, valid, layout.anchor_type, layout.anchor_num, importance)
            tables["anchor_keys"] = anchors
        return tables

    def _after_compute(self):
        """Where copies to the host run: on a GPU the copy stream, after everything the compute
        stream (the run's current stream) has queued so far."""
        if not self.cuda:
            return nullcontext()
        self.copy_stream.wait_stream(self.compute_stream)
        return torch.cuda.stream(self.copy_stream)

    def _copy_kv(self, layer, s, e, run: _Run):
        """K/V of positions s..e to DRAM in its stored type, queued where the caller entered
        _after_compute(): q8_0 / q4_0 are quantised here, on the device, so that the copy moves
        the quantised bytes. A resident layer's device copy gets the same rows."""
        layout, host = self.layout, run.host
        resident = run.resident if run.resident is not None and layer in run.resident.rows else None
        sources = [self.pages.tokens(self.pages.k)[:, s:e], self.pages.tokens(self.pages.v)[:, s:e]]  # [KV, e-s, D]
        if layout.is_quantized and e - s <= JOINT_QUANTIZE_TOKENS:  # one pass: a few rows, launches dominate
            quantized = list(zip(*quantize_kv(torch.stack(sources), layout.kv_type)))
        elif layout.is_quantized:  # a whole chunk: one plane at a time, as the plan counts its workspace
            quantized = [quantize_kv(src, layout.kv_type) for src in sources]
        for i, which in enumerate("kv"):
            src = sources[i]
            planes = [(host.tokens(layer, which, s, e), src)]
            if layout.is_quantized:
                data, scales = quantized[i]
                planes = [(host.tokens(layer, which, s, e), data), (host.scale_tokens(layer, which, s, e), scales)]
            for dst, values in planes:
                copy_heads(dst, values)
                if self.cuda and values is not src:
                    values.record_stream(self.copy_stream)
            if resident is not None:
                resident.write(layer, which, s, e, *(values for _, values in planes))
        if resident is not None:
            resident.extend(layer, s, e)
        run.stats.bytes_to_host += 2 * (e - s) * layout.num_kv_heads * layout.stored_row_bytes
