"""Normal mode's decode step on the CPU (ktlong/models/cpu_decode.py): numpy and Numba calls over
stored weights and a bfloat16 cache, against LlamaModel.forward in torch over a float32 cache
whose K/V rows are rounded to bfloat16 as they are written, with each product's input rounded to
8 bits per run of 32 in numpy, as the step's integer products take it (the same values, torch's
arithmetic)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from cpu_ops import int8_runs
from cpu_ops.bf16 import bf16_word, to_bf16
from cpu_ops.gguf_matmul import Activations
from ktlong.errors import KtlongError
from ktlong.gguf.stored_matrix import StoredMatrix
from ktlong.gguf.weights import CpuWeights
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.models import llama
from ktlong.models.loader import load_model
from ktlong.session.dense import DenseSession
from ktlong.session.plan import resolve_chunk_size, resolve_dense_kv_dtype
from operators.dense_attention import dense_attention
from tests.tiny_gguf import TinySpec, write_tiny_gguf


class RoundedCache(DenseKVCache):
    """A float32 cache holding bfloat16-rounded K/V: what the bfloat16 cache holds, read by torch."""

    def append(self, layer, start, k, v):
        return super().append(layer, start, k.bfloat16().float(), v.bfloat16().float())


def rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] with each run of 32 as dx * round(x * 127 / max|run|), dx = max|run| / 127."""
    runs = x.float().numpy().reshape(-1, 32)
    big = np.abs(runs).max(1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(big > 0, np.float32(127) / big, np.float32(0))
    q = np.rint(runs * inverse)
    return torch.from_numpy((q * (big / np.float32(127))).reshape(x.shape)).to(x.dtype)


def test_eight_bit_activations_equal_numpy():
    x = Activations(2, 96)
    x.x[:] = np.random.default_rng(0).standard_normal((2, 96))
    x.x[:, 32:64] *= 1e-3  # a run of small values, and a run of zeros
    x.x[:, 64:] = 0
    x.quantize()
    if not x.int8:
        pytest.skip("no AVX2: the products take float32 activations")
    got = x.xq.reshape(2, 3, 32) * x.scales[:, :, None]
    np.testing.assert_array_equal(got.reshape(2, 96), rounded_to_8_bits(torch.from_numpy(x.x)).numpy())
    np.testing.assert_allclose(x.sums, x.xq.reshape(2, 6, 16).sum(2) * x.scales.repeat(2, 1), rtol=1e-6)


def decode_against_torch(tmp_path, fused, int8, monkeypatch, rounded=False):
    """Four decode steps of a qwen2-like model (q/k/v biases, 8 heads on 2 kv heads; unfused: q, k
    and v of three types) -> [(the step's logits, torch's)], and the two caches."""
    monkeypatch.setattr(int8_runs, "AVAILABLE", int8)
    types = {} if fused else {f"blk.{i}.attn_{p}.weight": t for i in range(2)
                              for p, t in (("q", T.Q4_0), ("k", T.Q5_1), ("v", T.Q8_0))}
    spec = TinySpec(arch="qwen2", hidden=256, intermediate=192, num_heads=8, num_kv_heads=2, head_dim=32,
                    qkv_bias=True, weight_type=T.Q4_1, context=1024)
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=7, tensor_types=types)
    lm = load_model(str(tmp_path / "m.gguf"), cpu=CpuWeights(stored=True))
    assert (lm.model.weights.layers[0].wqkv is None) == (not fused)
    session = DenseSession(lm.model, 400, 64, torch.bfloat16)
    assert session.cpu_step is not None and session.cpu_step.h.int8 == int8
    reference = RoundedCache(2, 2, 32, 400, torch.device("cpu"), torch.float32)
    prompt = np.random.default_rng(1).integers(0, spec.vocab, 300).tolist()  # past two blocks of 128
    session.prefill(prompt)
    lm.model.forward(torch.tensor(prompt), reference, 0)
    monkeypatch.setattr(int8_runs, "AVAILABLE", False)  # the reference's products: float32 (the step's Activations are made)
    if rounded:  # the reference's decode products take their inputs rounded to 8 bits, in numpy,
        # the head's too (the step's head takes them so; eight_bit is torch's own choice)
        linear = llama.linear
        monkeypatch.setattr(llama, "linear", lambda x, w, bias=None, eight_bit=True: linear(
            rounded_to_8_bits(x) if isinstance(w, StoredMatrix) else x, w, bias))
    token, pairs = 5, []
    for step in range(4):
        pairs.append((session.step(token), lm.model.forward(torch.tensor([token]), reference, 300 + step)[0]))
        token = int(pairs[-1][1].argmax())
    return pairs, session.cache, reference


