"""A prefill run a slice at a time, between the decode steps of other conversations.

A layer-major prefill is one long call that asks `should_stop` after every chunk of every layer
(LongContextSession.prefill). Here it runs on a thread of its own that hands control back and
forth with its owner's thread: `advance` lets it run until it has worked `slice_seconds` (or
`more_work` says nothing else waits) and reaches its next chunk boundary, then waits there for
the next `advance`. Only one of the two threads runs at any time, so the session's state is
never touched by both at once.

On a GPU the prefill queues its work on a stream of its own, so that its chunks and the decode
steps between its slices run side by side on the device (the chunks are compute-bound, the steps
wait on PCIe), and a step does not wait behind the chunks queued before it. The host queues
faster than the device runs: counted in host time and on one stream, a 50 ms slice had left up to
150 ms of chunks in front of the next step (four streams at 5 tok/s each beside a 1M prefill).
So while others wait the host keeps at most AHEAD chunks in flight (a fence at each boundary),
which go on running through the steps; the prefill's results are complete (its stream
synchronised) before the owner reads them, and its first work waits for what the owner queued
before it. While its host waits for its oldest chunk it hands back as soon as its slice is over,
not at the chunk's end: the chunks of a 1M prefill's last layers run for tens of milliseconds,
which the next step's tokens would otherwise wait for too.

The owner runs a slice while the device works on its step (ktlong/server/worker.py), so both
kinds of work share the device, and its stream has the highest priority (`decode_first`): a
step's kernels go ahead of the chunks' waiting ones, so the chunks take what the steps leave. The
slice lasts slice_seconds, or until the step's device work is done if that is later: the owner
would only wait for it, and the prefill goes at its host's share of the time.
Beside decoding answers the prefill's kernels run on a CUDA green context of `prefill_sms` SMs
(the plan's, from `decode_sm_share`), so the steps' kernels always find SMs free: a running
block of a prefill's kernel is never preempted, and with every SM shared a step's kernels
queued behind them one after another. On the H200, four streams beside a 1M prefill: p99
between tokens 269 -> 103 ms, 62 -> 97 tok/s in all, the prefill 133 -> 155 s (112 of 132 SMs:
more than 15% longer, as FlashInfer's fa3 plans its persistent CTAs for every SM of the device).
Without a green context (`prefill_sms` 0, or the driver's refusal) the two take turns on the
device instead: a slice's chunks wait for the step it ran beside, and the next step for the
chunks the slice queued (TURNS_AHEAD of them in flight at most; the owner calls `before_step`),
so a step runs on every SM with no prefill kernel in its way, and the prefill on every SM between
the steps. The owner's other work (its answers' tokens, read from the step's logits) waits for
none of the chunks: the device runs them while the owner's host makes the next step. The
prefill keeps its launches short there (LayerMajorPrefill's short_launches): a step waits for
the one in flight. On the H200, four streams beside a 1M prefill taking turns (without short
launches): the prefill 1.30x of alone, but p99 between tokens 270 ms, where a dense layer's last
chunks ran for 100-290 ms each.
A prefill that starts with nothing decoding keeps every SM to its end (its streams are chosen
once: the prefill records work on the stream it started on).
The prefill thread's own time is counted as work (its chunks' host part) or waits (for its oldest
chunk, or for the owner's step), which the server's log line gives: a long slice is the host's or
the device's. On the H200 (four streams beside a 1M prefill, 8B shapes): slices of 50 ms between the steps,
at one priority, gave 7.8 tok/s each and a 151.4 s prefill; slices of 30 ms inside them, 10.2
tok/s and 215.8 s (docs/measurements/2026-12-01-serving.md).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator

import torch

from ktlong.errors import first_line

AHEAD = 3  # chunks of a prefill in flight on the device at most while decode steps wait
# the same where the prefill and the steps take turns on the device: the next step waits for them
TURNS_AHEAD = 1
# how often the prefill's host asks whether its oldest chunk in flight is done, while it may
# hand back to its owner instead of waiting for it
POLL_SECONDS = 0.0002
GRANULE = 8  # a green context's SMs come in multiples of this (Hopper's granularity)
_GREEN: dict = {}  # (device, SMs) -> the green context for prefills beside decode steps (None: refused), made once


def prefill_sms(share: float, total_sms: int) -> int:
    """decode_sm_share resolved for a GPU of total_sms SMs: the SMs a prefill beside decode steps
    runs on, the rest kept for the steps (at least `share` of them), a multiple of GRANULE; 0:
    no partition (share 0, or a GPU too small to leave the prefill GRANULE SMs)."""
    sms = int(total_sms * (1 - share)) // GRANULE * GRANULE
    return sms if share > 0 and GRANULE <= sms < total_sms else 0


def green_contexts_supported() -> bool:
    """Whether this torch makes CUDA green contexts (torch.cuda.GreenContext, a CUDA 12.4+ build)."""
    try:
        from torch.cuda import green_contexts
    except ImportError:
        return False
    return bool(green_contexts.SUPPORTED)


def _stream(device: "torch.device", sms: int) -> tuple["torch.cuda.Stream", bool]:
    """A stream for a prefill's kernels, and whether it is a green context's: on sms SMs of the
    device, or on all of them (sms 0, or where the driver refuses the green context: said once)."""
    if not sms:
        return torch.cuda.Stream(device), False
    key = (device.index if device.index is not None else torch.cuda.current_device(), sms)
    if key not in _GREEN:
        try:
            _GREEN[key] = torch.cuda.GreenContext.create(num_sms=sms, device_id=key[0])
        except RuntimeError as e:
            _GREEN[key] = None
            print(f"[no green context ({first_line(e)}): a prefill beside decode steps takes turns with them on "
                  "every SM]", file=sys.stderr)
    green = _GREEN[key]
    return (green.Stream(), True) if green is not None else (torch.cuda.Stream(device), False)


@contextlib.contextmanager
def decode_first(device: "torch.device | None") -> Iterator[None]:
    """The calling thread's work (the owner's: decode steps) on a stream of the highest
    priority while inside, where device is a CUDA device; elsewhere nothing changes. What was
    queued before, on any stream, is done first."""
    if device is None or device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    with torch.cuda.stream(torch.cuda.Stream(device, priority=-100)):  # clamped to the highest there is
        yield


class SlicedPrefill:
    def __init__(self, run: Callable[[Callable[[], None]], object], slice_seconds: float,
                 more_work: Callable[[], bool], device: "torch.device | None" = None, sms: int = 0):
        """run(pause): the prefill, calling pause() at every chunk boundary; its return value is
        `result`, or what it raised is `error`. more_work(): whether anything waits for the
        owner's thread (read at a boundary, while the owner waits). device: where the prefill
        queues its work (a CUDA device: a stream of its own and fences; otherwise its work is
        done when queued). sms: the SMs it runs on when it starts beside work of the owner's
        (more_work() now), 0: all. Made on the owner's thread."""
        self.run, self.slice_seconds, self.more_work = run, slice_seconds, more_work
        cuda = device is not None and device.type == "cuda"
        self.owner_stream = torch.cuda.current_stream(device) if cuda else None
        beside = more_work()
        self.stream, green = _stream(device, sms if beside else 0) if cuda else (None, False)
        # the prefill and the owner's steps take turns on the device (every SM, beside decoding)
        self.turns = cuda and beside and not green
        self.ahead = TURNS_AHEAD if self.turns else AHEAD
        self._fences: list = []  # the device work queued up to each boundary still in flight
        self._handed_back = None  # taking turns: the chunks queued up to the last hand-back (an event)
        self.result, self.error, self.done = None, None, False
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)
        self._since = 0.0
        self._busy: Callable[[], bool] | None = None  # the owner's device work, while it is not done
        # the prefill thread's own time, while it runs: its work (queueing chunks, the host's part
        # of them) and its waits (for its oldest chunk in flight, or for the owner's step to be
        # done): which of the two a long slice is spent in
        self.work_seconds = self.wait_seconds = 0.0
        self.boundaries = 0  # chunk boundaries reached: where in the prefill a slice was
        self._mark = 0.0
        self._thread = threading.Thread(target=self._main, name="ktlong-prefill", daemon=True)
        self._started = False

    def advance(self, owner_done: Callable[[], bool] | None = None) -> bool:
        """Run the prefill's next slice (from its start, the first time); True once it ended.
        owner_done: whether the device work the owner queued before (its decode step) is done;
        the slice then goes on until it is, if that is longer than slice_seconds."""
        assert not self.done
        self._since = time.perf_counter()
        self._busy = (lambda: not owner_done()) if owner_done is not None else None
        if not self._started:
            self._started = True
            self._thread.start()
        self._go.release()
        self._back.acquire()
        return self.done

    def before_step(self):
        """Where the prefill takes turns with the owner's steps: the owner's device work queued
        from now on (its next step) waits for the chunks queued up to the prefill's last hand-back.
        Called on the owner's thread, between slices; elsewhere nothing happens."""
        if self._handed_back is not None:
            self.owner_stream.wait_event(self._handed_back)
            self._handed_back = None

    def _main(self):
        self._go.acquire()
        self._mark = time.perf_counter()
        try:
            if self.stream is None:
                self.result = self.run(self._pause)
            else:
                self.stream.wait_stream(self.owner_stream)
                try:
                    with torch.cuda.stream(self.stream):
                        self.result = self.run(self._pause)
                finally:
                    self._spent("work")
                    self.stream.synchronize()
                    self._spent("wait")
        except BaseException as e:  # handed to the owner, who reports it (the thread itself prints nothing)
            self.error = e
        finally:
            self._spent("work")
            self.done = True
            self._back.release()

    def _pause(self):
        self._spent("work")
        self.boundaries += 1
        if not self.more_work():
            return
        if self.stream is not None:
            fence = torch.cuda.Event()
            fence.record()
            self._fences.append(fence)
            while len(self._fences) > self.ahead:  # the oldest chunk's end, handing back meanwhile when the slice is over
                if self._fences[0].query():
                    self._fences.pop(0)
                elif self._slice_over():
                    self._hand_back()
                else:
                    time.sleep(POLL_SECONDS)
        if self._slice_over():
            self._hand_back()
        self._spent("wait")

    def _spent(self, kind: str):
        """The time since the last mark, counted as the prefill's work or its waits."""
        now = time.perf_counter()
        if kind == "work":
            self.work_seconds += now - self._mark
        else:
            self.wait_seconds += now - self._mark
        self._mark = now

    def _slice_over(self) -> bool:
        return time.perf_counter() - self._since >= self.slice_seconds and not (self._busy is not None and self._busy())

    def _hand_back(self):
        self._spent("wait")
        if self.turns:  # the owner's next step after the chunks queued so far (before_step)
            self._handed_back = self.stream.record_event()
        self._back.release()
        self._go.acquire()
        if self.turns:  # the next chunks after the step the owner queued meanwhile
            self.stream.wait_stream(self.owner_stream)
        self._since = self._mark = time.perf_counter()
