"""A prefill run a slice at a time, between the decode steps of other conversations.

A layer-major prefill is one long call that asks `should_stop` after every chunk of every layer
(LongContextSession.prefill). Here it runs on a thread of its own that hands control back and
forth with its owner's thread: `advance` lets it run until it has worked `slice_seconds` (or
`more_work` says nothing else waits) and reaches its next chunk boundary, then waits there for
the next `advance`. Only one of the two threads runs at any time, so the device work of the
prefill and of the decode steps between its slices is queued in the order they ran, and the
session's state is never touched by both at once.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class SlicedPrefill:
    def __init__(self, run: Callable[[Callable[[], None]], object], slice_seconds: float,
                 more_work: Callable[[], bool]):
        """run(pause): the prefill, calling pause() at every chunk boundary; its return value is
        `result`, or what it raised is `error`. more_work(): whether anything waits for the
        owner's thread (read at a boundary, while the owner waits)."""
        self.run, self.slice_seconds, self.more_work = run, slice_seconds, more_work
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
        if time.perf_counter() - self._since < self.slice_seconds or not self.more_work():
            return
        self._back.release()
        self._go.acquire()
        self._since = time.perf_counter()
