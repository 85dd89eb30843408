"""uvicorn, stopping the generation first on a signal."""

from __future__ import annotations

from typing import Callable

import uvicorn


class StoppingServer(uvicorn.Server):
    """On SIGINT or SIGTERM, first `stop()` (the worker ends the generation after its current
    chunk or token and refuses what waits, so each stream ends with an error event and [DONE]),
    then uvicorn's own shutdown, which waits for the connections to close; a second signal
    forces the exit, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, stop: Callable[[], None]):
        super().__init__(config)
        self.stop = stop

    def handle_exit(self, sig, frame):
        self.stop()
        super().handle_exit(sig, frame)
