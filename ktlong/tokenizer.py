"""Tokenizer built from GGUF metadata with the `tokenizers` library.

Byte-level BPE (`tokenizer.ggml.model` = gpt2) with the pre-tokenizer regex that llama.cpp
uses for `tokenizer.ggml.pre`; control and user-defined tokens become added tokens so they
are parsed whole when special tokens are allowed.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from ktlong.errors import GGUFError
from ktlong.gguf_file import GGUFFile

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
        if model != "gpt2":
            raise GGUFError(f"{gf.path}: tokenizer model '{model}' is not supported yet (only the "
                            "byte-level BPE 'gpt2' kind).")
        pre = gf.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{gf.path}: pre-tokenizer '{pre}' is not supported; supported: "
                            f"{', '.join(PRE_TOKENIZERS)}.")
        tokens: list[str] = gf.require("tokenizer.ggml.tokens")
        merges: list[str] = gf.get("tokenizer.ggml.merges") or []
        types: list[int] = gf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        patterns, ignore_merges = PRE_TOKENIZERS[pre]

        vocab = {tok: i for i, tok in enumerate(tokens)}
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab, merge_pairs, ignore_merges=ignore_merges)
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        added = [AddedToken(tokens[i], special=(t == CONTROL), normalized=False)
                 for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        tk.add_tokens(added)
        self._tk = tk
        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.control_ids = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNUSED))
        self.bos_id = gf.get("tokenizer.ggml.bos_token_id")
        self.eos_id = gf.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(gf.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template = gf.get("tokenizer.chat_template")
        stop = {self.eos_id, gf.get("tokenizer.ggml.eot_token_id"), gf.get("tokenizer.ggml.eom_token_id")}
        stop |= {vocab[n] for n in _END_OF_TURN_NAMES if n in vocab and types[vocab[n]] == CONTROL}
        self.stop_ids = frozenset(i for i in stop if i is not None)

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
        # The pre-tokenizer and model alone skip the added-token matcher.
        pieces = self._tk.pre_tokenizer.pre_tokenize_str(text)
        ids = []
        for piece, _ in pieces:
            ids.extend(t.id for t in self._tk.model.tokenize(piece))
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.tokens[token_id]
