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
