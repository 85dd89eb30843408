"""The window's attention kernel (operators/window_attention_kernel.py) against the torch ops the
CUDA-graph path ran before it (masked_window_attention): the same rounding to the window's type,
so the results agree to the order of float32 sums. On the CPU the kernel runs in Triton's
interpreter (tests/conftest.py)."""

import pytest
import torch

from operators.window_attention import masked_window_attention
from operators.window_attention_kernel import member_offsets, window_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("group, n, lo, hi, last", [
    (4, 300, 0, 300, 0),  # the whole buffer
    (7, 300, 16, 213, 0),  # sinks skipped, the end not yet filled; Qwen2.5-0.5B's group
    (4, 1100, 0, 1100, 0),  # more ranges than one program's keys
    (2, 300, 0, 250, 100),  # a sliding layer: its last 100 keys
])
def test_kernel_rounds_as_the_masked_torch_ops(group, n, lo, hi, last):
    g = torch.Generator().manual_seed(n + group)
    num_kv, dim = 2, 64
    q = (torch.randn(num_kv * group, dim, generator=g) * 2).to(torch.bfloat16)
    k, v = (torch.randn(2, num_kv, n, dim, generator=g) * 2).to(torch.bfloat16)
    lo_t, hi_t = torch.tensor(lo), torch.tensor(hi)
    last_lo = torch.maximum(lo_t, hi_t - last) if last else lo_t
    ref_out, ref_lse = masked_window_attention(q, k, v, last_lo, hi_t, 0.125)
    to = dict(device=DEVICE)
    k, v = k.to(**to), v.to(**to)
    out, lse = window_attention(q[None].to(**to), k, v, member_offsets([k], [v]), lo_t[None].to(**to),
                                hi_t[None].to(**to), 0.125, last)
    out, lse = out[0], lse[0]
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    # each value is rounded to bfloat16 as the torch ops round it: equal but where a float32 sum's
    # order moves a value across a rounding boundary, one bfloat16 step
    step = ref_out.abs().clamp_min(1e-3) * 2 ** -7
    assert ((out.cpu() - ref_out).abs() <= step).all()
    assert (out.cpu() == ref_out).float().mean() > 0.95


def test_one_launch_for_a_batch_gives_each_members_own_attention():
    """Three conversations' windows, separate buffers (as each decoder's are), each with its own
    valid range: one call over the batch equals each member's call alone, bit for bit."""
    g = torch.Generator().manual_seed(5)
    num_kv, group, n, dim = 2, 4, 300, 64
    to = dict(device=DEVICE)
    buffers = [[(torch.randn(num_kv, n, dim, generator=g) * 2).to(torch.bfloat16).to(**to) for _ in range(2)]
               for _ in range(3)]
    q = (torch.randn(3, num_kv * group, dim, generator=g) * 2).to(torch.bfloat16).to(**to)
    lo, hi = torch.tensor([0, 16, 32], **to), torch.tensor([300, 213, 100], **to)
    keys, values = [b[0] for b in buffers], [b[1] for b in buffers]
    out, lse = window_attention(q, keys[0], values[0], member_offsets(keys, values), lo, hi, 0.125)
    for b in range(3):
        alone = window_attention(q[b:b + 1], keys[b], values[b], member_offsets([keys[b]], [values[b]]),
                                 lo[b:b + 1], hi[b:b + 1], 0.125)
        assert torch.equal(out[b], alone[0][0]) and torch.equal(lse[b], alone[1][0])
        ref_out, ref_lse = masked_window_attention(q[b].cpu(), keys[b].cpu(), values[b].cpu(), lo[b].cpu(), hi[b].cpu(),
                                                   0.125)
        torch.testing.assert_close(lse[b].cpu(), ref_lse, rtol=1e-5, atol=1e-5)


def test_members_apart_by_other_than_whole_units_are_refused():
    """The kernels move a member's pointers by whole units of 16 elements (their loads keep their
    vector width): buffers 8 elements apart are refused in one sentence, not read crooked."""
    whole = torch.zeros(2 * 2 * 64 * 32 + 8, dtype=torch.bfloat16)
    a = whole[:2 * 64 * 32].view(2, 64, 32)
    b = whole[8:8 + 2 * 64 * 32].view(2, 64, 32)
    with pytest.raises(ValueError, match="whole multiple of 32 bytes"):
        member_offsets([a, b], [a, b])
    c = whole[16:16 + 2 * 64 * 32].view(2, 64, 32)
    assert member_offsets([a, c], [a, c]).tolist() == [[0, 0], [1, 1]]
