"""One request's answer as the server makes it, token by token, whichever batch row it decodes
in: its Answer (sampling with its own seed, its grammar, its length), its stop strings and tool
calls read out of the text, and what goes to the client through its Ticket: text pieces, each
token's logprobs, prefill progress, then its tool calls and an Outcome (or an ApiError).
The worker (ktlong/server/worker.py) feeds it the logits of its row."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from ktlong.chat.answer import Answer
from ktlong.chat.constrained import JsonConstraint
from ktlong.chat.logprobs import token_logprob
from ktlong.chat.sampling import Sampler
from ktlong.server.protocol import Job
from ktlong.server.stop_strings import StopStrings
from ktlong.server.tool_calls import ToolCallStream

PROGRESS_EVERY = 0.5  # seconds between progress events (a prefill reports after every chunk of every layer)


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # stop | length | tool_calls (a cancelled request has nobody to tell)
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


@dataclass(frozen=True)
class ToolCalls:
    """The answer's tool calls, read out of its text once it is done (before its Outcome)."""
    calls: list


class Ticket:
    """A request's mailbox between the worker thread and the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()  # made when the request is queued

    def put(self, event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self):
        self.cancelled.set()


class Reply:
    def __init__(self, job: Job, ticket: Ticket, tokenizer, max_new_tokens: int):
        """max_new_tokens: what the request asked for, within what the context leaves. Raises
        SchemaError for a grammar llguidance refuses (its first mask is made here)."""
        self.job, self.ticket = job, ticket
        self.stops = StopStrings(job.stop)
        self.tools = ToolCallStream(job.tools, job.tool_names, job.forced) if job.tools is not None else None
        constraint = JsonConstraint(tokenizer, job.grammar) if job.grammar is not None else None
        sampler = Sampler(job.temperature, job.top_p, job.top_k, job.seed, job.presence_penalty,
                          job.frequency_penalty, job.logit_bias)
        self.answer = Answer(max_new_tokens, sampler, tokenizer.stop_ids, tokenizer, self._text,
                             should_stop=lambda: ticket.cancelled.is_set() or self.stops.hit,
                             on_token=self._logprob if job.logprobs is not None else None, constraint=constraint)
        self.start = time.perf_counter()
        self.first_token_at: float | None = None  # when the prefill's logits gave the first token
        self._shown = 0.0

    def _text(self, piece: str):
        text = self.stops.push(piece)
        if self.tools is not None:
            text = self.tools.push(text)
        if text:
            self.ticket.put(text)

    def _logprob(self, token: int, logits):  # a TokenLogprob precedes its token's text
        self.ticket.put(token_logprob(logits, token, self.job.logprobs))

    def progress(self, done: int, total: int):
        """The prefill's progress, every PROGRESS_EVERY seconds and at its end (return_progress)."""
        now = time.perf_counter() - self.start
        if done == total or now - self._shown >= PROGRESS_EVERY:
            self._shown = now
            self.ticket.put(Progress(done, total, now))

    def first(self, logits) -> int | None:
        """The answer's first token from the prefill's logits (None: it ended there)."""
        self.first_token_at = time.perf_counter()
        return self.answer.next(logits)

    @property
    def cancelled(self) -> bool:
        return self.ticket.cancelled.is_set()

    def outcome(self, cached: int, cached_from: str | None) -> Outcome:
        """The end of an answer that was not cancelled: what the stop strings and the tool-call
        reader held back, then its tool calls; the Outcome to send last."""
        tail, calls = self.stops.flush(), []
        if self.tools is not None:
            tail = self.tools.push(tail)
            rest, calls = self.tools.finish()
            tail += rest
            calls = calls if self.job.parallel_calls else calls[:1]
        if tail:
            self.ticket.put(tail)
        if calls:
            self.ticket.put(ToolCalls(calls))
        finish = ("tool_calls" if calls else
                  "stop" if self.stops.hit or self.answer.finish_reason == "stop" else "length")
        return Outcome(finish, len(self.job.prompt_ids), len(self.answer.token_ids), cached,
                       cached_from if cached else None)
