"""The thread that owns the model and schedules the requests on it.

Requests wait in a bounded queue. Up to `max_num_seqs` of them run at once: each step decodes
one token of every running answer together (LongContextSession.step_batch: one pass over the
weights for all of them, each conversation reading its own blocks; ktlong/decode/batch.py),
and answers join and leave between steps. One request at a time prefills, a slice in each
step (ktlong/session/sliced_prefill.py: `prefill_slice_ms` of work, then its next chunk
boundary), run while the device works on the step's tokens, so the streams that decode keep
going while a long prompt prefills, and the prefill's chunks run beside their steps on the
device (whose own work comes first: the worker's stream has the higher priority); when nothing
decodes, the prefill runs on without pausing. A prefilled conversation decodes where it is,
in the session, until the next prefill needs the session: then it leaves (CacheStore.detach,
into a cache of its own) and, once its answer is done, is held like any kept conversation
(CacheStore.release), so a follow-up finds it. So at most max_num_seqs caches are in use,
and with `max_num_seqs: 1`, or a session that decodes one conversation at a time (dense, or a
model whose sliding-window layers the cache store cannot keep), the next prefill waits for the
answer in the session to end. A request starts when its cache fits in DRAM
(CacheStore.admit) and its decoder's anchors fit on the device beside the running answers'
(ktlong/session/anchors_pool.py); otherwise it waits for answers to end.

The event loop talks to a request through its Ticket (ktlong/server/reply.py): the worker puts
the answer's text pieces and then an Outcome (or an ApiError) on it; the loop cancels it when
the client goes away, which stops the prefill after its current chunk (or lets it finish into
the cache, `finish_prefill_on_disconnect`) or the answer before its next token.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from ktlong.chat.constrained import SchemaError
from ktlong.errors import Cancelled, KtlongError
from ktlong.server.cache_store import CacheStore, Entry
from ktlong.server.gc_passes import FullPasses
from ktlong.server.metrics import ServerMetrics
from ktlong.server.protocol import ApiError, Job
from ktlong.server.reply import Reply, Ticket
from ktlong.session.protocol import Session
from ktlong.session.sliced_prefill import SlicedPrefill, decode_first


SETUP_PARTS_FROM = 0.5  # seconds of a decoder's setup from which the log names its parts
LONGEST = 3  # the longest steps beside a prefill that the log names
LONG_STEP = 0.1  # a step beside a prefill longer than this is counted by what it was spent on


class QueueFull(Exception):
    pass


@dataclass
class Prefilling:
    reply: Reply
    prefill: SlicedPrefill
    cached_from: str | None  # where the reused prompt tokens come from (CacheStore.prepare)
    admitted: float  # when it left the queue (perf_counter)
    moved: float  # seconds the cache store took to make the session hold its conversation
    # the garbage collector's full passes (every thread waits for one): counted on while it runs,
    # from the count and seconds they had at its start
    gc: FullPasses
    gc_from: tuple[int, float]
    # beside decoding answers: the steps that ran while it prefilled, their seconds less its
    # slices', and its slices' seconds inside them (how the device's time went, in the log)
    steps: int = 0
    step_seconds: float = 0.0
    slice_seconds: float = 0.0
    # the LONGEST steps beside it (what the streams waited between two tokens), each as
    # (seconds, its slice's, the prefill thread's work and waits in it, its chunk boundary at the end)
    longest: list = field(default_factory=list)
    # steps over LONG_STEP, by the most of their time: the prefill thread's work, its waits for the
    # device, a part of the step the worker tells apart (`count`'s own), or the rest of the step
    # (what the p99 between tokens is made of)
    long_steps: Counter = field(default_factory=Counter)
    own_seconds: Counter = field(default_factory=Counter)  # the parts the worker tells apart, over every step

    def count(self, seconds: float, in_slice: float, work: float, waits: float, own: dict[str, float]):
        """One step beside the prefill, of `seconds` in all, `in_slice` of them its slice; own: the
        parts of the rest that the worker tells apart (seconds by what they were)."""
        self.steps += 1
        self.step_seconds += seconds - in_slice
        self.slice_seconds += in_slice
        self.own_seconds.update(own)
        self.longest = sorted(self.longest + [(seconds, in_slice, work, waits, self.prefill.boundaries)],
                              reverse=True)[:LONGEST]
        if seconds > LONG_STEP:
            parts = {"its thread's work": work, "its thread's waits": waits, **own,
                     "the step's own": seconds - in_slice - sum(own.values())}
            self.long_steps[max(parts, key=parts.get)] += 1

    def account(self) -> str:
        """How its steps' time went, for the log line of its end."""
        longest = ", ".join(f"{s * 1000:.0f} ms (slice {sl * 1000:.0f}: {w * 1000:.0f} at work, {wt * 1000:.0f} "
                            f"waiting; at chunk {at:,})" for s, sl, w, wt, at in self.longest)
        own = ", ".join(f"{what} {s:.2f} s" for what, s in sorted(self.own_seconds.items(), key=lambda kv: -kv[1]))
        return (f"beside {self.steps} decode steps of {self.step_seconds * 1000 / self.steps:.1f} ms each"
                f"{f' (in all: {own})' if own else ''}, its slices {self.slice_seconds * 1000 / self.steps:.1f} ms "
                f"a step; its thread "
                f"{self.prefill.work_seconds:.1f} s at work, {self.prefill.wait_seconds:.1f} s waiting for the "
                f"device; the longest steps {longest}; {sum(self.long_steps.values())} over "
                f"{LONG_STEP * 1000:.0f} ms" + "".join(f", {n} mostly {what}" for what, n in
                                                      sorted(self.long_steps.items(), key=lambda kv: -kv[1]))
                + f"; the garbage collector's full passes {self.gc.count - self.gc_from[0]}, "
                  f"{(self.gc.seconds - self.gc_from[1]) * 1000:.0f} ms in all")


