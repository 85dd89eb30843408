"""The Numba kernels that read GGUF blocks in place (cpu_ops/gguf_matmul.py) against the `gguf`
package's own numpy dequantisation: the same float32 weights, bit for bit, for every type with a
kernel, subnormal scales included; products equal to dequantise-then-matmul within float32
summation, over float32 inputs and over inputs rounded to 8 bits (integer lanes); a StoredMatrix (ktlong/gguf/stored_matrix.py) the same for decode steps and prefill
chunks."""

import numba
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from cpu_ops.gguf_blocks import KERNEL_TYPES, half_by_bits
from cpu_ops import int8_runs
from cpu_ops.gguf_matmul import Activations, dequantize, matmul, product_into
from ktlong.gguf.stored_matrix import MAX_IN_PLACE_ROWS, StoredMatrix
from ktlong.models.llama import linear

# byte offsets of each block's float16 fields (scales, minimums)
HALVES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
          T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(ggml_type, rows: int, width: int, seed: int) -> np.ndarray:
    """[rows, row_bytes] of random codes and tables under random scales of both signs, a few of
    them float16 subnormals."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = rows * width // block_size
    blocks = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    for o in HALVES[ggml_type]:
        scale = rng.standard_normal(n) * (0.002 if block_size == 256 else 0.02)
        scale[::7] *= 1e-3  # under float16's smallest normal, 6.1e-5
        blocks[:, o:o + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def reference(ggml_type, blocks: np.ndarray, width: int) -> np.ndarray:
    return gguf_dequantize(blocks, ggml_type).reshape(blocks.shape[0], width).astype(np.float32)


def test_halves_widened_without_f16c_equal_numpy():
    # every finite half, subnormals included (the kernels take this path where F16C is missing)
    halves = np.arange(1 << 16, dtype=np.uint16)
    finite = halves[np.isfinite(halves.view(np.float16))]
    u8 = finite.view(np.uint8)

    @numba.njit
    def widen_all(u8, out):
        for i in range(out.shape[0]):
            out[i] = half_by_bits(u8, np.uint64(2 * i))

    got = np.empty(finite.shape[0], np.float32)
    widen_all(u8, got)
    assert np.array_equal(got.view(np.uint32), finite.view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_the_gguf_package(ggml_type):
    rows, width = 45, 512  # rows not a multiple of a thread's share; two K blocks per row
    blocks = random_blocks(ggml_type, rows, width, seed=1)
    got, want = dequantize(ggml_type, blocks, width), reference(ggml_type, blocks, width)
    if ggml_type == T.Q6_K:  # the package rounds d * scale * q in another order
        np.testing.assert_allclose(got, want, rtol=2 ** -23, atol=0)
    else:
        assert np.array_equal(got, want)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_x", [1, 3])
def test_product_equals_dequantize_then_matmul(ggml_type, num_x):
    rows, width = 70, 768
    blocks = random_blocks(ggml_type, rows, width, seed=num_x)
    w = reference(ggml_type, blocks, width).astype(np.float64)
    x = np.random.default_rng(5).standard_normal((num_x, width)).astype(np.float32)
    y = matmul(ggml_type, blocks, x)
    exact = x.astype(np.float64) @ w.T
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T)  # float32 sums of 768 terms
    assert y.shape == (num_x, rows) and (np.abs(y - exact) <= bound).all()


@pytest.mark.skipif(not int8_runs.AVAILABLE, reason="no AVX2: products take float32 inputs (tested above)")
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_x", [1, 3])
def test_8_bit_product_equals_dequantize_then_matmul(ggml_type, num_x):
    rows, width = 70, 768
    blocks = random_blocks(ggml_type, rows, width, seed=num_x + 10)
    w = reference(ggml_type, blocks, width).astype(np.float64)
    x = Activations(num_x, width)
    x.x[:] = np.random.default_rng(6).standard_normal((num_x, width))
    x.x[:, :32] = 0  # a run of zeros
    x.quantize()
    rounded = x.xq.reshape(num_x, -1, 32) * x.scales[:, :, None].astype(np.float64)  # what the kernel multiplies
    assert np.abs(rounded.reshape(num_x, width) - x.x).max() <= np.abs(x.x).max() / 254 * 1.0001
    y = np.empty((num_x, rows), np.float32)
    product_into(ggml_type, blocks, blocks.view(np.int8), x, y)
    exact = rounded.reshape(num_x, width) @ w.T
    bound = 1e-5 * (np.abs(rounded.reshape(num_x, width)) @ np.abs(w).T)
    assert (np.abs(y - exact) <= bound).all()


def test_product_into_without_avx2_takes_float32_inputs():
    blocks = random_blocks(T.Q4_K, 8, 512, seed=2)
    x = Activations(1, 512, int8=False)
    x.x[:] = np.random.default_rng(1).standard_normal((1, 512))
    x.quantize()
    y = np.empty((1, 8), np.float32)
    product_into(T.Q4_K, blocks, blocks.view(np.int8), x, y)
    assert np.array_equal(y, matmul(T.Q4_K, blocks, x.x))


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("num_x", [1, MAX_IN_PLACE_ROWS, MAX_IN_PLACE_ROWS + 1])  # in place, and dequantised
def test_stored_matrix_products(num_x, int8, monkeypatch):
    """A few rows go in place, over their 8-bit form where the machine has AVX2 (int8): within the
    rounding's bound, half a step (max|run| / 254) an input times |w|, and float32 sums; more
    rows go over the matrix dequantised, in float32."""
    if int8 and not int8_runs.AVAILABLE:
        pytest.skip("no AVX2: the products take float32 activations")
    monkeypatch.setattr(int8_runs, "AVAILABLE", int8)
    blocks = random_blocks(T.Q5_0, 40, 256, seed=9)
    w = reference(T.Q5_0, blocks, 256).astype(np.float64)
    matrix = StoredMatrix(blocks, T.Q5_0, (40, 256))
    x = torch.randn(num_x, 256, generator=torch.Generator().manual_seed(3))
    x64 = x.double().numpy()
    in_8_bits = int8 and num_x <= MAX_IN_PLACE_ROWS
    half_step = np.abs(x64).reshape(num_x, -1, 32).max(2) / 254 * in_8_bits
    rounding = np.einsum("mr,orj->mo", half_step, np.abs(w).reshape(40, -1, 32))
    bound = 1.0001 * rounding + 1e-5 * (np.abs(x64) @ np.abs(w).T) + 1e-30
    for y in (linear(x, matrix, eight_bit=True), torch.from_numpy(matrix.product(x.numpy(), eight_bit=True))):
        assert (np.abs(y.double().numpy() - x64 @ w.T) <= bound).all()
    assert linear(x.bfloat16(), matrix, eight_bit=True).dtype == torch.bfloat16
    if in_8_bits:  # rounded: not float32's product
        assert not np.allclose(matrix.product(x.numpy(), eight_bit=True), x64 @ w.T, rtol=1e-5, atol=1e-5)


def test_inputs_that_do_not_fit_are_refused():
    blocks = random_blocks(T.Q8_0, 4, 64, seed=0)
    with pytest.raises(ValueError, match="do not hold rows of 96"):
        matmul(T.Q8_0, blocks, np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="no kernel reads"):
        dequantize(T.Q2_K, blocks, 64)
    with pytest.raises(ValueError, match="x must be float32"):
        matmul(T.Q8_0, blocks, np.zeros((1, 64), np.float64))
