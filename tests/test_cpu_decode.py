"""Normal mode's decode step on the CPU (ktlong/models/cpu_decode.py): numpy and Numba calls over
stored weights and a bfloat16 cache, against LlamaModel.forward in torch over a float32 cache
whose K/V rows are rounded to bfloat16 as they are written (the same values, torch's arithmetic)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from cpu_ops.bf16 import bf16_word, to_bf16
from ktlong.errors import KtlongError
from ktlong.gguf.weights import CpuWeights
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.models.loader import load_model
from ktlong.session.dense import DenseSession
from ktlong.session.plan import resolve_dense_kv_dtype
from operators.dense_attention import dense_attention
from tests.tiny_gguf import TinySpec, write_tiny_gguf


class RoundedCache(DenseKVCache):
    """A float32 cache holding bfloat16-rounded K/V: what the bfloat16 cache holds, read by torch."""

    def append(self, layer, start, k, v):
        return super().append(layer, start, k.bfloat16().float(), v.bfloat16().float())


@pytest.mark.parametrize("fused", [True, False])
def test_decode_steps_equal_torch_over_the_same_bf16_cache(tmp_path, fused):
    # qwen2-like: q/k/v biases, 8 heads on 2 kv heads; unfused: q, k and v of three types
    types = {} if fused else {f"blk.{i}.attn_{p}.weight": t for i in range(2)
                              for p, t in (("q", T.Q4_0), ("k", T.Q5_1), ("v", T.Q8_0))}
    spec = TinySpec(arch="qwen2", hidden=256, intermediate=192, num_heads=8, num_kv_heads=2, head_dim=32,
                    qkv_bias=True, weight_type=T.Q4_1, context=1024)
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=7, tensor_types=types)
    lm = load_model(str(tmp_path / "m.gguf"), cpu=CpuWeights(stored=True))
    assert (lm.model.weights.layers[0].wqkv is None) == (not fused)
    session = DenseSession(lm.model, 400, 64, torch.bfloat16)
    assert session.cpu_step is not None
    reference = RoundedCache(2, 2, 32, 400, torch.device("cpu"), torch.float32)
    prompt = np.random.default_rng(1).integers(0, spec.vocab, 300).tolist()  # past two blocks of 128
    session.prefill(prompt)
    lm.model.forward(torch.tensor(prompt), reference, 0)
    token = 5
    for step in range(4):
        got = session.step(token)
        want = lm.model.forward(torch.tensor([token]), reference, 300 + step)[0]
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        token = int(want.argmax())
    for which, ref in ((session.cache.k, reference.k), (session.cache.v, reference.v)):
        torch.testing.assert_close(which[:, :, :304].float(), ref[:, :, :304], rtol=8e-3, atol=1e-3)


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
