"""Our torch dequantisation equals gguf's own numpy dequantisation, bit for bit."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from ktlong.gguf.dequant import SUPPORTED_TYPES, dequantize

# byte ranges of the f16 scale fields in each block, set to finite values so random
# blocks do not produce inf * 0
F16_FIELDS = {
    T.Q4_0: [(0, 2)], T.Q4_1: [(0, 4)], T.Q5_0: [(0, 2)], T.Q5_1: [(0, 4)], T.Q8_0: [(0, 2)],
    T.Q2_K: [(80, 84)], T.Q3_K: [(108, 110)], T.Q4_K: [(0, 4)], T.Q5_K: [(0, 4)],
    T.Q6_K: [(208, 210)],
}


def random_blocks(ggml_type, num_blocks, rng):
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for lo, hi in F16_FIELDS[ggml_type]:
        scales = rng.uniform(-2, 2, size=(num_blocks, (hi - lo) // 2)).astype(np.float16)
        blocks[:, lo:hi] = scales.view(np.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("ggml_type", sorted(F16_FIELDS, key=int), ids=lambda t: t.name)
def test_block_dequant_matches_gguf_numpy_on_random_blocks(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    rows, cols = 6, 4 * max(block_size, 256)
    raw = random_blocks(ggml_type, rows * cols // block_size, rng)
    expected = gguf_dequantize(raw.reshape(rows, -1), ggml_type)
    got = dequantize(torch.from_numpy(raw), ggml_type, (rows, cols)).numpy()
    assert expected.shape == got.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("ggml_type,np_dtype", [(T.F32, np.float32), (T.F16, np.float16)],
                         ids=["F32", "F16"])
def test_float_types_are_reinterpreted_exactly(ggml_type, np_dtype):
    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np_dtype)
    got = dequantize(torch.from_numpy(values.view(np.uint8).reshape(-1).copy()), ggml_type, (3, 64))
    np.testing.assert_array_equal(got.numpy(), values.astype(np.float32))


def test_bf16_is_the_high_half_of_float32():
    values = np.random.default_rng(1).standard_normal(128).astype(np.float32)
    high_halves = values.view(np.uint16)[1::2].copy()  # little-endian: odd halves are high
    got = dequantize(torch.from_numpy(high_halves.view(np.uint8)), T.BF16, (128,))
    expected = gguf_dequantize(high_halves.view(np.uint8).reshape(1, -1), T.BF16).reshape(-1)
    np.testing.assert_array_equal(got.numpy(), expected)
    np.testing.assert_allclose(got.numpy(), values, rtol=1e-2)


def test_every_required_type_is_supported():
    required = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
    assert required <= SUPPORTED_TYPES


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_tensors_match_gguf_numpy(model):
    from ktlong.gguf.reader import GGUFFile
    from ktlong.gguf.registry import resolve_model_path

    gf = GGUFFile(resolve_model_path(model))
    seen = set()
    for info in gf.tensors.values():
        if info.ggml_type in seen:
            continue
        seen.add(info.ggml_type)
        rows = int(np.prod(info.shape[:-1]))
        kept = min(rows, 2048)  # rows dequantise alike: the first 2,048 of an embedding of 151K
        raw = np.array(gf.raw(info.name).reshape(rows, -1)[:kept])  # a copy: the map is read-only
        expected = gguf_dequantize(raw, info.ggml_type).reshape(kept, info.shape[-1])
        got = dequantize(torch.from_numpy(raw.reshape(-1)), info.ggml_type, (kept, info.shape[-1])).numpy()
        np.testing.assert_array_equal(got, expected, err_msg=f"{info.name} {info.ggml_type.name}")
    assert len(seen) >= 3
