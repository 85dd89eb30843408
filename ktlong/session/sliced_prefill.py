"""A prefill run a slice at a time, between the decode steps of other conversations.

A layer-major prefill is one long call that asks `should_stop` after every chunk of every layer
(LongContextSession.prefill). Here it runs on a thread of its own that hands control back and
forth with its owner's thread: `advance` lets it run until it has worked `slice_seconds` (or
`more_work` says nothing else waits) and reaches its next chunk boundary, then waits there for
the next `advance`. Only one of the two threads runs at any time, so the device work of the
prefill and of the decode steps between its slices is queued in the order they ran, and the
session's state is never touched by both at once.

On a GPU the prefill's host loop queues work faster than the device runs it: a slice of 50 ms
of host time left up to 150 ms of queued chunks in front of the next decode step (measured
beside a 1M prefill: 5 tok/s a stream). So while others wait, the host stays at most one chunk
ahead of the device (a fence at each boundary waits for the one before), and a slice ends with
its device work done: its time is the device's.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch


class SlicedPrefill:
    def __init__(self, run: Callable[[Callable[[], None]], object], slice_seconds: float,
                 more_work: Callable[[], bool], device: "torch.device | None" = None):
        """run(pause): the prefill, calling pause() at every chunk boundary; its return value is
        `result`, or what it raised is `error`. more_work(): whether anything waits for the
        owner's thread (read at a boundary, while the owner waits). device: where the prefill
        queues its work (a CUDA device gets fences; otherwise its work is done when queued)."""
        self.run, self.slice_seconds, self.more_work = run, slice_seconds, more_work
        self.cuda = device is not None and device.type == "cuda"
        self._fence = None  # the device work queued up to the last boundary
        self.result, self.error, self.done = None, None, False
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)
        self._since = 0.0
        self._thread = threading.Thread(target=self._main, name="ktlong-prefill", daemon=True)
        self._started = False

    def advance(self) -> bool:
        """Run the prefill's next slice (from its start, the first time); True once it ended."""
        assert not self.done
        self._since = time.perf_counter()
        if not self._started:
            self._started = True
            self._thread.start()
        self._go.release()
        self._back.acquire()
        return self.done

    def _main(self):
        self._go.acquire()
        try:
            self.result = self.run(self._pause)
        except BaseException as e:  # handed to the owner, who reports it (the thread itself prints nothing)
            self.error = e
        finally:
            self.done = True
            self._back.release()

    def _pause(self):
        if not self.more_work():
            return
        if self.cuda:
            fence, self._fence = self._fence, torch.cuda.Event()
            self._fence.record()
            if fence is not None:  # one chunk in flight ahead of the host at most
                fence.synchronize()
        if time.perf_counter() - self._since < self.slice_seconds:
            return
        if self._fence is not None:  # the slice's work done before the steps queue theirs
            self._fence.synchronize()
            self._fence = None
        self._back.release()
        self._go.acquire()
        self._since = time.perf_counter()
