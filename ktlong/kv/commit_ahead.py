"""A prefill's DRAM, committed a layer ahead of it on a thread of its own.

A prefill writes every global layer's K/V and side tables into the host cache, whose memory is
held only once reserved (HostKVCache.reserve: zeroed, and page-locked where a GPU reads it).
Reserved by the prefill itself, a chunk at a time, that work lands in its own time: beside
decoding answers, inside the slices they wait for (1M tokens at 8B shapes: 36 pieces a layer of
up to 55 ms, 0.71 s a layer; at once, 0.14 s). Here a helper thread reserves each layer whole, up
to the prompt's end, while the prefill computes the layer before: the prefill waits only where
the helper is behind (its first layer). Zeroing and page-locking release the GIL, so the two
threads run side by side; but CUDA's calls on other threads wait while it locks a range, so it
locks in bounded pieces and pauses after each (HostKVCache.reserve's pace). Each layer's memory
is whole before the prefill writes there, and the helper is at most `depth` layers ahead of the
one the prefill is in.
"""

from __future__ import annotations

import threading
import time

import torch

from ktlong.kv.host_cache import HostKVCache

DEPTH = 1  # layers the helper may hold ready beyond the one the prefill is in
# the helper's pause after each piece it page-locks (HostKVCache.reserve's pace): while CUDA locks
# a range, the prefill's and the decode steps' calls into it wait, and a waiting thread gets its
# turn only if the helper does not take the lock again at once
PACE_SECONDS = 0.001


class CommitAhead:
    def __init__(self, host: HostKVCache, tokens: int, depth: int = DEPTH):
        """Starts committing host's global layers, in order, for its first `tokens` tokens (the
        prompt's end); nothing starts when they hold that already."""
        self.host, self.tokens = host, tokens
        blocks = -(-tokens // host.layout.block_size)
        self.layers = sorted(layer for layer, held in host.committed.items() if held < blocks)
        self._ready = {layer: threading.Event() for layer in self.layers}
        self._room = threading.Semaphore(depth + 1)  # the layer the prefill is in, and depth more
        self._stop = False
        self.error: BaseException | None = None
        self._thread = None
        # page-locking registers with the thread's current device: the caller's, not device 0's
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        if self.layers:
            self._thread = threading.Thread(target=self._main, name="ktlong-commit", daemon=True)
            self._thread.start()

    def _main(self):
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            for layer in self.layers:
                self._room.acquire()
                if self._stop:
                    return
                self.host.reserve(self.tokens, [layer], ahead=self.tokens, pace=lambda: time.sleep(PACE_SECONDS))
                self._ready[layer].set()
        except BaseException as e:  # handed to the prefill at its next wait
            self.error = e
        finally:
            for ready in self._ready.values():  # none waits for a layer that will not come
                ready.set()

    def wait(self, layer: int):
        """Return once `layer`'s memory is held up to the prompt's end (the prefill is about to
        write it); raise what the helper raised. A layer that needed nothing returns at once.
        It does not hand back to a sliced prefill's owner meanwhile: a prefill's stops are asked
        at the same points on every rank of a tensor-parallel group (a collective), and how long
        the helper takes differs between them."""
        ready = self._ready.get(layer)
        if ready is None:
            return
        ready.wait()
        if self.error is not None:
            raise self.error
        if self.layers.index(layer):  # the prefill left the layer before: one more may go ahead
            self._room.release()

    def close(self):
        """Stop the helper after the layer it is in, and wait for it (before the cache is reset
        or read by anyone else)."""
        if self._thread is None:
            return
        self._stop = True
        self._room.release()
        self._thread.join()

    def __enter__(self) -> "CommitAhead":
        return self

    def __exit__(self, *exc):
        self.close()
