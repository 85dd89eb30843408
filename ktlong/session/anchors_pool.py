"""The device bytes that every decoder's anchors share (memory_plan's `anchors_pool`).

A decoder's device anchors (ktlong/decode/device_anchors.py) are sized by the tokens its
conversation can reach, its prompt and its answer's room, not by max_seq_len: at 8B shapes a
60K-token conversation's take 35 MB where one of 1M takes 0.54 GiB. The plan sets one pool for
all of them, at least one conversation of max_seq_len's (so four conversations of 60K tokens
decode beside the prefill of a 1M one within 24 GiB, where five of max_seq_len's would not fit).
The server admits a request only when its decoder's anchors fit beside those of the answers
running (`fits`); a new decoder makes its room by letting parked decoders go, the least recently
parked first (`make_room`). A decoder counts while it is alive (a weak set): whoever holds one,
a batch, a parked conversation or the session, holds its device memory.
"""

from __future__ import annotations

import gc
import weakref
from typing import Callable

from ktlong.errors import KtlongError
from ktlong.kv.layout import KVLayout
from ktlong.kv.memory_plan import GIB, decode_anchor_bytes
from ktlong.session.parked_decoders import ParkedDecoders


class AnchorsPool:
    def __init__(self, pool_bytes: int | None, layout: KVLayout, anchors_per_block: int):
        """pool_bytes: None where nothing limits them (the CPU, or no anchors on the device)."""
        self.pool_bytes = pool_bytes if anchors_per_block else None
        self.layout, self.anchors_per_block = layout, anchors_per_block
        self._decoders: weakref.WeakSet = weakref.WeakSet()

    def bytes_for(self, tokens: int) -> int:
        """The anchors of a decoder whose conversation reaches `tokens` (Decoder.anchor_bytes)."""
        blocks = -(-min(tokens, self.layout.capacity) // self.layout.block_size)
        return decode_anchor_bytes(self.layout, self.anchors_per_block, blocks) if self.anchors_per_block else 0

    def add(self, decoder):
        self._decoders.add(decoder)

    def in_use(self) -> int:
        return sum(d.anchor_bytes for d in self._decoders)

    def fits(self, tokens: int, busy: list) -> bool:
        """Whether a decoder reaching `tokens` fits beside the busy decoders (those of answers
        running); the others (parked, or the session's idle one) go to make room."""
        if self.pool_bytes is None:
            return True
        return sum(d.anchor_bytes for d in busy if d is not None) + self.bytes_for(tokens) <= self.pool_bytes

    def make_room(self, tokens: int, parked: ParkedDecoders, release_batch: Callable[[], None]):
        """Before a decoder reaching `tokens` is built: parked decoders go, the least recently
        parked first, until it fits beside the rest; if it still does not, the last batch's body
        goes too (release_batch), which holds its members' buffers, parked ones' included (the
        running ones build theirs again at their next step)."""
        if self.pool_bytes is None:
            return
        need = self.bytes_for(tokens)
        while self.in_use() + need > self.pool_bytes and parked.drop_oldest():
            pass
        if self.in_use() + need > self.pool_bytes:
            release_batch()
            gc.collect()  # and a decoder let go inside a reference cycle
        if self.in_use() + need > self.pool_bytes:
            raise KtlongError(f"The decoders running hold {self.in_use() / GIB:.2f} GiB of the "
                              f"{self.pool_bytes / GIB:.2f} GiB of device anchors, and this conversation's "
                              f"{need / GIB:.2f} GiB do not fit beside them; lower max_num_seqs or max_seq_len, or "
                              "raise gpu_memory_budget_gb.")
