"""Conversations decoded together: one step runs every decoder of the batch (ktlong/decode/decoder.py)
through one device body (ktlong/decode/step.py), so the weights are read once per step
whatever the batch's size, while each conversation keeps its own window, anchors, selection
state and DRAM cache and reads its own blocks. A conversation decoded alone is a batch of one.

A step: each sequence's token and position go to the body; the device runs segment by
segment, and between segments the host does each sequence's part of the global layer (writes
its new K/V through to DRAM, selects its blocks, and the context attention reads them,
ktlong/decode/context_attention.py); or, where the device selects too, the token is one piece of
device work. Conversations join and leave between steps: a batch of as many other members takes the body
of the last batch of that size, and its graphs, where every part the graphs run finds a member
through the kernels' tables (`rebind`: the first step of the new members runs eagerly and writes
their places into the tables); otherwise it is another DecodeBatch, whose graphs are captured on
its first step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from ktlong.decode.context_attention import ContextAttention
from ktlong.decode.step import DecodeStep
from ktlong.kv.pinned import host_words

if TYPE_CHECKING:
    from ktlong.decode.decoder import Decoder

# what runs while a step's device work does (DecodeBatch.step): given a test of whether it is done
WhileWaiting = Callable[[Callable[[], bool]], None]


class DecodeBatch:
    def __init__(self, model, sequences: list["Decoder"], use_cuda_graph: bool):
        """sequences: the members, in the order of the batch's rows; the batch keeps their device
        parts through its body, not them (each step names them: `step`)."""
        self.body = body = DecodeStep(model, sequences, use_cuda_graph)
        self.global_layers = body.global_layers
        self.context = ContextAttention(body, body.layout.block_size, model.scale)
        if not body.writes_dram:  # [B, global layers, 2, KV, R] as DRAM stores them, for write_through
            self.new_kv, self.new_kv_scales = host_words(body.kv_host), host_words(body.kv_scales_host)
        self.scores = ([t.numpy() for t in body.scores_host] if body.scores_blocks and not body.device_selects
                       else None)
        self._while_waiting: WhileWaiting | None = None  # `step`'s, until its first wait

    def rebind(self, sequences: list["Decoder"]) -> bool:
        """Step these members from now on, with this batch's body and graphs, if it can
        (DecodeStep.rebindable: then its next step writes their tables and keeps the graphs)
        -> whether it did; the batch is left as it was otherwise."""
        if not self.body.rebindable(sequences):
            return False
        self.body.rebind(sequences)
        return True

    def release(self):
        """Let the members go until `rebind` names the next ones (the body's buffers and graphs stay)."""
        self.body.release()

    def _check(self, sequences: list["Decoder"]):
        assert len(sequences) == self.body.batch and all(
            s.window is w for s, w in zip(sequences, self.body.windows)), "a batch steps the members it was built for"

    @torch.inference_mode()
    def capture_graphs(self, sequences: list["Decoder"]):
        """Capture the CUDA graphs now (at the end of a prefill), so that no decode step pays for
        it. Capture runs the step of a placeholder token at each sequence's next position; the
        real step there writes the same window slots and exchange buffers again."""
        self._check(sequences)
        for s in sequences:
            s.follow_resident()
        if not self.body.ready:
            for b, s in enumerate(sequences):
                self.body.set_step(b, 0, s.host.num_tokens)
            self.body.capture()

    @torch.inference_mode()
    def step(self, sequences: list["Decoder"], tokens: list[int],
             while_waiting: WhileWaiting | None = None) -> torch.Tensor:
        """Run token b of each sequence b at its next position -> logits [B, vocab].
        while_waiting(done): called once, when the step's device work is queued and before the
        host first waits for it, with a test of whether that work is done (the server runs a
        slice of a prefill there, which the device then runs beside the step)."""
        self._check(sequences)
        self._while_waiting = while_waiting
        start = time.perf_counter()
        body = self.body
        positions = [s.position for s in sequences]
        ranges = [s.window.context_blocks for s in sequences]
        for b, (s, token, pos) in enumerate(zip(sequences, tokens, positions)):
            s.host.reserve(pos + 1)  # the token's K/V go to DRAM at pos: memory there first
            s.host.grow_ahead(pos + 1)  # and the next growth, a layer a step, before it is needed
            body.set_step(b, token, pos)
            if s.selection is not None:
                s.selection.set_step(s.step_index, *ranges[b])
            s.follow_resident()
        if not body.ready:
            body.capture()
        if body.device_selects:
            self._device_step(sequences, positions, ranges)
        else:
            body.replay(0)
            for j, layer in enumerate(self.global_layers):
                self._wait(sequences)  # segment j and its copies of q, k/v (and scores) to host memory
                if not body.writes_dram:
                    for b, (s, pos) in enumerate(zip(sequences, positions)):
                        s.write_through(layer, pos, self.new_kv[b, j], self.new_kv_scales[b, j])
                self._context_part(j, layer, sequences, ranges)
                body.replay(j + 1)
        for s, pos in zip(sequences, positions):
            s.window.copy_to_sink(pos)
        logits = body.logits.clone()
        for s, pos in zip(sequences, positions):
            s.end_step(pos, start)
        return logits

    def _wait(self, sequences: list["Decoder"]):
        if self._while_waiting is not None:
            work, self._while_waiting = self._while_waiting, None
            work(self.body.done)
        t0 = time.perf_counter()
        self.body.wait()
        waited = time.perf_counter() - t0
        for s in sequences:
            s.times.device_wait += waited

    def _device_step(self, sequences: list["Decoder"], positions: list[int], ranges: list[tuple[int, int]]):
        """A token the device runs alone (it selects and reads the blocks itself): one replay,
        one wait, then the new K/V of every global layer through to DRAM."""
        body = self.body
        body.replay_token()
        self._wait(sequences)
        selected_tokens, kept = body.selected_host.numpy(), body.kept_host.numpy()
        for b, (s, pos, (_, last)) in enumerate(zip(sequences, positions, ranges)):
            if not body.writes_dram:
                for j, layer in enumerate(self.global_layers):
                    s.write_through(layer, pos, self.new_kv[b, j], self.new_kv_scales[b, j])
            per_layer = selected_tokens[b].sum(1) // body.layout.block_size  # (kv head, block) pairs a layer
            selected = int(per_layer.sum())
            s.times.selected += selected
            s.times.device_read += selected
            s.times.near_read += sum(int(n) for j, n in enumerate(per_layer) if s.dram_blocks.covers(j, last))
            s.times.kept_read += int(kept[b]) if body.kept_dev is not None else 0

    def _context_part(self, j: int, layer: int, sequences: list["Decoder"], ranges: list[tuple[int, int]]):
        """Global layer j's context blocks of each sequence in its [first, last): selected by the
        host, attended by the context attention (the CPU operator, or the device reading DRAM)."""
        selections = []
        for b, (s, (first, last)) in enumerate(zip(sequences, ranges)):
            if last <= first:  # nothing in DRAM beyond the window yet
                selections.append(None)
                continue
            scores = None if self.scores is None else (lambda b=b: self.scores[b][j])
            t0 = time.perf_counter()
            selections.append(s.selector.select(layer, s.step_index, self.context.q[j, b], first, last, scores))
            s.times.selection += time.perf_counter() - t0
        t0 = time.perf_counter()
        read = self.context.attend(j, layer, sequences, selections, [last * self.body.layout.block_size for _, last in ranges])
        share = (time.perf_counter() - t0) / len(sequences)
        for s, selection, by_cpu, (_, last) in zip(sequences, selections, read, ranges):
            s.times.cpu_attention += share
            if selection is None:
                continue
            selected = int(selection[1].sum())
            s.times.kv_bytes += by_cpu * s.block_bytes
            s.times.selected += selected
            s.times.device_read += selected - by_cpu
            if s.dram_blocks is not None and not by_cpu and s.dram_blocks.covers(j, last):
                s.times.near_read += selected


class Batches:
    """The batch of the members stepping now, and the last batch of each other size with its
    members let go: its body and graphs wait for as many other members (DecodeBatch.rebind)."""

    def __init__(self, model, use_cuda_graph: bool):
        self.model, self.use_cuda_graph = model, use_cuda_graph
        self.members: list | None = None
        self.batch: DecodeBatch | None = None
        self._idle: dict[int, DecodeBatch] = {}

    def of(self, sequences: list["Decoder"]) -> tuple[DecodeBatch, str | None]:
        """The batch that steps these members -> (it, how it came: None for the last step's,
        "rebound" for the last of as many, "new" for one made for them)."""
        if self.members is not None and len(self.members) == len(sequences) and all(
                a is b for a, b in zip(self.members, sequences)):
            return self.batch, None
        self.let_go()
        batch = self._idle.pop(len(sequences), None)
        how = "rebound" if batch is not None and batch.rebind(sequences) else "new"
        if how == "new":
            batch = DecodeBatch(self.model, sequences, self.use_cuda_graph)
        self.members, self.batch = list(sequences), batch
        return batch, how

    def let_go(self):
        """The running batch lets its members go; kept for as many others where its graphs may
        serve them (the device selects)."""
        if self.batch is not None:
            self.batch.release()
            if self.batch.body.device_selects:
                self._idle[len(self.members)] = self.batch
            self.members, self.batch = None, None

    def clear(self):
        """Every batch goes, with the device buffers and graphs its body holds."""
        self.members, self.batch = None, None
        self._idle.clear()
