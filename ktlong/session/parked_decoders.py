"""Decoders of conversations held outside the session, kept while the device has room.

A decoder's device buffers (window, anchors, selection) and CUDA graphs are built over one DRAM
host cache: its graphs read that cache's pages where they lie. When the server's cache store
hands a conversation over (LongContextSession.exchange), the conversation keeps its decoder, so
that when it comes back its next prefill extends that decoder as a follow-up does
(Decoder.extend) instead of building one and capturing its graphs, which takes about 0.11 s at
120K tokens (Qwen2.5-0.5B on an H100), most of what is left of a DRAM hit without it. Each holds
`decoder_bytes` (the plan's decode window and anchors); before a prefill, those that do not fit
the room the plan leaves beside it are dropped, the least recently parked first. On the CPU
there is no device limit: one per held conversation, its window in RAM beside the cache.
"""

from __future__ import annotations

import weakref


class ParkedDecoders:
    def __init__(self, decoder_bytes: int):
        self.decoder_bytes = decoder_bytes
        self._held: list[weakref.ref] = []  # conversations holding a decoder, least recently parked first

    def park(self, conversation):
        """conversation (a HeldConversation) leaves the session; its decoder, if any, stays."""
        if conversation.decoder is not None:
            self._held.append(weakref.ref(conversation))

    def take(self, conversation):
        """conversation comes back to the session with its decoder: no longer parked."""
        self._held = [r for r in self._held if r() is not conversation]

    def held(self) -> list:
        """The conversations whose parked decoders are alive (a conversation the cache store
        forgot took its decoder with it)."""
        self._held = [r for r in self._held if r() is not None and r().decoder is not None]
        return [r() for r in self._held]

    def fit(self, room: int | None) -> int | None:
        """Drop the least recently parked decoders until the rest fit in `room` device bytes;
        returns what they leave of it (None: no limit, nothing dropped)."""
        held = self.held()
        if room is None:
            return None
        while held and len(held) * self.decoder_bytes > room:
            held.pop(0).decoder = None
        self._held = [weakref.ref(c) for c in held]
        return room - len(held) * self.decoder_bytes
