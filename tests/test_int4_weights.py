"""Quantised GGUF weights kept compact on the CPU (CpuWeights): 4-bit matrices kept 4-bit
(ktlong/gguf/int4_weights.py) against dequantise-then-matmul, the same products but for
bfloat16 inputs, within the 4-bit format's own error of the float32 result, rows reordered as
the loader reorders q and k; the embedding and head in bfloat16, the dequantised values rounded."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from ktlong.gguf.dequant import dequantize
from ktlong.gguf.reader import GGUFFile
from ktlong.gguf.model_config import ModelConfig
from ktlong.gguf import weights as weights_module
from ktlong.gguf.weights import CpuWeights, load_weights, unpermute_qk
from ktlong.gguf.stored_rows import StoredRows
from ktlong.gguf.int4_weights import Int4Weight, linear
from tests.tiny_gguf import TinySpec, write_tiny_gguf


# per type: how many float16 fields open a block (scale, and minimum or dmin), then bytes of codes and tables
LAYOUTS = {T.Q4_0: (1, 16), T.Q4_1: (2, 16), T.Q4_K: (2, 140), T.Q5_0: (1, 20), T.Q5_1: (2, 20), T.Q5_K: (2, 172)}


def random_blocks(ggml_type, out_features, in_features, seed) -> torch.Tensor:
    """A tensor's bytes of a 4- or 5-bit type: random codes, fifth bits and K tables, scales of
    both signs, minimums."""
    rng = np.random.default_rng(seed)
    per_block = 256 if ggml_type in (T.Q4_K, T.Q5_K) else 32
    n = out_features * in_features // per_block
    fields, rest = LAYOUTS[ggml_type]
    size = 0.002 if per_block == 256 else 0.02  # K types: the 6-bit scales multiply d
    parts = [(rng.standard_normal(n) * size * (1 + 1.5 * i)).astype(np.float16).view(np.uint8).reshape(n, 2)
             for i in range(fields)]
    parts.append(rng.integers(0, 256, (n, rest), dtype=np.uint8))
    return torch.from_numpy(np.concatenate(parts, axis=1).reshape(-1).copy())


@pytest.mark.parametrize("ggml_type", list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 5])  # a decode step, a prefill chunk
def test_int4_product_equals_dequantize_then_matmul(ggml_type, rows):
    out_features, in_features = 96, 256
    raw = random_blocks(ggml_type, out_features, in_features, seed=rows)
    w = dequantize(raw, ggml_type, (out_features, in_features))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(out_features)
    weight = Int4Weight.from_blocks(raw, ggml_type, (out_features, in_features))
    assert len(weight.planes) == (2 if ggml_type in (T.Q5_0, T.Q5_1, T.Q5_K) else 1)
    y = linear(x, weight, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    exact = x.double() @ w.double().t() + bias.double()
    # bfloat16 inputs, scales, zeros and each plane's output: each within 2^-8 relative of its value
    bound = 2 ** -7 * (x.abs().double() @ w.abs().double().t() + exact.abs()) * len(weight.planes) + 1e-6
    assert ((y.double() - exact).abs() <= bound).all()
    if ggml_type not in (T.Q4_K, T.Q5_K):  # offsets of a few steps, as quantisers make them: inside half a step
        levels = 31 if ggml_type in (T.Q5_0, T.Q5_1) else 15
        runs = w.view(out_features, -1, 32)
        half_step = (runs.amax(-1) - runs.amin(-1)).repeat_interleave(32, 1) / (2 * levels)
        assert ((y.double() - exact).abs() <= x.abs().double() @ half_step.double().t()).all()


def test_rows_reorder_codes_scales_and_zeros_alike():
    """The loader undoes llama.cpp's q/k row permutation on the codes, scales and zeros: the
    product's outputs are the unreordered weight's, reordered, to the bit."""
    out_features, in_features, heads = 64, 128, 4
    raw = random_blocks(T.Q4_1, out_features, in_features, seed=3)
    plain = Int4Weight.from_blocks(raw, T.Q4_1, (out_features, in_features))
    reordered = Int4Weight.from_blocks(raw, T.Q4_1, (out_features, in_features), lambda t: unpermute_qk(t, heads))
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(4))
    assert torch.equal(linear(x, reordered), unpermute_qk(linear(x, plain).t(), heads).t())


def test_a_ranks_share_is_dequantised(tmp_path):
    """CpuWeights apply to a CPU in one process: tensor parallelism splits float weights."""
    write_tiny_gguf(tmp_path / "m.gguf", TinySpec(num_layers=1), seed=1,
                    tensor_types={"blk.0.ffn_up.weight": T.Q4_0, "blk.0.ffn_down.weight": T.Q5_0})
    gf = GGUFFile(tmp_path / "m.gguf")
    config = ModelConfig.from_gguf(gf)
    compact = CpuWeights(int4=True, bf16=True)
    whole = load_weights(gf, config, torch.device("cpu"), torch.float32, None, compact)
    assert isinstance(whole.layers[0].w_up, Int4Weight) and whole.output.dtype == torch.bfloat16
    assert isinstance(whole.embed, StoredRows)  # read a row per token: kept as the file stores it
    assert len(whole.layers[0].w_down.planes) == 2
    shared = load_weights(gf, config, torch.device("cpu"), torch.float32, (0, 2), compact)
    assert isinstance(shared.layers[0].w_up, torch.Tensor) and shared.embed.dtype == torch.float32


def test_bf16_tables_are_the_dequantised_table_rounded_within_half_a_q8_0_step(tmp_path, monkeypatch):
    """cpu_bf16: the untied Q8_0 head, dequantised a few rows at a time, is the float32
    dequantisation rounded to bfloat16, to the bit; each value within half its block's q8_0 step
    (d) of the GGUF's. The embedding beside it stays Q8_0, its rows the float32 dequantisation."""
    monkeypatch.setattr(weights_module, "HEAD_ROWS", 7)  # several slices, the last one short
    q8 = {"token_embd.weight": T.Q8_0, "output.weight": T.Q8_0}
    write_tiny_gguf(tmp_path / "m.gguf", TinySpec(num_layers=1), seed=2, tensor_types=q8)
    gf = GGUFFile(tmp_path / "m.gguf")
    config = ModelConfig.from_gguf(gf)
    w = load_weights(gf, config, torch.device("cpu"), torch.float32, None, CpuWeights(bf16=True))
    embed = dequantize(torch.from_numpy(np.array(gf.raw("token_embd.weight"))), T.Q8_0, w.embed.shape)
    ids = torch.arange(embed.shape[0])
    assert isinstance(w.embed, StoredRows) and torch.equal(w.embed[ids], embed)
    for name, table in (("output.weight", w.output),):
        raw = torch.from_numpy(np.array(gf.raw(name)))
        exact = dequantize(raw, T.Q8_0, table.shape)
        assert table.dtype == torch.bfloat16 and torch.equal(table, exact.to(torch.bfloat16))
        d = raw.view(-1, 34)[:, :2].contiguous().view(torch.float16).float().repeat_interleave(32).view(table.shape)
        assert ((table.float() - exact).abs() <= d.abs() / 2).all()


