"""TextCache: a text sharing a long prefix with one encoded before is encoded from a cut inside
that prefix, and its ids equal the tokenizer's own encoding of the whole text, for the packaged
byte-level tokenizers (SmolLM2's GPT-2 regex, Qwen2's), on real documents and on fuzzed texts
rich in the characters where pre-tokens part (newlines, spaces, tabs, digits, punctuation)."""

import glob
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ktlong.gguf.text_cache import TextCache, common_prefix
from ktlong.gguf.tokenizer import GGUFTokenizer
from ktlong.models.loader import open_model

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b"]


@pytest.fixture(scope="module", params=MODELS)
def tokenizer(request):
    return GGUFTokenizer(open_model(request.param)[0])


def plain(tokenizer, text):
    return tokenizer.encode(text, add_bos=False, parse_special=False)


def counting(tokenizer, monkeypatch) -> list[int]:
    """The lengths of the texts the tokenizer's pre-tokenizer and model encode from now on."""
    lengths, encode = [], tokenizer.encode_pieces

    def spy(text):
        lengths.append(len(text))
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode_pieces", spy)
    return lengths


def test_a_document_asked_about_again_is_encoded_from_its_end(tokenizer, monkeypatch):
    files = sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))
    doc = "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files[:30])[:200_000]
    cache = TextCache(tokenizer)
    lengths = counting(tokenizer, monkeypatch)
    questions = ["\n\nWhat does this module do?", "\n\nName one function. <|im_end|>", " and then  \n\n\t42",
                 "\n\n\n    def f(x):\n        return x", "\r\n\r\nWhich line says 'import os'?"]
    for i, question in enumerate(questions):
        text = doc + question
        ids = cache.encode(text)
        if i:  # the document was encoded once: the rest start near its end
            assert lengths[-1] < 400, lengths
        assert ids == plain(tokenizer, text)
    assert len(cache.texts) == 1  # the questions reused the document's entry and added none
    rng = random.Random(3)
    for _ in range(6):  # edits: a document cut short, a line changed in its middle, another document
        cut = rng.randrange(len(doc))
        for text in (doc[:cut], doc[:cut] + "\nchanged line\n" + doc[cut:], files[-1] * 3):
            assert cache.encode(text) == plain(tokenizer, text)
    blob = "".join(chr(33 + (i * 7919) % 90) for i in range(300_000))  # no space: no cut is settled
    for text in (blob + "\n\nWhat is it?", blob + " and so on"):
        assert cache.encode(text) == plain(tokenizer, text)
    assert len(cache.texts) <= cache.keep


PIECES = st.sampled_from(["\n", "\n\n", " ", "  ", "\t", "\r\n", "x", "word", " word", "Word", "123", "4567",
                          "'s", "'ll", "(", ")", "{}", ".", ",\n", "é", "日本", "😀", "<|im_end|>", "_", "-"])


@settings(max_examples=60, deadline=None)
@given(shared=st.lists(PIECES, min_size=20, max_size=200), tails=st.lists(st.lists(PIECES, max_size=30),
                                                                        min_size=2, max_size=4))
def test_fuzzed_texts_with_shared_prefixes_encode_as_the_whole(shared, tails):
    for name in MODELS:
        tokenizer = _tokenizers(name)
        cache = TextCache(tokenizer, min_chars=0)
        base = "".join(shared) * 3
        for tail in tails:
            text = base + "".join(tail)
            assert cache.encode(text) == plain(tokenizer, text), (name, text[-120:])


_loaded = {}


def _tokenizers(name):
    if name not in _loaded:
        _loaded[name] = GGUFTokenizer(open_model(name)[0])
    return _loaded[name]


def _loop_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 40), st.integers(0, 40), st.booleans())
def test_common_prefix_equals_a_plain_loop(shared, tail_a, tail_b, as_text):
    """Strings and token lists, shared prefixes around the doubling steps' edges (64, 192, ...)."""
    rng = np.random.default_rng(shared * 1601 + tail_a * 41 + tail_b)
    head = rng.integers(0, 3, size=shared).tolist()
    a, b = head + rng.integers(0, 3, size=tail_a).tolist(), head + rng.integers(0, 3, size=tail_b).tolist()
    if as_text:
        a, b = "".join(map(str, a)), "".join(map(str, b))
    assert common_prefix(a, b) == _loop_prefix(a, b)


def test_common_prefix_of_edge_cases():
    for a, b in [("", ""), ("abc", "abd"), ("abc", "abc"), ("abc", "ab"), ("x" * 1000 + "a", "x" * 1000 + "b"),
                 ([], [1]), ([1] * 64, [1] * 64 + [2]), ([1] * 64 + [3], [1] * 64 + [2])]:
        assert common_prefix(a, b) == _loop_prefix(a, b)
