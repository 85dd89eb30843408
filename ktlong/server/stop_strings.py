"""Stop strings over streamed text: text is passed on only once it cannot be the start of a
stop string, and generation ends at the first one (which is not part of the answer)."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.held = ""  # text that may still turn out to be the start of a stop string
        self.hit = False

    def push(self, piece: str) -> str:
        """The part of the text so far that is certainly answer; sets `hit` at a stop string."""
        if self.hit:
            return ""
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[:min(found)]
        keep = 0  # the longest end of text that begins some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: what was held back was answer after all."""
        out, self.held = ("" if self.hit else self.held), ""
        return out
