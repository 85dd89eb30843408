"""Tokenizer built from GGUF metadata with the `tokenizers` library.

`tokenizer.ggml.model` = gpt2: byte-level BPE with the pre-tokenizer regex that llama.cpp
uses for `tokenizer.ggml.pre`. = llama: SentencePiece-style BPE over a scored vocabulary
(spaces as U+2581, byte fallback to <0xNN> tokens), its merges ranked by the score of the
merged piece. Control and user-defined tokens become added tokens so they are parsed whole
when special tokens are allowed.
"""

from __future__ import annotations

import functools
from typing import Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream

from ktlong.errors import GGUFError
from ktlong.gguf.reader import GGUFFile

# token_type values in GGUF
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# pre-tokenizer name -> (split regexes applied in order, whether BPE ignores merges for whole-word hits)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((GPT2_PATTERN,), False),
    "gpt2": ((GPT2_PATTERN,), False),
    "smollm": ((r"\p{N}", GPT2_PATTERN), False),
    "qwen2": ((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+",), False),
    "llama-bpe": ((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+",), True),
}
PRE_TOKENIZERS["llama3"] = PRE_TOKENIZERS["llama-bpe"]

# end-of-generation tokens recognised by name when the file marks them as control tokens
_END_OF_TURN_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "</s>")


class GGUFTokenizer:
    def __init__(self, gf: GGUFFile):
        model = gf.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise GGUFError(f"{gf.path}: tokenizer model '{model}' is not supported (gpt2 byte-level BPE "
                            "and llama SentencePiece-style BPE are).")
        tokens: list[str] = gf.require("tokenizer.ggml.tokens")
        types: list[int] = gf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if model == "gpt2":
            tk = self._byte_level_bpe(gf, vocab)
        else:
            tk = self._sentencepiece_bpe(gf, tokens, types, vocab)
        added = [AddedToken(tokens[i], special=(t == CONTROL), normalized=False)
                 for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        tk.add_tokens(added)
        self._tk = tk
        self.tokens = tokens
        self.special_names = tuple(token.content for token in added)  # parsed as tokens in text
        # each encode() of a SentencePiece-style model with a space prefix starts a word
        self.space_prefix = model == "llama" and bool(gf.get("tokenizer.ggml.add_space_prefix", False))
        self.byte_level = model == "gpt2"  # pre-tokenized by regexes, then byte-level BPE (ktlong/gguf/text_cache.py)
        self.vocab_size = len(tokens)
        self.control_ids = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNUSED))
        self.bos_id = gf.get("tokenizer.ggml.bos_token_id")
        self.eos_id = gf.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(gf.get("tokenizer.ggml.add_bos_token", model == "llama"))
        self.chat_template = gf.get("tokenizer.chat_template")
        stop = {self.eos_id, gf.get("tokenizer.ggml.eot_token_id"), gf.get("tokenizer.ggml.eom_token_id")}
        stop |= {vocab[n] for n in _END_OF_TURN_NAMES if n in vocab and types[vocab[n]] == CONTROL}
        self.stop_ids = frozenset(i for i in stop if i is not None)

    @staticmethod
    def _byte_level_bpe(gf: GGUFFile, vocab: dict[str, int]) -> Tokenizer:
        pre = gf.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{gf.path}: pre-tokenizer '{pre}' is not supported; supported: "
                            f"{', '.join(PRE_TOKENIZERS)}.")
        merges: list[str] = gf.get("tokenizer.ggml.merges") or []
        patterns, ignore_merges = PRE_TOKENIZERS[pre]
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        tk = Tokenizer(models.BPE(vocab, merge_pairs, ignore_merges=ignore_merges))
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        return tk

    @staticmethod
    def _sentencepiece_bpe(gf: GGUFFile, tokens: list[str], types: list[int],
                           vocab: dict[str, int]) -> Tokenizer:
        scores: list[float] = gf.require("tokenizer.ggml.scores")
        # every way to split a normal piece into two pieces of the vocabulary is a merge; the
        # piece with the higher score merges first, as SentencePiece's BPE encoder does
        merges = []
        for token, i in vocab.items():
            if types[i] not in (NORMAL, USER_DEFINED) or len(token) < 2:
                continue
            for cut in range(1, len(token)):
                left, right = token[:cut], token[cut:]
                if left in vocab and right in vocab:
                    merges.append((-scores[i], vocab[left], vocab[right], left, right))
        merges.sort()
        unk = gf.get("tokenizer.ggml.unknown_token_id")
        tk = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], byte_fallback=True,
                                  unk_token=tokens[unk] if unk is not None else None, fuse_unk=True))
        prefix = [normalizers.Prepend("\u2581")] if gf.get("tokenizer.ggml.add_space_prefix", False) else []
        tk.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "\u2581")])
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                       + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        return tk

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of text; special tokens written in the text are parsed as tokens when
        parse_special (chat templates need that), else treated as plain text."""
        if parse_special:
            ids = self._tk.encode(text, add_special_tokens=False).ids
        else:
            ids = self._encode_plain(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        return self.encode_pieces(text)[0]

    def encode_pieces(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """text's ids as plain text (special tokens' names stay text), and for each pre-token
        piece (start offset in text, ids before it). The pre-tokenizer and model alone: the
        added-token matcher is skipped."""
        pieces = self._tk.pre_tokenizer.pre_tokenize_str(text) if self._tk.pre_tokenizer else [(text, (0, len(text)))]
        ids, starts = [], []
        for piece, (start, _) in pieces:
            starts.append((start, len(ids)))
            if self._tk.normalizer is not None:
                piece = self._tk.normalizer.normalize_str(piece)
            ids.extend(t.id for t in self._tk.model.tokenize(piece))
        return ids, starts

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special)

    def decode_stream(self) -> Callable[[int], str | None]:
        """The text of ids given one at a time: each call takes the next id and returns the text
        it completes (None while a character is still incomplete), decoding a few ids, not all
        of them so far (tokenizers' DecodeStream)."""
        stream, tk = DecodeStream(skip_special_tokens=False), self._tk
        return lambda token_id: stream.step(tk, token_id)

    @functools.cached_property
    def guidance(self):
        """llguidance's tokenizer over the same vocabulary and rules, for constrained decoding
        (ktlong/chat/constrained.py); made on first use, about 0.2 s."""
        from llguidance import LLTokenizer

        return LLTokenizer(self._tk.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_id)

    def token_text(self, token_id: int) -> str:
        return self.tokens[token_id]
