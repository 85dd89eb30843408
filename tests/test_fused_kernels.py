"""The Triton RMSNorm and rotary kernels (operators/rms_norm_kernel.py, operators/rope_kernel.py)
against the torch versions the model runs on the CPU. float32 in Triton's interpreter on the
CPU, where the two must agree exactly but for the order of the norm's sum; bf16 on a GPU, where
the rounding steps are the torch versions' but the compiler may fuse a product into a sum (the
interpreter narrows to bf16 by truncation, so bf16 is compared there only)."""

import pytest
import torch

from ktlong.models import llama
from ktlong.models.rope import apply_rope, rope_cos_sin
from operators.rms_norm_kernel import rms_norm_kernel
from operators.rope_kernel import rope_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]  # bf16: GPU only


def torch_rms_norm(x, weight, eps):
    """llama.rms_norm's torch arithmetic (the model takes the kernel on a GPU)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(x.dtype) * weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 4096), (2, 5, 128), (1, 896)])  # 8B hidden, qk-norm heads, Qwen's hidden
def test_rms_norm_kernel_equals_torch(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEVICE)
    w = torch.randn(shape[-1], generator=g).to(dtype).to(DEVICE)
    out = rms_norm_kernel(x, w, 1e-6)
    ref = torch_rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # bf16: one rounding step apart at most
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    if DEVICE == "cuda":
        torch.testing.assert_close(llama.rms_norm(x, w, 1e-6), out, rtol=0, atol=0)  # the model takes it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [128, 64])  # whole head, and a partial rotation (channels passed through)
def test_rope_kernel_equals_torch(rot, dtype):
    g = torch.Generator().manual_seed(rot)
    x = torch.randn(3, 6, 128, generator=g).to(dtype).to(DEVICE)
    inv = 1.0 / (500000 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = rope_cos_sin(inv.to(DEVICE), torch.tensor([0, 77, 131071], device=DEVICE), 1.1)
    out = rope_kernel(x, cos, sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-x_rot[..., rot // 2:], x_rot[..., :rot // 2]], dim=-1)
    c, s = cos[:, None].to(dtype), sin[:, None].to(dtype)
    ref = torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)
    # the same roundings in the same order; compiled, a product and a sum may fuse (one rounding fewer)
    exact = DEVICE == "cpu"
    tol = 0 if exact else 1e-6 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    if DEVICE == "cuda":
        torch.testing.assert_close(apply_rope(x, cos, sin), out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [128, 64])
def test_rope_from_positions_equals_rope_over_tables(rot, dtype):
    """The kernel that computes cos and sin itself (prefill's) against rope_kernel over
    rope_cos_sin's tables: the same angles in float32, cosines and sines within a float32 rounding
    step of torch's (libdevice's on a GPU, numpy's in the interpreter)."""
    from ktlong.models.rope import rope_at
    from operators.rope_kernel import rope_positions_kernel

    g = torch.Generator().manual_seed(rot + 1)
    x = torch.randn(4, 6, 128, generator=g).to(dtype).to(DEVICE)
    inv = (1.0 / (500000 ** (torch.arange(0, rot, 2).float() / rot))).to(DEVICE)
    positions = torch.tensor([0, 77, 4097, 131071], device=DEVICE)
    out = rope_positions_kernel(x, positions, inv, 1.1)
    ref = rope_kernel(x, *rope_cos_sin(inv, positions, 1.1))
    tol = 1e-6 if dtype == torch.float32 else 2 ** -6  # bf16: a cosine a step apart may round the other way
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(out[..., rot:], x[..., rot:])
    k = x[:, :2].contiguous()
    q_out, k_out = rope_at(x, k, inv, positions, 1.1)  # the model's entry: the kernel on a GPU, tables elsewhere
    torch.testing.assert_close(q_out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(k_out.float(), ref[:, :2].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16 rounded by its bits: the interpreter too
@pytest.mark.parametrize("shape", [(3, 4096), (1, 896)])
def test_add_rms_norm_kernel_equals_the_add_then_the_norm(shape, dtype):
    """One pass of a residual add and the next norm: the sum as torch's add rounds it, and the
    norm of that sum as torch's rms_norm gives it (one rounding step apart at most, where the
    order of the mean's float32 sum moves a value across a boundary)."""
    from operators.rms_norm_kernel import add_rms_norm_kernel

    g = torch.Generator().manual_seed(shape[-1])
    x, y = (torch.randn(2, *shape, generator=g) * 3).to(dtype).to(DEVICE)
    w = torch.randn(shape[-1], generator=g).to(dtype).to(DEVICE)
    total, normed = add_rms_norm_kernel(x, y, w, 1e-6)
    assert torch.equal(total, x + y)
    ref = torch_rms_norm(x + y, w, 1e-6)
    assert normed.dtype == ref.dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(normed.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # float32: a row's inverse norm may differ in its last bit throughout
        assert (normed == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_equals_torch(dtype):
    """silu(gate) * up from the gate/up product's [T, 2 I] output, rounded as torch's two ops
    round it (silu's float32 value rounded, then the product)."""
    from operators.gated_activation_kernel import silu_mul

    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(3, 2 * 2500, generator=g) * 4).to(dtype).to(DEVICE)  # I past two programs' columns
    gate, up = gate_up.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up
    out = silu_mul(gate_up)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # exp's last float32 bit may round apart
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:
        assert (out == ref).float().mean() > 0.99
