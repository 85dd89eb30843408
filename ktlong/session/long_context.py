"""Long-context generation state: layer-major prefill into the DRAM KV cache, then decode.

Decode (ktlong/decode/decoder.py): the device attends to sinks and the local window, and the
GPU (reading pinned DRAM) or the CPU operator to the blocks selected from the rest, merged by
log-sum-exp.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ktlong.errors import Cancelled
from ktlong.kv.history_load import staging_bytes
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import KVLayout
from ktlong.kv.memory_plan import workspace_bytes
from ktlong.kv.resident import ResidentHistory
from ktlong.kv.shared_prefix import shareable_blocks
from cpu_ops.anchors import anchors_per_block
from ktlong.models.llama import LlamaModel
from ktlong.prefill import LayerMajorPrefill
from ktlong.decode.selection import SelectionSettings
from ktlong.decode.batch import Batches, WhileWaiting
from ktlong.decode.decoder import Decoder
from ktlong.decode.device_anchors import scores_on_device
from ktlong.decode.warm_up import compile_decode_kernels
from ktlong.session.anchors_pool import AnchorsPool
from ktlong.session.parked_decoders import ParkedDecoders
from ktlong.session.plan import SessionPlan
from ktlong.session.prefix import cached_prefix
from ktlong.session.progress import prefill_progress
from operators.compact_attention import CompactParams

# device memory resident history leaves unused: the plan counts the decoder's buffers, not what
# the allocator rounds up or CUDA graphs keep besides
RESIDENT_MARGIN = 1 << 30


class LongContextSession:
    def __init__(self, model: LlamaModel, layout: KVLayout, *, chunk_size: int, backend: str,
                 hidden_on_device: bool, compact: CompactParams | None, selection: SelectionSettings,
                 local_windows_len: int, use_cuda_graph: bool, follow_up_headroom: int | None = None,
                 prefill_headroom: int | None = None, resident_history: bool = True, decoder_bytes: int = 0,
                 max_seq_len: int | None = None, anchors_pool: int | None = None, prefill_sms: int = 0):
        """max_seq_len: the most tokens a conversation holds (default: the layout's capacity, which
        kv_layout rounds up to whole pages). follow_up_headroom: device bytes the plan leaves
        beside a decoder (its window, anchors and graphs), within which a follow-up's prefill
        runs while the decoder stays; None: no limit (the CPU). prefill_headroom: what the plan
        leaves beside a new prompt's prefill. What a prefill leaves of that room keeps the
        decoders of conversations handed over by
        exchange() (decoder_bytes each: ktlong/session/parked_decoders.py), then, with
        resident_history, layers' history on the device for the next follow-up
        (ktlong/kv/resident.py): the session's conversation's first, then what is left for the
        handed-over ones' own. anchors_pool: the device bytes every decoder's anchors share
        (ktlong/session/anchors_pool.py; None: no limit). prefill_sms: the SMs a server's prefill
        beside decode steps runs on (0: every SM; ktlong/session/sliced_prefill.py). backend and
        selection: resolved, as the plan resolves them (from_plan)."""
        window = model.config.sliding_window
        assert not window or local_windows_len >= min(window, layout.capacity), "Config.local_window_for"
        assert tuple(layout.sliding) == tuple(model.config.sliding_layers), "use model_kv_layout"
        assert not layout.sliding or layout.sliding_blocks * layout.block_size >= min(
            layout.capacity, local_windows_len + layout.block_size), "the DRAM tail must cover the device window"
        self.selection, self.local_windows_len = selection, local_windows_len
        self.use_cuda_graph, self.follow_up_headroom = use_cuda_graph, follow_up_headroom
        self.prefill_headroom, self.prefill_sms = prefill_headroom, prefill_sms
        self.model, self.layout = model, layout
        self.max_seq_len = min(max_seq_len or layout.capacity, layout.capacity)
        self.engine = LayerMajorPrefill(model, layout, chunk_size, backend, hidden_on_device, compact, use_cuda_graph)
        # the conversation the session works on: its DRAM cache, tokens and bookkeeping, in one
        # object that exchange() hands over whole
        self.conversation = HeldConversation.empty(layout, HostKVCache(layout, pin=model.device.type == "cuda"))
        self.parked = ParkedDecoders(decoder_bytes)
        self.anchors = AnchorsPool(anchors_pool, layout, anchors_per_block(selection.anchor_type, selection.anchor_num)
                                   if scores_on_device(selection) else 0)
        # each conversation keeps its own device copies (exchange() hands them over with it)
        self.keeps_resident = resident_history and follow_up_headroom is not None and not layout.sliding
        self._give_resident(self.conversation)
        self.last_stats = None
        self.last_prefill_tokens = 0  # tokens the last prefill computed (the rest came from the cache)
        self.last_decode_setup_seconds = 0.0  # after the last prefill: the decoder built, its graphs captured
        self.last_decode_setup_parts: dict[str, float] = {}  # of it, a new decoder's parts (Decoder.setup_seconds)
        self.last_follow_up = (False, False)  # the last prefill's (decoder kept, history prefetched)
        self._batches = Batches(model, self.use_cuda_graph)  # of several conversations, stepped together
        self.last_batch_build: float | None = None  # seconds a new batch's first step took (built, captured)
        self.last_batch_rebound = False  # whether that batch took the body and graphs of the last one of as many
        self.last_step_filled = 0.0  # seconds the last step_batch spent on the blocks its answers filled

    @classmethod
    def from_plan(cls, model: LlamaModel, plan: SessionPlan) -> "LongContextSession":
        """The session local_chat, the evaluation, the benches and the server run: everything
        as the plan resolved it (ktlong/session/plan.py), its kernels built (warm_up)."""
        session = cls(model, plan.layout, chunk_size=plan.chunk_size, backend=plan.attention_backend,
                      hidden_on_device=plan.memory.hidden_on_device, compact=plan.compact,
                      selection=plan.selection, local_windows_len=plan.local_windows_len,
                      use_cuda_graph=plan.use_cuda_graph,
                      follow_up_headroom=plan.budget_bytes - plan.memory.decode_device if plan.is_gpu else None,
                      prefill_headroom=(plan.budget_bytes - plan.memory.prefill_beside_decoders
                                        if plan.is_gpu else None),
                      resident_history=plan.resident_history,
                      decoder_bytes=plan.memory.decoder, max_seq_len=plan.max_seq_len,
                      anchors_pool=plan.memory.anchors_pool if plan.is_gpu else None, prefill_sms=plan.prefill_sms)
        session.warm_up()
        return session

    def warm_up(self, log=None):
        """Compile what compiles on first use before anything is timed: the Numba decode kernels
        (later processes load them from Numba's cache) and, on a GPU, every prefill kernel of
        this model (LayerMajorPrefill.warm_up) and decode's Triton kernels and graphs, by a
        prompt long enough for decode to select blocks and one decode step, then a short
        follow-up over it (a cache hit's path: the history's load ahead of each layer, the
        dense attention of a few queries over thousands of keys, the kept decoder); then
        forgotten."""
        log = sys.stderr if log is None else log  # the stream of the moment, not the one at import
        print("[kernels that compile on first use:", end="", file=log, flush=True)
        report = compile_decode_kernels(self.layout, self.selection, self.model.config.num_heads, self.model.scale)
        seconds = report.seconds
        if self.model.device.type == "cuda":
            start = time.perf_counter()
            self.engine.warm_up(self.host)
            self.prefill([0] * self.warm_up_tokens())
            self.step(0)
            if not self.layout.sliding and len(self.ids) + 8 < self.max_seq_len:
                self.prefill(self.ids + [0] * 8)
                self.step(0)
            self.reset()
            seconds += time.perf_counter() - start
        done = (f" compiled {report.compiled} CPU kernels, once (later runs load them from Numba's cache)"
                if report.compiled else f" {report.loaded} CPU kernels loaded from Numba's cache")
        print(f"{done}; {seconds:.1f} s before anything is timed]", file=log, flush=True)

    def warm_up_tokens(self) -> int:
        """A prompt whose decode selects blocks past the local window (its scoring and reading
        kernels run), within max_seq_len with room for one decoded token."""
        B = self.layout.block_size
        wanted = self.local_windows_len + (self.selection.second_select_num + 2) * B
        return max(1, min(wanted, self.max_seq_len - 1))

    @property
    def cache_bytes(self) -> int:
        return self.layout.dram_cache_bytes()

    @property
    def device(self) -> torch.device:
        """Where the prefill and the decode steps queue their work."""
        return self.model.device

    @property
    def prefill_density(self) -> float | None:
        densities = self.last_stats.density_per_layer if self.last_stats is not None else []
        return sum(densities) / len(densities) if densities else (1.0 if self.last_stats is not None else None)

    @property
    def saves_cache(self) -> bool:
        """Its cache can go to a file (ktlong/session/saved_cache.py; a rank's part, under tensor
        parallelism)."""
        return True

    # the conversation's fields, read and set where the session's were (ktlong/session/saved_cache.py)
    host = property(lambda self: self.conversation.host)
    ids = property(lambda self: self.conversation.ids, lambda self, v: setattr(self.conversation, "ids", v))
    block_mass = property(lambda self: self.conversation.block_mass,
                          lambda self, v: setattr(self.conversation, "block_mass", v))
    stable_tokens = property(lambda self: self.conversation.stable_tokens,
                             lambda self, v: setattr(self.conversation, "stable_tokens", v))
    saved_file = property(lambda self: self.conversation.saved_file,
                          lambda self, v: setattr(self.conversation, "saved_file", v))
    # the decoder over the conversation's cache (None: the next prefill builds one)
    decoder = property(lambda self: self.conversation.decoder,
                       lambda self, v: setattr(self.conversation, "decoder", v))
    # layers of the conversation's history kept on the device (None: resident_history off)
    resident = property(lambda self: self.conversation.resident)

    def reset(self):
        resident = self.resident
        self.conversation = HeldConversation.empty(self.layout, self.host)
        self.conversation.resident = resident
        self._cut_resident(0)

    def _give_resident(self, conversation: "HeldConversation"):
        if self.keeps_resident and conversation.resident is None:
            conversation.resident = ResidentHistory(self.layout, self.model.device)

    def _cut_resident(self, num_tokens: int):
        """The device copies of layers' rows are cut wherever the cache is, so that they never
        outlive the rows they were made from."""
        if self.resident is not None:
            self.resident.truncate(num_tokens)

    def exchange(self, incoming: "HeldConversation") -> "HeldConversation":
        """Swap conversations, no copy: the session's cache is handed over whole (the server's
        cache store keeps it in DRAM) with its decoder and its resident history, which stay on
        the device while the plan leaves room for them (ParkedDecoders), and `incoming` taken
        in its place, an earlier handed-over one or empty() on a free host cache. The next
        prefill goes on with incoming's decoder and device copies as a follow-up does, or
        builds them."""
        assert incoming.layout == self.layout and incoming.host is not self.host
        outgoing, self.conversation = self.conversation, incoming
        self.parked.park(outgoing)
        self.parked.take(incoming)
        self._give_resident(incoming)
        return outgoing

    def detach(self, host: HostKVCache) -> "HeldConversation":
        """The conversation decoding in the session leaves it, with its decoder, to decode on
        beside others (step_batch) while the next prefill takes the session, which goes on with
        an empty conversation on `host`. The device room its resident history held is the next
        prefill's: a running decoder reads its blocks from DRAM."""
        assert self.decoder is not None and host is not self.host
        outgoing = self.conversation
        if outgoing.resident is not None:  # its decoder follows at its next step
            outgoing.resident.fit(0)
        self.conversation = HeldConversation.empty(self.layout, host)
        self._give_resident(self.conversation)
        return outgoing

    def share(self, source: "HeldConversation", prompt_ids: list[int]) -> int:
        """Begin a new conversation whose cache holds the leading tokens of source that
        prompt_ids begins with too: their whole multiples of the granularity in one copy in DRAM
        for both (ktlong/kv/shared_prefix.py), the blocks past them (all of them, where the
        layout shares none) copied as the prefill reserves them (HostKVCache.share); the next
        prefill(prompt_ids) computes the rest as a follow-up does. Returns the tokens held so;
        0 (nothing changed) where none match, or the cache cannot take them (sliding-window
        layers keep only a tail; ranks that each hold a part)."""
        assert source is not self.conversation and source.layout == self.layout
        tokens = self.shareable(source, prompt_ids)
        if tokens:
            self.reset()
            self.host.share(source.host, shareable_blocks(self.layout, tokens), tokens)
            self.ids = list(prompt_ids[:tokens])
        return tokens

    def shareable(self, source: "HeldConversation", prompt_ids: list[int]) -> int:
        """The tokens `share` would hold: 0 where it would not."""
        common = min(cached_prefix(source.ids, prompt_ids), source.host.num_tokens)
        return common if self.model.tp is None and not self.layout.sliding else 0

    def decoder_fits(self, tokens: int, busy: list["HeldConversation"]) -> bool:
        """Whether a conversation reaching `tokens` gets a decoder beside those of the busy
        conversations (answers running): its anchors in the pool that theirs leave."""
        return self.anchors.fits(tokens, [c.decoder for c in busy])

    def park(self, conversation: "HeldConversation"):
        """A conversation that decoded outside the session is held elsewhere now (the server's
        cache store): its decoder stays on the device while the plan leaves room (ParkedDecoders)."""
        self.parked.park(conversation)

    @torch.inference_mode()
    def step_batch(self, conversations: list["HeldConversation"], tokens: list[int],
                   while_waiting: WhileWaiting | None = None) -> torch.Tensor:
        """One token of each conversation (the session's own, or detached ones), decoded together
        (ktlong/decode/batch.py) -> logits [B, vocab]. A batch of other members is built anew:
        conversations join and leave between steps. A conversation alone steps through its own
        decoder's batch of one, whose graphs its prefill captured. while_waiting: called once
        while the device runs the step (DecodeBatch.step)."""
        decoders = [c.decoder for c in conversations]
        filled = sum(d.times.block_filled for d in decoders)
        if len(decoders) == 1:
            self._batches.let_go()
            logits = decoders[0].step(tokens[0], while_waiting)[None]
        else:
            start = time.perf_counter()
            batch, how = self._batches.of(decoders)  # the last batch of as many where it can take them
            logits = batch.step(decoders, tokens, while_waiting)  # a new batch's graphs captured first
            if how is not None:
                self.last_batch_build, self.last_batch_rebound = time.perf_counter() - start, how == "rebound"
        for conversation, token in zip(conversations, tokens):
            conversation.ids.append(token)
        self.last_step_filled = sum(d.times.block_filled for d in decoders) - filled
        return logits

    def _release_batch(self):
        """Every batch of several conversations goes, with the device buffers and graphs its body holds."""
        self._batches.clear()

    def reusable(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of prompt_ids the cache already holds: the common prefix
        with the conversation so far, leaving at least one token to prefill (its logits are the
        answer's first). Models with sliding-window layers keep only a tail in DRAM: 0."""
        return 0 if self.layout.sliding else cached_prefix(self.ids, prompt_ids)

    def prefill(self, prompt_ids: list[int], show_progress: bool = False,
                should_stop: Callable[[], bool] | None = None,
                on_progress: Callable[[int, int], None] | None = None, alone: bool = True,
                answer_room: int | None = None, short_launches: bool = False) -> torch.Tensor:
        """Prefill what the cache does not hold yet: all of a new prompt, or the new tokens of a
        follow-up (the conversation so far, extended) over the history in DRAM. should_stop is
        asked after every chunk of every layer and between the parts of the decoder's setup; when
        it says so, the half-written cache is forgotten and Cancelled raised. alone: the
        conversation will decode by itself, so its decoder's graphs are captured now; otherwise
        (it joins a batch, whose own graphs serve it) on its first step alone, if it ever takes
        one. answer_room: the most tokens its answer adds (None: up to max_seq_len), which its
        decoder's device anchors are sized for (ktlong/session/anchors_pool.py). short_launches:
        decode steps wait for its device work (a sliced prefill taking turns with them), so its
        long attention launches go in pieces (LayerMajorPrefill.run)."""
        history = self.reusable(prompt_ids)
        reach = self.max_seq_len if answer_room is None else min(len(prompt_ids) + answer_room, self.max_seq_len)
        # a follow-up that fits beside the decoder keeps it (and its graphs); otherwise the
        # device window goes before prefill needs the memory
        keep, prefetch, room = (self._follow_up_room(len(prompt_ids) - history) if history
                                else (False, False, self._new_prompt_room()))
        keep = keep and self.decoder.reach_tokens >= reach
        self.last_follow_up = (keep, prefetch)
        room = self.parked.fit(room, self.resident.wanted_bytes if self.resident is not None else 0)
        if self.resident is not None:  # rows prefilled now go to the copies too
            self.resident.fit(room)
        kept = self.decoder if keep else None
        self.decoder = None
        if not keep:  # the new decoder's anchors: room made before the prefill, so that what cannot fit fails first
            self.anchors.make_room(reach, self.parked, self._release_batch)
        if history:
            self.host.truncate(history)
            self._cut_resident(history)
            self.stable_tokens = min(self.stable_tokens, history)
        else:
            self.reset()
        new = prompt_ids[history:]
        layers = self.model.config.num_layers
        bar = prefill_progress(len(new), show_progress and len(new) > self.engine.chunk_size)
        progress = _ScaledProgress(bar, 1.0 / layers, should_stop, on_progress)
        self.last_prefill_tokens = len(new)
        try:
            # a joined document's pages (HostKVCache._hold), page-locked, and the blocks past them
            # copied, before anything reads them, a piece at a time: a sliced prefill hands back
            # to the decode steps between pieces
            self.host.reserve(history, pace=progress.pace)
            progress.check()
            logits, self.last_stats = self.engine.run(new, self.host, progress, history, prefetch, self.resident,
                                                         short_launches)
        except Cancelled:
            self.reset()
            raise
        except Exception:
            if self.host.copying:  # the history it was given is not all there: forgotten
                self.reset()
            raise
        finally:
            bar.close()
        densities = self.last_stats.density_per_layer
        if show_progress and densities and min(densities) < 1.0:  # a prompt it read whole: nothing to say
            shown = " ".join(f"{d:.2f}" for d in densities)
            print(f"[CompactAttention kept {sum(densities) / len(densities):.1%} of history blocks; "
                  f"per layer: {shown}]", file=sys.stderr)
        self.ids = list(prompt_ids)
        self.block_mass = self.last_stats.block_mass
        start = time.perf_counter()
        if kept is not None:
            kept.extend(history // self.layout.block_size, self.block_mass)
            self.decoder = kept
            self.last_decode_setup_parts = {}
        else:
            try:  # asked between its parts and layers too: a stop there forgets the cache as well
                self.decoder = self.new_decoder(alone, progress.check, reach)
            except Cancelled:
                self.reset()
                raise
            self.last_decode_setup_parts = self.decoder.setup_seconds
        self.last_decode_setup_seconds = time.perf_counter() - start
        return logits

    def new_decoder(self, capture: bool = True, between: Callable[[], None] = lambda: None,
                    reach: int | None = None) -> Decoder:
        """A decoder over the cache as it is, its graphs captured now (capture) or on its first
        step; between() and reach (its reach_tokens; max_seq_len by default): Decoder's."""
        decoder = Decoder(self.model, self.host, self.selection, self.local_windows_len, self.use_cuda_graph,
                          self.block_mass, self.resident, between, reach or self.max_seq_len)
        self.anchors.add(decoder)
        if capture:
            decoder.capture_graphs()
        return decoder

    def _new_prompt_room(self) -> int | None:
        """Device bytes a new prompt's prefill leaves for parked decoders and resident history
        (None on the CPU: no limit)."""
        if self.follow_up_headroom is None:
            return None
        return self.prefill_headroom - RESIDENT_MARGIN if self.prefill_headroom is not None else 0

    def _follow_up_room(self, num_new: int) -> tuple[bool, bool, int | None]:
        """(keep the decoder, prefetch the history, bytes left for resident history) for a
        follow-up of num_new tokens: the decoder stays if the follow-up's prefill (its hidden
        states, one chunk's workspace) fits the device memory the plan leaves beside it; the
        next layer's history loads ahead on a GPU if a second layer of pages fits too (beside
        the decoder, whether it stays or not: without it there is more room); what is left
        after both keeps parked decoders and layers' history on the device. The CPU has no limit
        (room None) and nothing to overlap."""
        has_decoder, on_gpu = self.decoder is not None, self.model.device.type == "cuda"
        if self.follow_up_headroom is None:
            return has_decoder, on_gpu, None
        c, act = self.model.config, self.model.dtype.itemsize
        need = (workspace_bytes(c, min(num_new, self.engine.chunk_size), self.layout, act)
                + num_new * c.hidden_size * act + staging_bytes(self.layout, len(self.ids)))
        keep = has_decoder and need <= self.follow_up_headroom
        prefetch = on_gpu and need + self.layout.page_bytes() <= self.follow_up_headroom
        room = self.follow_up_headroom - need - (self.layout.page_bytes() if prefetch else 0) - RESIDENT_MARGIN
        return keep, prefetch, room

    def step(self, token_id: int) -> torch.Tensor:
        logits = self.decoder.step(token_id)
        self.ids.append(token_id)
        return logits


class _ScaledProgress:
    """The engine reports tokens per layer; the bar counts prompt tokens. It is also where a
    prefill is stopped: after any chunk of any layer, and between the parts of its decoder's
    setup (`check`)."""

    def __init__(self, bar, scale, should_stop=None, on_progress=None):
        self.bar, self.scale, self.done, self.should_stop = bar, scale, 0.0, should_stop
        self.on_progress = on_progress
        self.stopping = False  # should_stop said so at a `pace`

    def pace(self):
        """Ask should_stop (a sliced prefill hands back there) inside work that cannot stop half-way;
        the next `check` raises if it said so."""
        self.stopping = self.stopping or (self.should_stop is not None and self.should_stop())

    def check(self):
        """Raise Cancelled if should_stop says so (now, or at a pace before)."""
        self.pace()
        if self.stopping:
            raise Cancelled

    def update(self, n):
        self.check()
        self.done += n * self.scale
        step = min(int(self.done + 1e-6), self.bar.total) - self.bar.n
        if step > 0:
            self.bar.update(step)
        if self.on_progress is not None:
            self.on_progress(min(int(self.done + 1e-6), self.bar.total), self.bar.total)


@dataclass(eq=False)  # one conversation is one object (ParkedDecoders finds them by identity)
class HeldConversation:
    """A conversation's cache and bookkeeping: the session's own, or one outside it that
    LongContextSession.exchange handed over, with the attributes a saved cache is written from
    (ktlong/session/saved_cache.py)."""
    layout: KVLayout
    host: HostKVCache
    ids: list[int]
    # global layer -> [KV, blocks]: the last prefill's attention mass per block (PrefillStats),
    # which decode's preselection reads; saved with the cache
    block_mass: dict
    # leading tokens unchanged since the cache was last saved or loaded (saved_cache.py sets it):
    # a save appends from the block this ends in
    stable_tokens: int
    saved_file: object  # saved_cache.SavedFile | None: the file last saved to or loaded from
    decoder: Decoder | None = None  # its device buffers and graphs read this host cache
    resident: ResidentHistory | None = None  # layers of its history the device keeps

    @classmethod
    def empty(cls, layout: KVLayout, host: HostKVCache) -> "HeldConversation":
        host.reset()
        return cls(layout, host, [], {}, 0, None)
