"""Token ids of long plain texts, reused across texts that share a long prefix.

A server asked about one document again and again receives the document each time, with a new
question after it; encoding 120K tokens of it takes about half a second, longer than the rest
of a cache hit. Encoding the text from a cut inside the shared prefix gives the same ids,
provided the cut is where a pre-token starts and the pre-tokenizer decided everything before it
from the shared characters alone. The byte-level BPE pre-tokenizers (the GPT-2, Llama 3 and
Qwen2 regexes) look neither behind nor past the run of characters of one class (letters,
digits, spaces, punctuation) they stand in, but for one character. So a cut is taken where a
pre-token of the earlier text starts, at least MARGIN characters before the texts part, with a
space and something else between it and there (the run it stands in ends inside the shared
part): the ids before it are the earlier text's, and the ids after it are the encoding of the
rest on its own. Tokenizers of another kind (SentencePiece's) encode every text whole.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

MIN_CHARS = 4096  # shorter texts are encoded whole: their encoding is cheaper than the lookup
KEEP = 8  # texts remembered, least recently used out
MARGIN = 64  # a cut lies this many characters before the texts part, at least


@dataclass
class _Encoded:
    text: str
    ids: list[int]
    cuts: list[int]  # where its pre-tokens start (a cut may go there), ascending
    counts: list[int]  # ids before each cut


class TextCache:
    def __init__(self, tokenizer, keep: int = KEEP, min_chars: int = MIN_CHARS, max_ids: int | None = None):
        """tokenizer: a GGUFTokenizer; its byte_level says whether its texts may be cut.
        max_ids: texts of more tokens are encoded but not remembered (a prompt that long is
        refused, and nobody asks about it again)."""
        self.tokenizer, self.keep, self.min_chars, self.max_ids = tokenizer, keep, min_chars, max_ids
        self.texts: OrderedDict[int, _Encoded] = OrderedDict()  # id(entry) -> entry, oldest first
        self.lock = threading.Lock()  # requests are encoded on several threads

    def encode(self, text: str) -> list[int]:
        """The ids of text as plain text (special tokens' names stay text): equal to
        tokenizer.encode(text, add_bos=False, parse_special=False)."""
        if len(text) < self.min_chars or not self.tokenizer.byte_level:
            return self.tokenizer.encode(text, add_bos=False, parse_special=False)
        with self.lock:
            base, shared = self._closest(text)
        n = bisect.bisect_right(base.cuts, self._latest_cut(text, shared)) if base is not None else 0
        cut, count = (base.cuts[n - 1], base.counts[n - 1]) if n else (0, 0)
        tail, pieces = self.tokenizer.encode_pieces(text[cut:])
        if n and len(text) - cut < self.min_chars:  # a question after a remembered document: the
            with self.lock:  # document stays the entry (copying its lists would cost more than the tail)
                if id(base) in self.texts:
                    self.texts.move_to_end(id(base))
            return base.ids[:count] + tail
        if self.max_ids is not None and count + len(tail) > self.max_ids:
            return (base.ids[:count] if n else []) + tail
        found = [(cut + at, count + before) for at, before in pieces if at]
        entry = _Encoded(text, (base.ids[:count] if n else []) + tail,
                         (base.cuts[:n] if n else []) + [c for c, _ in found],
                         (base.counts[:n] if n else []) + [b for _, b in found])
        with self.lock:
            if base is not None and base.text == text:
                self.texts.pop(id(base), None)
            self.texts[id(entry)] = entry
            while len(self.texts) > self.keep:
                self.texts.popitem(last=False)
        return list(entry.ids)

    @staticmethod
    def _latest_cut(text: str, shared: int) -> int:
        """The latest offset at which the pre-tokens before it were decided by the first `shared`
        characters alone: MARGIN before them, with a space and something else between it and the
        last shared character (so the run of one class the cut stands in ends inside the shared
        part, and so does the one character the patterns look past a run). -1: none."""
        end = shared - 1
        space = max(text.rfind(c, 0, end) for c in " \t\n\r")
        other = end - 1
        while other >= 0 and text[other].isspace():
            other -= 1
        return min(space, other, shared - MARGIN)

    def _closest(self, text: str) -> tuple[_Encoded | None, int]:
        """The remembered text sharing the longest prefix with text, and that prefix's length."""
        best, best_len = None, 0
        for entry in self.texts.values():
            n = common_prefix(entry.text, text)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two strings or lists: slices of doubling length
    compared until one differs, then that one halved. Every step is one slice comparison in C (a
    Python loop over 110K token ids takes 9 ms; this, under one), and a prefix that ends early
    costs little."""
    lo, end, step = 0, min(len(a), len(b)), 64
    while lo < end:  # a[:lo] == b[:lo]
        hi = min(end, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, 2 * step
    else:
        return end
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
