"""One model, one session, one generation at a time: requests wait in a bounded queue and run
in order on a single thread that owns the model. The session keeps its KV cache between
requests, so a conversation that extends the previous one prefills only its new tokens.

The event loop talks to a request through its `Ticket`: the worker puts the answer's text
pieces and then an `Outcome` (or an `ApiError`) on it; the loop cancels it when the client goes away, which
stops the prefill after its current chunk or the decode before its next token.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ktlong.chat.constrained import JsonConstraint, SchemaError
from ktlong.chat.generate import generate
from ktlong.chat.logprobs import token_logprob
from ktlong.chat.sampling import Sampler
from ktlong.errors import KtlongError
from ktlong.session.protocol import Session
from ktlong.server.cache_store import CacheStore
from ktlong.server.metrics import ServerMetrics
from ktlong.server.protocol import ApiError, Job
from ktlong.server.stop_strings import StopStrings
from ktlong.server.tool_calls import ToolCallStream


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # stop | length (a cancelled request has nobody to tell)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose K/V the session already held
    cached_from: str | None  # where those came from: session, dram or disk (ktlong/server/cache_store.py)


@dataclass
class Progress:
    """A long prefill's progress: prompt tokens computed so far of those it computes."""
    done: int
    total: int
    elapsed: float


PROGRESS_EVERY = 0.5  # seconds between progress events (a prefill reports after every chunk of every layer)


@dataclass(frozen=True)
class ToolCalls:
    """The answer's tool calls, read out of its text once it is done (before its Outcome)."""
    calls: list


class QueueFull(Exception):
    pass