@dataclass
class Row:
    """A running answer: the next token to decode, and where its conversation is."""
    reply: Reply
    token: int
    conversation: object  # its HeldConversation (the session's own, or detached); None: a dense session's
    entry: Entry | None  # its cache store entry, once detached
    prefilled: int  # prompt tokens the prefill computed
    cached: int  # prompt tokens that came from the cache
    cached_from: str | None
    density: float | None
    timing: str = ""  # how its start went, for the log line of its end


class Worker:
    def __init__(self, session: Session, tokenizer, queue_size: int, log=None, finish_prefill: bool = True,
                 store: CacheStore | None = None, max_num_seqs: int = 1, prefill_slice_seconds: float = 0.05):
        """finish_prefill: a request whose client went away during prefill finishes the prefill
        into the cache (its retry reuses it) and stops before the first token. store: the
        conversations kept besides the session's (None: only the session's); answers decode
        together only with one. prefill_slice_seconds: a prefill's work between two decode steps."""
        self.session, self.tokenizer, self.queue_size = session, tokenizer, queue_size
        self.finish_prefill, self.store, self.slice_seconds = finish_prefill, store, prefill_slice_seconds
        self.max_rows = max_num_seqs if store is not None else 1
        dram = store.dram_bytes if store is not None else lambda: session.cache_bytes
        disk = store.disk_bytes if store is not None else lambda: 0
        self.metrics = ServerMetrics(queue_depth=lambda: self.status()["waiting"],
                                     running=lambda: self.status()["running"], dram_bytes=dram, disk_bytes=disk)
        self.log = log or sys.stderr
        self.gc = FullPasses()  # for the log's account of a prefill beside decoding answers
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.counts: Counter = Counter()  # completed, cancelled, rejected, failed
        self.prefilled_tokens = 0  # over all requests: tokens computed by prefill
        self.cached_tokens = 0  # over all requests: prompt tokens served from the cache
        self.tickets: set[Ticket] = set()  # admitted and not finished: running and waiting
        self.waiting: deque[tuple[Job, Ticket]] = deque()
        self.calls: deque[tuple[Future, object, tuple]] = deque()  # to run on this thread between steps
        self.running = 0  # prefilling or decoding
        self.closing = threading.Event()
        self.stopped = False
        # the worker thread's own (read under the lock by the wait in _loop)
        self.prefilling: Prefilling | None = None
        self.rows: list[Row] = []
        self.thread = threading.Thread(target=self._loop, name="ktlong-generate", daemon=True)
        self.thread.start()

    # ---- what the event loop calls ----

    def submit(self, job: Job, loop) -> Ticket:
        """Queue a job, or raise QueueFull when queue_size requests already wait beyond those
        that can start now."""
        ticket = Ticket(loop)
        with self.lock:
            if self.closing.is_set():
                raise ApiError(503, "The server is shutting down; retry when it is back.", kind="server_error",
                               code="server_shutting_down")
            if len(self.waiting) >= self.queue_size + max(self.max_rows - self.running, 0):
                self.counts["rejected"] += 1
                raise QueueFull
            self.tickets.add(ticket)
            self.waiting.append((job, ticket))
            self.wake.notify()
        return ticket

    def shutdown(self):
        """Stop what runs and what waits (a prefill after its current chunk, an answer before its
        next token): each gets an error saying the server is shutting down."""
        with self.lock:
            self.closing.set()
            for ticket in self.tickets:
                ticket.cancel()
            self.wake.notify()

    def status(self) -> dict:
        with self.lock:
            return {"generating": self.running > 0, "running": self.running, "waiting": len(self.waiting),
                    "max_num_seqs": self.max_rows, "queue_size": self.queue_size,
                    "requests": {k: self.counts[k] for k in ("completed", "cancelled", "rejected", "failed")},
                    "prefilled_tokens": self.prefilled_tokens, "cached_tokens": self.cached_tokens}

    def call(self, fn, *args) -> Future:
        """Run fn on the thread that owns the session, between steps and outside any prefill."""
        future = Future()
        with self.lock:
            self.calls.append((future, fn, args))
            self.wake.notify()
        return future

    def close(self):
        """Stop, then write the conversations kept in DRAM to disk (with a cache_dir)."""
        self.shutdown()
        if self.store is not None:
            self.call(self.store.close).exception()
        with self.lock:
            self.stopped = True
            self.wake.notify()
        self.thread.join()
        self.gc.close()

    # ---- the worker's thread ----

    def _loop(self):
        with decode_first(getattr(self.session, "device", None)):
            self._serve()

    def _serve(self):
        while True:
            with self.lock:
                while not (self.calls and self.prefilling is None) and not self.rows and self.prefilling is None \
                        and not (self.waiting and len(self.rows) < self.max_rows):
                    if self.stopped:
                        return
                    self.wake.wait()
                calls = [] if self.prefilling is not None else list(self.calls)
                if calls:
                    self.calls.clear()
            for future, fn, args in calls:
                self._call(future, fn, args)
            try:
                if self.prefilling is None and len(self.rows) < self.max_rows:
                    self._admit()
                if self.rows:
                    self._decode_step()  # and a slice of the prefill, if one runs, while the device steps
                elif self.prefilling is not None:
                    self._prefill_slice()
            except Exception as e:  # the worker's own failure: its answers are told, the thread goes on
                self._fail_all(e)

    def _call(self, future: Future, fn, args):
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    def _admit(self):
        """The first waiting request starts its prefill."""
        with self.lock:
            if not self.waiting:
                return
            job, ticket = self.waiting[0]
        answer_room = min(job.max_tokens, self.session.max_seq_len - len(job.prompt_ids))
        fits = getattr(self.session, "decoder_fits", None)  # its decoder beside the running answers' (device memory)
        if self.rows and fits is not None and not ticket.cancelled.is_set() and not fits(
                len(job.prompt_ids) + answer_room, [r.conversation for r in self.rows if r.conversation is not None]):
            return  # it waits for their answers to end
        if (self.store is not None and not ticket.cancelled.is_set()
                and not self.store.admit(job.prompt_ids, len(job.prompt_ids) + answer_room, alone=not self.rows)):
            return  # it waits for DRAM: the running answers end and free theirs
        with self.lock:
            self.waiting.popleft()
            self.running += 1
        if ticket.cancelled.is_set():  # the client left while it waited
            self._cancelled(ticket)
            return
        admitted = time.perf_counter()
        try:
            for row in self.rows:  # the session's own conversation decodes on, in a cache of its own
                if row.conversation is getattr(self.session, "conversation", None):
                    row.entry, _ = self.store.detach()
            reply = Reply(job, ticket, self.tokenizer, answer_room)  # SchemaError: a grammar llguidance refuses
            cached_from = self.store.prepare(job.prompt_ids) if self.store is not None else "session"
        except Exception as e:
            self._done(ticket, "failed")
            ticket.put(self._error(e))
            return
        stop = lambda: self.closing.is_set() or (ticket.cancelled.is_set() and not self.finish_prefill)

        def run(pause):
            def should_stop():
                pause()
                return stop()
            return self.session.prefill(job.prompt_ids, False, should_stop, reply.progress if job.progress else None,
                                        alone=not self.rows, answer_room=answer_room, short_launches=sliced.turns)

        sliced = SlicedPrefill(run, self.slice_seconds, lambda: bool(self.rows), getattr(self.session, "device", None),
                               getattr(self.session, "prefill_sms", 0))
        self.prefilling = Prefilling(reply, sliced, cached_from, admitted, time.perf_counter() - admitted, self.gc,
                                     (self.gc.count, self.gc.seconds))

    def _prefill_slice(self):
        if self.prefilling.prefill.advance():
            self._prefilled()

    def _prefilled(self):
        """The prefill ended: its answer's first token, and its row joins the next step."""
        p = self.prefilling
        self.prefilling = None
        reply, session = p.reply, self.session
        prefilled = session.last_prefill_tokens
        row = Row(reply, 0, None, None, prefilled, len(reply.job.prompt_ids) - prefilled, p.cached_from,
                  session.prefill_density)
        notes = []  # of the prefill's time: its decoder's setup (by part when long), the steps beside it
        setup = getattr(session, "last_decode_setup_seconds", None)
        if setup is not None:
            parts = getattr(session, "last_decode_setup_parts", {}) if setup >= SETUP_PARTS_FROM else {}
            named = ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts.items())
            notes.append(f"of it the decoder's setup {setup:.2f} s" + (f": {named}" if named else ""))
        if p.steps:
            notes.append(p.account())
        row.timing = (f"queued {p.admitted - reply.ticket.queued_at:.2f} s, cache moved {p.moved:.2f} s, prefill "
                      f"{time.perf_counter() - p.admitted - p.moved:.2f} s"
                      + (f" ({'; '.join(notes)})" if notes else ""))
        if p.prefill.error is not None:
            self._finish(row, p.prefill.error)
            return
        try:
            token = reply.first(p.prefill.result)
        except Exception as e:
            self._finish(row, e)
            return
        if token is None:
            self._finish(row)
            return
        row.token, row.conversation = token, getattr(session, "conversation", None)
        if self.store is not None:
            self.store.answering()
        self.rows.append(row)

    def _decode_step(self):
        """One token of every running answer; a prefill's next slice runs while the device works
        on the step (its chunks beside the step's on the device, the host's part of both in
        turn; the slice until the step is done, if that is longer), or after it where the step
        never waits."""
        rows = self.rows
        tokens = [r.token for r in rows]
        p, start = self.prefilling, time.perf_counter()
        work, waits = (p.prefill.work_seconds, p.prefill.wait_seconds) if p is not None else (0.0, 0.0)
        ended: bool | None = None  # whether the prefill ended, once its slice ran
        in_slice = 0.0  # the slice's seconds

        def prefill_slice(step_done):
            nonlocal ended, in_slice
            t0 = time.perf_counter()
            ended = p.prefill.advance(step_done)
            in_slice = time.perf_counter() - t0

        beside = prefill_slice if p is not None else None
        own = {}  # parts of the step's own time, by what they were (Prefilling.count)
        if p is not None:  # where the two take turns on the device: the step after the chunks queued so far
            p.prefill.before_step()
        try:
            if rows[0].conversation is None:
                logits = self.session.step(tokens[0])[None]
            else:
                logits = self.session.step_batch([r.conversation for r in rows], tokens, beside)
                own["the blocks its answers filled"] = self.session.last_step_filled
                if (built := self.session.last_batch_build) is not None:
                    self.session.last_batch_build = None
                    own["a new batch's graphs"] = built
                    how = ("the body and graphs of the last batch of as many, rebound" if self.session.last_batch_rebound
                           else "a body of its own, its graphs captured first where there are any")
                    print(f"[decoding {len(rows)} conversations together: their new batch's first step {built:.2f} s "
                          f"({how})]", file=self.log, flush=True)
        except Exception as e:  # the whole step failed: every answer in it ends
            self.rows = []
            for row in rows:
                self._finish(row, e)
            self._prefill_after(ended)
            return
        going, stepped = [], time.perf_counter()
        for b, row in enumerate(rows):
            try:
                token = row.reply.answer.next(logits[b])
            except Exception as e:
                self._finish(row, e)
                continue
            if token is None:
                self._finish(row)
            else:
                row.token = token
                going.append(row)
        self.rows = going
        if p is not None:
            own["its answers' tokens"] = time.perf_counter() - stepped  # sampled, their text sent
            p.count(time.perf_counter() - start, in_slice, p.prefill.work_seconds - work,
                    p.prefill.wait_seconds - waits, own)
        self._prefill_after(ended)

    def _prefill_after(self, ended: bool | None):
        """After a step: the prefill's slice if the step did not run it (ended None), and its end
        if it came."""
        if self.prefilling is None:
            return
        if ended is None:
            self._prefill_slice()
        elif ended:
            self._prefilled()

    def _finish(self, row: Row, error: BaseException | None = None):
        """An answer ended (done, cancelled or failed): its conversation kept, its figures
        counted, its client told."""
        reply, ticket = row.reply, row.reply.ticket
        if self.store is not None:
            if row.entry is not None:
                self.store.release(row.entry, row.conversation, keep=error is None)
            else:
                self.store.finished()
        answered = len(reply.answer.token_ids)
        first = reply.first_token_at or time.perf_counter()
        seconds = time.perf_counter() - first
        cached = f"{row.cached:,} cached from the {row.cached_from}" if row.cached else "none cached"
        print(f"[answer: {answered} tokens after {row.prefilled + row.cached:,} prompt tokens ({cached}): "
              f"{row.timing}; first token {first - reply.ticket.queued_at:.2f} s after the request came, then "
              f"{max(answered - 1, 0) / seconds if seconds > 0 else 0:.1f} tok/s]", file=self.log, flush=True)
        self.metrics.finished(row.prefilled, row.cached, row.cached_from, answered, first - reply.start,
                              time.perf_counter() - first, row.density)
        with self.lock:
            self.prefilled_tokens += row.prefilled
            self.cached_tokens += row.cached
        if isinstance(error, Cancelled) or (error is None and reply.cancelled):
            self._cancelled(ticket)
        elif error is not None:  # counted before the client hears: a /health right after sees it
            self._done(ticket, "failed")
            ticket.put(self._error(error))
        else:
            self._done(ticket, "completed")
            ticket.put(reply.outcome(row.cached, row.cached_from))

    def _cancelled(self, ticket: Ticket):
        """The client left (nobody to tell), or the server is shutting down (the stream ends with that)."""
        self._done(ticket, "cancelled")
        if self.closing.is_set():
            ticket.put(ApiError(503, "The server is shutting down; this answer was cut short.",
                                kind="server_error", code="server_shutting_down"))

    def _error(self, error: BaseException) -> ApiError:
        if isinstance(error, SchemaError):  # the schema grew past llguidance's limits part way through
            return ApiError(400, str(error), "response_format")
        if isinstance(error, KtlongError):
            return ApiError(500, str(error), kind="server_error")
        # never a traceback to the client; the operator gets it
        traceback.print_exception(type(error), error, error.__traceback__, file=self.log)
        return ApiError(500, "The server failed while generating; its log has the details.", kind="server_error")

    def _fail_all(self, error: Exception):
        """After a failure of the worker itself: the answers decoding end with an error (a
        prefill goes on: what it raises ends its own request)."""
        rows, self.rows = self.rows, []
        for row in rows:
            self._finish(row, error)

    def _done(self, ticket: Ticket, result: str):
        with self.lock:
            self.counts[result] += 1
            self.tickets.discard(ticket)
            self.running -= 1
        self.metrics.requests.labels(result).inc()
