"""Decoders and resident history of conversations held outside the session, kept while the
device has room.

A decoder's device buffers (window, anchors, selection) and CUDA graphs are built over one DRAM
host cache: its graphs read that cache's pages where they lie. When the server's cache store
hands a conversation over (LongContextSession.exchange), the conversation keeps its decoder, so
that when it comes back its next prefill extends that decoder as a follow-up does
(Decoder.extend) instead of building one and capturing its graphs, which takes about 0.11 s at
120K tokens (Qwen2.5-0.5B on an H100). It also keeps the layers of its history the device holds
(ktlong/kv/resident.py), so that its follow-up reads them there instead of moving the whole
history over PCIe again (1.5 GB at 120K tokens on that model, about 28 ms).

Before a prefill, what is parked must fit the room the plan leaves beside it: decoders first
(`decoder_bytes` each: the plan's decode window and kept blocks; those that do not fit go, the
least recently parked first; their anchors are in the anchors' pool, which lets them go too
when a new decoder needs the room: ktlong/session/anchors_pool.py), then the session's own
conversation's resident history, then the parked ones' resident history, the most recently
parked first. On the CPU there is no device limit: everything stays.
"""

from __future__ import annotations

import weakref


class ParkedDecoders:
    def __init__(self, decoder_bytes: int):
        self.decoder_bytes = decoder_bytes
        self._held: list[weakref.ref] = []  # conversations parked with device state, least recently first

    def park(self, conversation):
        """conversation (a HeldConversation) leaves the session; its decoder and resident
        history, if any, stay."""
        if conversation.decoder is not None or _resident_bytes(conversation):
            self._held.append(weakref.ref(conversation))

    def take(self, conversation):
        """conversation comes back to the session with its device state: no longer parked."""
        self._held = [r for r in self._held if r() is not conversation]

    def held(self) -> list:
        """The parked conversations whose device state is alive (a conversation the cache store
        forgot took its state with it)."""
        self._held = [r for r in self._held
                      if r() is not None and (r().decoder is not None or _resident_bytes(r()))]
        return [r() for r in self._held]

    def drop_oldest(self) -> bool:
        """The least recently parked decoder goes (its conversation stays, in DRAM); False when
        none is parked."""
        with_decoder = [c for c in self.held() if c.decoder is not None]
        if not with_decoder:
            return False
        with_decoder[0].decoder = None
        return True

    def fit(self, room: int | None, reserve: int = 0) -> int | None:
        """Drop the least recently parked decoders until the rest fit in `room` device bytes;
        then keep parked resident history, the most recently parked first, in what is left
        beyond `reserve` (the session's own conversation's). Returns what the parked state leaves
        of room (None: no limit, nothing dropped)."""
        held = self.held()
        if room is None:
            return None
        with_decoder = [c for c in held if c.decoder is not None]
        while with_decoder and len(with_decoder) * self.decoder_bytes > room:
            with_decoder.pop(0).decoder = None
        left = room - len(with_decoder) * self.decoder_bytes
        spare = left - reserve
        for conversation in reversed(held):
            size = _resident_bytes(conversation)
            if size and size <= spare:
                spare -= size
                left -= size
            elif size:
                conversation.resident.fit(0)
        self.held()
        return left


def _resident_bytes(conversation) -> int:
    return conversation.resident.nbytes if conversation.resident is not None else 0