@pytest.mark.parametrize("fused", [True, False])
def test_decode_steps_equal_torch_over_the_same_bf16_cache(tmp_path, fused, monkeypatch):
    # float32 activations: the same arithmetic as torch's, so the same logits to float32 sums
    pairs, cache, reference = decode_against_torch(tmp_path, fused, False, monkeypatch)
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for which, ref in ((cache.k, reference.k), (cache.v, reference.v)):
        torch.testing.assert_close(which[:, :, :304].float(), ref[:, :, :304], rtol=8e-3, atol=1e-3)


@pytest.mark.skipif(not int8_runs.AVAILABLE, reason="no AVX2: the products take float32 activations")
def test_decode_steps_with_8_bit_activations(tmp_path, monkeypatch):
    # the reference rounds each product's input to 8 bits as the step does (each kernel's sums over
    # such inputs are checked to float32 summation in test_gguf_matmul.py). The two compute those
    # inputs in different orders, so a value within an ulp of a rounding boundary can round apart:
    # one step of 1/127 of its run's largest value, which moves the logits by about 1% here,
    # against 3-9% for rounding the inputs at all (the same steps with float32 references).
    pairs, _, _ = decode_against_torch(tmp_path, False, True, monkeypatch, rounded=True)
    for got, want in pairs:
        assert F.cosine_similarity(got, want, dim=0) > 0.9999
        assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_one_query_over_a_bf16_cache_equals_torch():
    """DenseKVCache.attention's Numba path (one query, bfloat16 on the CPU) against dense_attention
    over the widened keys, across a partial last block."""
    cache = DenseKVCache(1, 2, 64, 300, torch.device("cpu"), torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(290, 2, 64, generator=gen), torch.randn(290, 2, 64, generator=gen)
    keys, values = cache.append(0, 0, k, v)
    q = torch.randn(1, 6, 64, generator=gen)
    got = cache.attention(0, q, 290, 0.125)
    torch.testing.assert_close(got, dense_attention(q, keys.float(), values.float(), 0.125), rtol=1e-4, atol=1e-5)


def test_bf16_words_round_to_nearest_even():
    import numba as nb

    @nb.njit
    def words(x, out):
        for i in range(x.shape[0]):
            out[i] = bf16_word(x[i])

    x = np.concatenate([np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, 1e-40, -1e-45, 3.3e38, 1.00390625, 1.01171875], np.float32)])
    out = np.empty(x.shape, np.uint16)
    words(x, out)
    np.testing.assert_array_equal(out, to_bf16(x))


def test_normal_mode_cache_types():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dense_kv_dtype("auto", cpu, torch.float32) == torch.bfloat16
    assert resolve_dense_kv_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert resolve_dense_kv_dtype("fp32", cpu, torch.float32) == torch.float32
    with pytest.raises(KtlongError, match="kv_type q8_0 is for --mode long_context"):
        resolve_dense_kv_dtype("q8_0", cpu, torch.float32)


def test_chunk_size_zero_is_8192_on_a_gpu_and_512_on_a_cpu_and_at_least_a_block():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_chunk_size(0, 128, cpu) == 512
    assert resolve_chunk_size(0, 128, cuda) == 8192
    assert resolve_chunk_size(0, 1024, cpu) == 1024  # a chunk is whole blocks
    assert resolve_chunk_size(2048, 128, cpu) == 2048  # a value set is kept
