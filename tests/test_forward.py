"""The dense llama-family forward equals independent references built from the same weights."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from ktlong.gguf.reader import GGUFFile
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.gguf.model_config import ModelConfig
from ktlong.models.llama import LlamaModel
from ktlong.gguf.weights import load_weights
from tests.reference_llama import reference_logits
from tests.tiny_gguf import TinySpec, write_tiny_gguf


def build(path):
    gf = GGUFFile(path)
    config = ModelConfig.from_gguf(gf)
    return LlamaModel(config, load_weights(gf, config, torch.device("cpu"), torch.float32)), config


def run(model, config, ids, chunks=None):
    cache = DenseKVCache(config.num_layers, config.num_kv_heads, config.head_dim, len(ids),
                         torch.device("cpu"), torch.float32)
    chunks = chunks or [len(ids)]
    out, start = [], 0
    for size in chunks:
        out.append(model.forward(torch.tensor(ids[start:start + size]), cache, start))
        start += size
    return torch.cat(out).numpy()


def max_rel(a, b):
    """The largest difference over the largest magnitude, in the arrays' dtype (float32 rounds at a
    few 1e-7 of it, far below the 1e-4 the tests allow)."""
    return float(np.abs(a - b).max() / np.abs(b).max())


SPECS = {
    "llama-q8_0": TinySpec(),
    "llama-tied-q4_0": TinySpec(tied=True, weight_type=T.Q4_0),
    "qwen2-bias-f16": TinySpec(arch="qwen2", qkv_bias=True, weight_type=T.F16),
    "llama-mha-q5_0": TinySpec(num_kv_heads=4, weight_type=T.Q5_0),
    # 7 layers: layer 5 is global, the rest slide over 8 tokens of the 23
    "gemma3-sliding": TinySpec(arch="gemma3", num_layers=7, num_kv_heads=1, tied=True, sliding_window=8,
                               rope_base=1e6),
}


@pytest.mark.parametrize("name", SPECS)
def test_tiny_model_logits_equal_float64_reference(tmp_path, name):
    spec = SPECS[name]
    path = tmp_path / "tiny.gguf"
    tensors = write_tiny_gguf(path, spec, seed=1)
    model, config = build(path)
    assert config.has_qkv_bias == spec.qkv_bias and config.has_output_head == (not spec.tied)
    ids = list(np.random.default_rng(2).integers(0, spec.vocab, size=23))
    expected = reference_logits(tensors, spec, ids)
    assert max_rel(run(model, config, ids), expected) < 1e-4


def test_chunked_forward_with_cache_equals_one_pass(tmp_path):
    spec = TinySpec()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, spec, seed=3)
    model, config = build(path)
    ids = list(np.random.default_rng(4).integers(0, spec.vocab, size=19))
    whole = run(model, config, ids)
    pieces = run(model, config, ids, chunks=[7, 1, 5, 6])
    assert max_rel(pieces, whole) < 1e-5


@pytest.mark.slow
def test_smollm2_logits_equal_transformers(smollm2_path, hf_model, real_model):
    lm = real_model("smollm2-135m")
    text = "The capital of France is Paris. In 1889 the Eiffel Tower opened; def f(x): return x"
    ids = lm.tokenizer.encode(text)
    c = lm.config
    ours = run(lm.model, c, ids)
    with torch.no_grad():
        theirs = hf_model(smollm2_path)(torch.tensor([ids])).logits[0].numpy()
    assert max_rel(ours, theirs) < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.slow
def test_gemma3_270m_logits_equal_transformers_past_the_sliding_window(hf_model, real_model):
    from ktlong.gguf.registry import resolve_model_path

    path = resolve_model_path("gemma3-270m")
    lm = real_model("gemma3-270m")
    c = lm.config
    assert c.sliding_window == 512 and c.sliding_layers[:6] == (True,) * 5 + (False,)
    ids = [lm.tokenizer.bos_id] + list(range(1000, 1700))  # 701 tokens: past the 512 window
    # the logits of the last 62 positions (the output head over 262K words is most of the work):
    # the first 639 tokens as one chunk whose last logits alone are made, then the rest
    cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), torch.device("cpu"), torch.float32)
    ours = torch.cat([lm.model.forward(torch.tensor(ids[:640]), cache, 0, last_only=True),
                      lm.model.forward(torch.tensor(ids[640:]), cache, 640)]).numpy()
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([ids]), logits_to_keep=62).logits[0].numpy()
    assert ours.shape == theirs.shape == (62, c.vocab_size)
    assert max_rel(ours, theirs) < 1e-4 and (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("num_kv,group,window", [(3, 3, 0), (2, 7, 0), (2, 7, 100), (4, 1, 0)])
def test_one_query_attention_equals_softmax_reference(num_kv, group, window):
    """A decode step's attention on the CPU (one query per head; dense_attention's batched
    per-group path) over strided head-major views of a cache equals softmax(q k / sqrt(d)) v in
    float64, the last `window` keys when windowed."""
    from operators.dense_attention import dense_attention

    g = torch.Generator().manual_seed(num_kv * 10 + group)
    dim, num_k = 64, 777
    cache_k, cache_v = (torch.randn(num_kv, 1000, dim, generator=g) for _ in range(2))
    k, v = cache_k[:, :num_k], cache_v[:, :num_k]  # views with the cache's stride
    q = torch.randn(1, num_kv * group, dim, generator=g)
    got = dense_attention(q, k, v, None, window)
    lo = num_k - window if window else 0
    kk, vv = k[:, lo:].double().repeat_interleave(group, 0), v[:, lo:].double().repeat_interleave(group, 0)
    weights = torch.softmax(torch.einsum("hd,hkd->hk", q[0].double(), kk) / dim ** 0.5, -1)
    expected = torch.einsum("hk,hkd->hd", weights, vv)
    assert got.shape == (1, num_kv * group, dim)
    assert torch.allclose(got[0].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv,group,num_q,num_k", [(3, 3, 64, 300), (2, 7, 100, 777), (4, 1, 16, 17)])
def test_a_chunk_after_its_history_equals_softmax_reference(num_kv, group, num_q, num_k):
    """A prefill chunk's attention on the CPU below a history (dense_attention's split into the
    history and the chunk's own causal keys, merged by log-sum-exp) over strided head-major views
    equals causal softmax(q k / sqrt(d)) v in float64, query i seeing keys up to num_k - num_q + i."""
    from operators.dense_attention import dense_attention

    g = torch.Generator().manual_seed(num_kv * 100 + num_q)
    dim = 32
    cache_k, cache_v = (torch.randn(num_kv, 1000, dim, generator=g) for _ in range(2))
    k, v = cache_k[:, :num_k], cache_v[:, :num_k]
    q = torch.randn(num_q, num_kv * group, dim, generator=g)
    got = dense_attention(q, k, v, None)
    kk, vv = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hkd->htk", q.double(), kk) / dim ** 0.5
    visible = torch.arange(num_k)[None, :] <= torch.arange(num_q)[:, None] + (num_k - num_q)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    expected = torch.einsum("htk,hkd->thd", weights, vv)
    assert got.shape == (num_q, num_kv * group, dim)
    assert torch.allclose(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("biased", [("q", "k", "v"), ("k",), ()])
def test_qkv_adds_each_part_its_own_bias(biased):
    """q, k and v come from one product of the fused matrix; each part that has a bias gets it,
    whether all three have one (one add over the whole product) or only some."""
    from ktlong.gguf.weights import fuse_projections
    from ktlong.models.random_model import random_model

    model = random_model("tiny", torch.device("cpu"), torch.float32, seed=3)
    c, layer = model.config, model.weights.layers[0]
    g = torch.Generator().manual_seed(4)
    parts = {"q": layer.wq, "k": layer.wk, "v": layer.wv}
    biases = {p: torch.randn(parts[p].shape[0], generator=g) if p in biased else None for p in parts}
    layer.wq, layer.wk, layer.wv = (parts[p].clone() for p in "qkv")  # separate again, then fused anew
    layer.bq, layer.bk, layer.bv = biases["q"], biases["k"], biases["v"]
    layer.wqkv = layer.bqkv = None
    fuse_projections(layer)
    assert (layer.bqkv is not None) == (len(biased) == 3)
    x = torch.randn(2, c.hidden_size, generator=g)
    positions = torch.tensor([0, 1])
    q, k, v = model.qkv(0, x, positions, model.rope_tables(positions))
    from ktlong.models.llama import rms_norm
    from ktlong.models.rope import apply_rope

    h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
    cos, sin = model.rope_tables(positions)[False]
    expected = {p: h @ parts[p].T + (biases[p] if biases[p] is not None else 0) for p in parts}
    heads = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
    expected = {p: e.view(2, heads[p], c.head_dim) for p, e in expected.items()}
    torch.testing.assert_close(q, apply_rope(expected["q"], cos, sin))
    torch.testing.assert_close(k, apply_rope(expected["k"], cos, sin))
    torch.testing.assert_close(v, expected["v"])