def test_bf16_matrices_are_the_dequantised_ones_rounded(tmp_path):
    """cpu_bf16: Q8_0 layer matrices become their float32 dequantisation rounded to bfloat16, to
    the bit; a float32 matrix stays float32; a product over one takes its input in bfloat16 and
    returns float32, within bfloat16 rounding of the float32 product."""
    types = {"blk.0.attn_v.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q8_0}
    write_tiny_gguf(tmp_path / "m.gguf", TinySpec(num_layers=1, weight_type=T.F32), seed=3, tensor_types=types)
    gf = GGUFFile(tmp_path / "m.gguf")
    layer = load_weights(gf, ModelConfig.from_gguf(gf), torch.device("cpu"), torch.float32, None,
                         CpuWeights(bf16=True)).layers[0]
    for name, w in (("blk.0.attn_v.weight", layer.wv), ("blk.0.ffn_down.weight", layer.w_down)):
        exact = dequantize(torch.from_numpy(np.array(gf.raw(name))), types[name], w.shape)
        assert w.dtype == torch.bfloat16 and torch.equal(w, exact.to(torch.bfloat16))
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(1))
        y, reference = linear(x, w), x.double() @ exact.double().t()
        assert y.dtype == torch.float32
        assert ((y.double() - reference).abs() <= 2 ** -7 * (x.abs().double() @ exact.abs().double().t()) + 1e-6).all()
    assert layer.wq.dtype == torch.float32  # a float type keeps dtype


def test_q6_k_values_in_bf16_stay_within_an_eighth_of_their_step():
    """Q6_K's weights d * sc * (q - 32) (sixteen per scale, |q - 32| <= 32) rounded to bfloat16
    (half a unit in the last place: 2^-8 of a value) move by at most an eighth of their step
    d * sc: what cpu_bf16 claims for the 6-bit matrices it narrows."""
    rng = np.random.default_rng(6)
    n = 64
    blocks = rng.integers(0, 256, (n, 210), dtype=np.uint8)
    blocks[:, 208:210] = (rng.standard_normal((n, 1)) * 0.001).astype(np.float16).view(np.uint8)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    exact = dequantize(raw, T.Q6_K, (n, 256))
    step = (torch.from_numpy(blocks[:, 208:210].copy()).view(torch.float16).float()
            * torch.from_numpy(blocks[:, 192:208].copy()).view(torch.int8).float()).abs().repeat_interleave(16, 1)
    assert ((exact.to(torch.bfloat16).float() - exact).abs() <= step / 8).all()


@pytest.mark.slow
def test_smollm2_with_4bit_weights_answers_as_with_float_weights():
    """SmolLM2-135M (Q4_1 layers, a Q8_0 tied embedding): the next-token logits with its layers
    kept 4-bit, and with the embedding and head in bfloat16 too, are the dequantised model's
    within bfloat16 rounding, the same token first."""
    from ktlong.kv.dense_cache import DenseKVCache
    from ktlong.models.loader import load_model

    float_lm = load_model("smollm2-135m", "cpu", torch.float32)
    int4_lm = load_model("smollm2-135m", "cpu", torch.float32, cpu=CpuWeights(int4=True))
    compact_lm = load_model("smollm2-135m", "cpu", torch.float32, cpu=CpuWeights(int4=True, bf16=True))
    assert isinstance(int4_lm.model.weights.layers[0].wq, Int4Weight)
    assert compact_lm.model.weights.output.dtype == torch.bfloat16 and compact_lm.model.dtype == torch.float32
    ids = torch.tensor(float_lm.tokenizer.encode("The capital of France is"))
    c = float_lm.config
    logits = []
    for lm in (float_lm, int4_lm, compact_lm):
        cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), torch.device("cpu"), torch.float32)
        logits.append(lm.model.forward(ids, cache, 0, last_only=True)[0])
    for other in logits[1:]:
        assert int(logits[0].argmax()) == int(other.argmax())
        cosine = torch.nn.functional.cosine_similarity(logits[0], other, dim=0)
        assert cosine > 0.999, cosine
