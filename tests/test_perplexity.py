"""Perplexity equals exp(mean negative log-likelihood) of an independent reference."""

import json
import math

import numpy as np

from ktlong.models.loader import load_model
from ktlong.perplexity import main, perplexity
from tests.reference_llama import reference_logits
from tests.tiny_gguf import TinySpec, write_tiny_gguf


def test_perplexity_equals_reference_over_nonoverlapping_windows(tmp_path):
    spec = TinySpec()
    path = tmp_path / "tiny.gguf"
    tensors = write_tiny_gguf(path, spec, seed=7)
    lm = load_model(str(path))
    text = "Long context needs memory; the cache lives in DRAM. " * 3
    ids = lm.tokenizer.encode(text, parse_special=False)
    ctx = 16
    nll, count = 0.0, 0
    for w in range(len(ids) // ctx):
        window = ids[w * ctx:(w + 1) * ctx]
        logits = reference_logits(tensors, spec, window)
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= sum(logp[i, window[i + 1]] for i in range(ctx - 1))
        count += ctx - 1
    result = perplexity(lm, text, ctx)
    assert result["tokens"] == count
    assert math.isclose(result["ppl"], math.exp(nll / count), rel_tol=1e-4)


def test_cli_prints_json(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(), seed=8)
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 10)
    assert main(["--gguf_path", str(path), "--text_file", str(text), "--ctx", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"ppl", "tokens"} and out["tokens"] == 3 * 31 and out["ppl"] > 1


def test_cli_refuses_text_shorter_than_a_window(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(), seed=8)
    text = tmp_path / "t.txt"
    text.write_text("short")
    assert main(["--gguf_path", str(path), "--text_file", str(text), "--ctx", "64"]) == 2
    assert "fewer than one window" in capsys.readouterr().err
