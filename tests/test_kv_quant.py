"""q8_0 / q4_0 K/V: the torch quantiser (operators/kv_quant.py, run on the GPU in prefill and
decode) and the numpy reference (cpu_ops/kv_storage.py) give GGML's blocks bit for bit, as
gguf.quants.quantize does, and widen back within the format's error."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from cpu_ops.kv_storage import decode, encode
from operators.kv_quant import dequantize_kv, quantize_kv

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def ggml_bytes(data: np.ndarray, scales: np.ndarray, kv_type: str) -> np.ndarray:
    """Our two planes put back into GGML's blocks: per 32 values, the float16 scale then the values."""
    groups = scales.shape[-1]
    values = data.view(np.uint8).reshape(*data.shape[:-1], groups, -1)
    d = scales.view(np.uint16).astype("<u2").view(np.uint8).reshape(*scales.shape, 2)
    return np.concatenate([d, values], -1).reshape(*data.shape[:-1], -1)


def hard_rows(rng, dim=128) -> np.ndarray:
    """Random rows at several scales, plus blocks that probe the rounding rules: all zeros, ties
    of magnitude (+m and -m), values that land on .5 after scaling, one huge outlier."""
    rows = [rng.standard_normal((64, dim)) * s for s in (1e-3, 1.0, 30.0)]
    special = np.zeros((4, dim))
    special[1, :32] = np.tile([2.0, -2.0, 1.0, 0.5], 8)
    special[2, 32:64] = (np.arange(32) - 16) * (127 / 16.0) / 127 * 2.54  # multiples of half a step
    special[3] = rng.standard_normal(dim)
    special[3, 5] = 1e4
    rows.append(special)
    return np.concatenate(rows).astype(np.float32)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_torch_and_numpy_quantisers_equal_gguf_bit_for_bit(kv_type):
    x = hard_rows(np.random.default_rng(0))
    expected = gguf_quantize(x, GGML[kv_type])
    data, scales = quantize_kv(torch.from_numpy(x), kv_type)
    np.testing.assert_array_equal(ggml_bytes(data.numpy(), scales.numpy(), kv_type), expected)
    stored = encode(x[None, None], kv_type)  # [1, 1, T, D]
    np.testing.assert_array_equal(ggml_bytes(stored.data[0, 0], stored.scales[0, 0], kv_type), expected)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_dequantised_values_are_within_the_formats_error(kv_type):
    x = hard_rows(np.random.default_rng(1))
    data, scales = quantize_kv(torch.from_numpy(x), kv_type)
    back = dequantize_kv(data, scales, kv_type, torch.float32).numpy()
    blocks = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1, keepdims=True)
    step = blocks / (127 if kv_type == "q8_0" else 8)  # one quantisation step per block
    # half a step from rounding (q4_0: a whole one where +8 is clipped to 7), plus the float16
    # scale's rounding (relative 2^-11, or absolute 2^-25 where it is subnormal) times the value
    levels = 127 if kv_type == "q8_0" else 8
    bound = step * (0.5 if kv_type == "q8_0" else 1.0) + blocks * 2 ** -10 + levels * 2 ** -25
    assert (np.abs(back - x).reshape(bound.shape[0], -1, 32) <= bound).all()
    np.testing.assert_array_equal(back, decode(encode(x[None, None], kv_type))[0, 0])  # one widening rule


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_real_keys_and_values_quantise_like_gguf(real_model, kv_type):
    from ktlong.kv.dense_cache import DenseKVCache

    lm = real_model("smollm2-135m")
    c = lm.config
    ids = lm.tokenizer.encode("Long documents need their keys and values kept in host memory. " * 8)
    cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), lm.model.device, torch.float32)
    lm.model.forward(torch.tensor(ids), cache, 0)
    for t in (cache.k[:, :, :len(ids)], cache.v[:, :, :len(ids)]):
        x = t.reshape(-1, c.head_dim).contiguous()
        data, scales = quantize_kv(x, kv_type)
        expected = gguf_quantize(x.numpy(), GGML[kv_type])
        np.testing.assert_array_equal(ggml_bytes(data.numpy(), scales.numpy(), kv_type), expected)
