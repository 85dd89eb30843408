"""`python -m ktlong.bench random-gguf` writes a file the loader reads as the random model's shape:
every tensor of the shape's size (the config's, checked against the gguf package's own reader),
norms of ones, matrices scaled as random_model scales them; a byte-level tokenizer, one token a
byte for any bytes (the serve bench sizes documents by it), with ChatML; an existing file is
refused in one sentence, untouched."""

import numpy as np
from gguf import GGUFReader

from ktlong.bench.__main__ import main as bench
from ktlong.models.loader import load_model
from ktlong.models.random_model import random_config


def test_a_random_gguf_has_the_shape_and_a_byte_tokenizer(tmp_path, capsys):
    path = tmp_path / "r.gguf"
    assert bench(["random-gguf", "--shape", "tiny", "--out", str(path), "--context", "65536"]) == 0
    c = random_config("tiny")
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert len(tensors) == 2 + 9 * c.num_layers + 1
    q = c.num_heads * c.head_dim
    assert tuple(reversed(tensors["blk.1.attn_q.weight"].shape.tolist())) == (q, c.hidden_size)
    assert tuple(reversed(tensors["blk.0.ffn_down.weight"].shape.tolist())) == (c.hidden_size, c.intermediate_size)
    gate = np.asarray(tensors["blk.0.ffn_gate.weight"].data, dtype=np.float32)
    # rows of unit norm on average: n = 512 * 256 values of variance 1/256 -> std within 1% (4 sigma)
    assert abs(float(gate.std()) * c.hidden_size ** 0.5 - 1) < 0.01
    assert np.all(np.asarray(tensors["output_norm.weight"].data) == 1)

    lm = load_model(str(path))
    assert (lm.config.num_layers, lm.config.hidden_size, lm.config.vocab_size, lm.config.context_length) == \
        (c.num_layers, c.hidden_size, c.vocab_size, 65536)
    plain = "def f(x):\n    return x + 1\n" * 3
    assert lm.tokenizer.encode(plain) == [ord(ch) for ch in plain]  # byte b is token b
    assert lm.tokenizer.decode(lm.tokenizer.encode("naïve 🙂")) == "naïve 🙂"
    assert len(lm.tokenizer.encode("naïve 🙂")) == len("naïve 🙂".encode())
    chat = lm.chat_template.render([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert lm.tokenizer.encode(chat)[0] == c.vocab_size - 2  # the special token, not its characters

    before = path.stat().st_mtime_ns
    assert bench(["random-gguf", "--shape", "tiny", "--out", str(path)]) == 2
    assert "exists; name a new file" in capsys.readouterr().err and path.stat().st_mtime_ns == before
