"""The garbage collector's full passes: what every thread of the server waits for while one runs.

A full pass (generation 2) walks every container object the process holds. The server's imports
and model alone are about 211,000 of them: a pass took 100-150 ms on a 2-core machine, which a
step between two tokens waits for whole (the GIL is held throughout). `freeze_startup` moves
what startup made out of the collector's reach (gc.freeze: those objects live as long as the
server anyway), so later passes walk only what the requests made: 17 ms there with three
1M-token prompts' id lists. `FullPasses` counts and times the passes, for the server's log.
"""

from __future__ import annotations

import gc
import time


def freeze_startup():
    """What the process holds now (the model, the session, the app) is never walked again."""
    gc.collect()
    gc.freeze()


class FullPasses:
    """The full collections since it was made: how many, and their seconds in all."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._started: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict):
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def close(self):
        gc.callbacks.remove(self._callback)
