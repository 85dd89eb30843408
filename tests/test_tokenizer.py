"""Token ids equal an independent reference tokenizer; decode inverts encode."""

import pytest

from ktlong.gguf.reader import GGUFFile
from ktlong.gguf.tokenizer import GGUFTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it? I'll see; we'd go.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "长上下文推理需要在主机内存中保存键值缓存。北京是中国的首都，人口约2100万。",
    "Emoji: 🎉🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done.",
    "   leading spaces\t\ttabs\n\n\n\r\nmixed   \n  trailing   ",
    "Numbers: 1234567890 3.14159 -42 1e10 0x1F 12,345,678 2026-11-22 and  1 2  3",
    "Special <|im_start|>user\nhello<|im_end|> end",
    "Ünïcödé façade naïve coöperate — “quotes” ‘single’ … ©®™ ½ ∑ ∫ √ Ω µ",
]


def reference(hf_tokenizer, path, pre):
    ref = hf_tokenizer(path)
    if pre == "smollm":
        # transformers' GGUF converter drops the smollm digit split that SmolLM2's own
        # tokenizer.json and llama.cpp apply; restore the original pre-tokenizer.
        from tokenizers import pre_tokenizers

        ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_path", "qwen_path", "gemma_path"])
def test_ids_equal_transformers_reference(request, hf_tokenizer, model):
    path = request.getfixturevalue(model)
    gf = GGUFFile(path)
    ours = GGUFTokenizer(gf)
    ref = reference(hf_tokenizer, path, gf.get("tokenizer.ggml.pre"))
    for text in TEXTS:
        expected = ref(text).input_ids  # with BOS where the model adds one
        assert ours.encode(text) == expected, text
        ids = ours.encode(text)
        assert ours.decode(ids[1:] if ours.add_bos else ids) == text  # all but the prepended BOS


@pytest.mark.slow
def test_special_tokens_parse_whole_or_stay_text(smollm2_path):
    tok = GGUFTokenizer(GGUFFile(smollm2_path))
    im_start = tok.tokens.index("<|im_start|>")
    assert tok.encode("<|im_start|>user")[0] == im_start
    plain = tok.encode("<|im_start|>user", parse_special=False)
    assert im_start not in plain and tok.decode(plain) == "<|im_start|>user"
    assert tok.eos_id in tok.stop_ids and not tok.add_bos


@pytest.mark.slow
def test_chat_template_renders_chatml(real_model):
    lm = real_model("qwen2.5-coder-0.5b")
    text = lm.chat_template.render([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("model", ["smollm2_path", "qwen_path", "gemma_path"])
def test_a_text_stream_pieces_join_to_the_whole_decode_without_decoding_the_answer_again(request, model):
    """Streamed pieces, one a token, join to the whole answer's decode (the reference), for text
    with multi-byte characters and for random ids; a character cut between tokens comes whole
    with the token that ends it. push never decodes the answer so far: only text() does."""
    import random

    from ktlong.chat.text_stream import TextStream

    tok = GGUFTokenizer(GGUFFile(request.getfixturevalue(model)))
    rng = random.Random(5)
    answers = [tok.encode(text, add_bos=False) for text in TEXTS]
    answers += [[rng.randrange(tok.vocab_size) for _ in range(150)] for _ in range(10)]
    decoded = []

    class Counting:  # the tokenizer, with its whole-answer decodes counted
        decode_stream = tok.decode_stream

        @staticmethod
        def decode(ids):
            decoded.append(len(ids))
            return tok.decode(ids)

    for ids in answers:
        stream = TextStream(Counting)
        pieces = [stream.push(i) for i in ids]
        assert not decoded
        whole = stream.text()
        assert decoded == [len(ids)]
        decoded.clear()
        joined = "".join(pieces)
        # the end may hold a character that never completes: the whole decode shows it as U+FFFD,
        # and so does the rest the stream gives once the answer ends
        assert joined == whole or (whole.startswith(joined) and set(whole[len(joined):]) == {"\ufffd"}), ids
        assert joined + stream.rest() == whole
        decoded.clear()
    emoji = tok.encode("👨‍👩‍👧‍👦", add_bos=False)
    stream = TextStream(tok)
    assert "".join(stream.push(i) for i in emoji) == "👨‍👩‍👧‍👦"