class Ticket:
    """A request's mailbox between the worker thread and the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self):
        self.cancelled.set()


class Worker:
    def __init__(self, session: Session, tokenizer, queue_size: int, log=None, finish_prefill: bool = True,
                 store: CacheStore | None = None):
        """finish_prefill: a request whose client went away during prefill finishes the prefill
        into the cache (its retry reuses it) and stops before the first token. store: the
        conversations kept besides the session's (None: only the session's)."""
        self.session, self.tokenizer, self.queue_size = session, tokenizer, queue_size
        self.finish_prefill, self.store = finish_prefill, store
        dram = store.dram_bytes if store is not None else lambda: session.cache_bytes
        disk = store.disk_bytes if store is not None else lambda: 0
        self.metrics = ServerMetrics(queue_depth=lambda: self.status()["waiting"], dram_bytes=dram, disk_bytes=disk)
        self.log = log or sys.stderr
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ktlong-generate")
        self.lock = threading.Lock()
        self.counts: Counter = Counter()  # completed, cancelled, rejected, failed
        self.prefilled_tokens = 0  # over all requests: tokens computed by prefill
        self.cached_tokens = 0  # over all requests: prompt tokens served from the cache
        self.tickets: set[Ticket] = set()  # admitted and not finished: the one generating and those waiting
        self.closing = threading.Event()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Admit a job, or raise QueueFull when queue_size requests already wait."""
        ticket = Ticket(loop)
        with self.lock:
            if self.closing.is_set():
                raise ApiError(503, "The server is shutting down; retry when it is back.", kind="server_error",
                               code="server_shutting_down")
            if len(self.tickets) > self.queue_size:
                self.counts["rejected"] += 1
                raise QueueFull
            self.tickets.add(ticket)
        self.executor.submit(self._run, job, ticket)
        return ticket

    def shutdown(self):
        """Stop what runs and what waits (the generation after its current chunk or token): each
        gets an error saying the server is shutting down, so that a stream ends with it."""
        with self.lock:
            self.closing.set()
            for ticket in self.tickets:
                ticket.cancel()

    def status(self) -> dict:
        with self.lock:
            busy = min(len(self.tickets), 1)
            return {"generating": bool(busy), "waiting": len(self.tickets) - busy, "queue_size": self.queue_size,
                    "requests": {k: self.counts[k] for k in ("completed", "cancelled", "rejected", "failed")},
                    "prefilled_tokens": self.prefilled_tokens, "cached_tokens": self.cached_tokens}

    def call(self, fn, *args):
        """Run fn on the thread that owns the session, after what is running; a future."""
        return self.executor.submit(fn, *args)

    def close(self):
        """Stop, then write the conversations kept in DRAM to disk (with a cache_dir)."""
        self.shutdown()
        if self.store is not None:
            self.executor.submit(self.store.close)
        self.executor.shutdown(wait=True, cancel_futures=False)

    def _run(self, job: Job, ticket: Ticket):
        result = "failed"
        try:
            outcome = None if ticket.cancelled.is_set() else self._generate(job, ticket)  # set: the client left
            result = "cancelled" if outcome is None else "completed"
            if outcome is None and self.closing.is_set():
                ticket.put(ApiError(503, "The server is shutting down; this answer was cut short.",
                                    kind="server_error", code="server_shutting_down"))
            elif outcome is not None:
                ticket.put(outcome)
        except SchemaError as e:  # the schema grew past llguidance's limits part way through
            ticket.put(ApiError(400, str(e), "response_format"))
        except KtlongError as e:
            ticket.put(ApiError(500, str(e), kind="server_error"))
        except Exception:  # never a traceback to the client; the operator gets it
            traceback.print_exc(file=self.log)
            ticket.put(ApiError(500, "The server failed while generating; its log has the details.",
                                kind="server_error"))
        finally:
            with self.lock:
                self.counts[result] += 1
                self.tickets.discard(ticket)
            self.metrics.requests.labels(result).inc()

    def _generate(self, job: Job, ticket: Ticket) -> Outcome | None:
        stops = StopStrings(job.stop)
        held = ToolCallStream(job.tools, job.tool_names, job.forced) if job.tools is not None else None

        def on_text(piece: str):
            text = stops.push(piece)
            if held is not None:
                text = held.push(text)
            if text:
                ticket.put(text)

        sampler = Sampler(job.temperature, job.top_p, job.top_k, job.seed)
        start, last = time.perf_counter(), [0.0]

        def on_progress(done: int, total: int):
            now = time.perf_counter() - start
            if done == total or now - last[0] >= PROGRESS_EVERY:
                last[0] = now
                ticket.put(Progress(done, total, now))

        def on_token(token: int, logits):  # a TokenLogprob precedes its token's text
            ticket.put(token_logprob(logits, token, job.logprobs))

        where = self.store.prepare(job.prompt_ids) if self.store is not None else "session"
        constraint = JsonConstraint(self.tokenizer, job.grammar) if job.grammar is not None else None
        gen = generate(self.session, job.prompt_ids, job.max_tokens, sampler, self.tokenizer.stop_ids,
                       self.tokenizer, on_text=on_text, on_token=on_token if job.logprobs is not None else None,
                       should_stop=lambda: ticket.cancelled.is_set() or stops.hit,
                       on_progress=on_progress if job.progress else None,
                       should_stop_prefill=lambda: self.closing.is_set() or (ticket.cancelled.is_set()
                                                                             and not self.finish_prefill),
                       constraint=constraint)
        cached = len(job.prompt_ids) - self.session.last_prefill_tokens
        if self.store is not None:
            self.store.finished()
        with self.lock:
            self.prefilled_tokens += self.session.last_prefill_tokens
            self.cached_tokens += cached
        self.metrics.finished(self.session.last_prefill_tokens, cached, where, len(gen.token_ids), gen.prefill_seconds,
                              gen.decode_seconds, self.session.prefill_density)
        if ticket.cancelled.is_set():
            return None
        tail, calls = stops.flush(), []
        if held is not None:
            tail = held.push(tail)
            rest, calls = held.finish()
            tail += rest
            calls = calls if job.parallel_calls else calls[:1]
        if tail:
            ticket.put(tail)
        if calls:
            ticket.put(ToolCalls(calls))
        finish = "tool_calls" if calls else "stop" if stops.hit or gen.finish_reason == "stop" else "length"
        return Outcome(finish, len(job.prompt_ids), len(gen.token_ids), cached, where if cached else None)
