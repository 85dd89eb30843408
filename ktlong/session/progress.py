"""A prefill's progress on stderr: tqdm's bar on a terminal; into a file or a pipe a line every
LINE_SECONDS, since the bar redraws itself with carriage returns that a log keeps, one line
growing by every redraw (3,000 tokens on a CPU: 30 KB)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LINE_SECONDS = 10.0


class _Lines:
    """The bar's part that a prefill uses (total, n, update, close), written a line at a time."""

    def __init__(self, total: int):
        self.total, self.n = total, 0
        self.start = self.last = time.monotonic()

    def update(self, n: int):
        self.n += n
        now = time.monotonic()
        if now - self.last >= LINE_SECONDS and 0 < self.n < self.total:
            self.last = now
            rate = self.n / (now - self.start)
            print(f"[prefill: {self.n:,} of {self.total:,} tokens, {rate:,.0f} tok/s, about "
                  f"{(self.total - self.n) / rate:,.0f} s left]", file=sys.stderr, flush=True)

    def close(self):
        pass


def prefill_progress(total: int, shown: bool):
    """Progress over total prompt tokens; nothing where not shown."""
    if shown and not sys.stderr.isatty():
        return _Lines(total)
    return tqdm(total=total, unit="tok", desc="prefill", leave=False, disable=not shown)
