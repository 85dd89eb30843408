"""The selected blocks' Triton attention kernel against torch ops: gather each kv head's selected
pages, widen them to float32, attend over its valid tokens. On the CPU the kernel
runs in Triton's interpreter (tests/conftest.py); on a GPU compiled, on the device."""

import pytest
import torch

from operators.selected_blocks_kernel import selected_blocks_attention, kernel_applies
from operators.kv_quant import dequantize_kv, quantize_kv
from operators.window_attention import attention_over_prefix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pages(rows, block, dim, kv_type, g):
    """K and V pages [rows, B, D] as the cache holds them, and their float32 values."""
    kv = torch.randn(2, rows, block, dim, generator=g)
    if kv_type == "q8_0":
        data, scales = quantize_kv(kv, "q8_0")
        return data, scales, dequantize_kv(data, scales, "q8_0", torch.float32)
    stored = kv.to({"bf16": torch.bfloat16, "fp32": torch.float32}[kv_type])
    return stored, None, stored.float()


@pytest.mark.parametrize("kv_type", ["bf16", "fp32", "q8_0"])
@pytest.mark.parametrize("group", [4, 7])  # LLaMA-8B's and Qwen2.5-0.5B's query heads per kv head
def test_kernel_equals_attention_over_the_gathered_pages(kv_type, group):
    g = torch.Generator().manual_seed(group)
    num_kv, dim, block, rows, selected = 3, 64, 64, 11, 10  # two tiles of 32 tokens a block
    data, scales, values = pages(rows, block, dim, kv_type, g)
    q = torch.randn(num_kv * group, dim, generator=g)
    hit_index = torch.randint(0, rows, (num_kv, selected), generator=g)
    hit_valid = torch.tensor([10 * block, 0, 3 * block])  # all, none, some
    to = dict(device=DEVICE)
    out, lse = selected_blocks_attention(q.to(**to), data[0].to(**to), data[1].to(**to),
                                       None if scales is None else scales[0].to(**to),
                                       None if scales is None else scales[1].to(**to),
                                       hit_index.to(**to), hit_valid.to(**to), 0.125)
    k, v = (values[p][hit_index].view(num_kv, -1, dim) for p in range(2))
    ref_out, ref_lse = attention_over_prefix(q, k, v, hit_valid, 0.125)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse[group:2 * group]).all() and not out[group:2 * group].any()  # the head holding nothing


def test_formats_the_kernel_takes():
    assert kernel_applies("bf16", 128, 128) and kernel_applies("q8_0", 128, 64)
    assert not kernel_applies("q4_0", 128, 128)  # packed nibbles: the torch path
    assert not kernel_applies("bf16", 128, 80) and not kernel_applies("bf16", 8, 128)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_base_state_merges_as_merge_states_would(deferred):
    """The window's state (here: attention over other keys, and one head with none) merged in
    by the kernel's own merge equals the separate log-sum-exp merge; given as a function (the
    decoder's join of its second stream), it is called once and merged the same."""
    from operators.merge_state import merge_states
    from operators.window_attention import attention_with_lse

    g = torch.Generator().manual_seed(3)
    num_kv, group, dim, block, rows = 2, 4, 32, 32, 6
    data, _, values = pages(rows, block, dim, "fp32", g)
    q = torch.randn(num_kv * group, dim, generator=g)
    hit_index = torch.randint(0, rows, (num_kv, 3), generator=g)
    hit_valid = torch.tensor([3 * block, 0])  # kv head 1: the window alone
    window_k, window_v = torch.randn(2, num_kv, 50, dim, generator=g)
    base_out, base_lse = attention_with_lse(q, window_k, window_v, 0.125)
    base_lse[0] = float("-inf")  # query head 0: nothing in the window
    base_out[0] = 0
    to = dict(device=DEVICE)
    state, calls = (base_out.to(**to), base_lse.to(**to)), []

    def joined():
        calls.append(1)
        return state
    out, lse = selected_blocks_attention(q.to(**to), data[0].to(**to), data[1].to(**to), None, None,
                                       hit_index.to(**to), hit_valid.to(**to), 0.125,
                                       base=joined if deferred else state)
    assert len(calls) == int(deferred)
    k, v = (values[p][hit_index].view(num_kv, -1, dim) for p in range(2))
    blocks_out, blocks_lse = attention_over_prefix(q, k, v, hit_valid, 0.125)
    ref_out, ref_lse = merge_states(blocks_out, blocks_lse, base_out, base_lse)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_the_leading_blocks_come_from_the_device_copy(kv_type):
    """Blocks below the copy's count are read from the copy, the rest from the DRAM tables. The
    copy here holds other values than the DRAM tables, so the reference can tell which was read:
    attention over the blocks taken from each where the kernel should take them."""
    from operators.selected_blocks_kernel import NearPages

    g = torch.Generator().manual_seed(11)
    num_kv, group, dim, block, per_head, selected = 2, 4, 32, 32, 6, 5
    rows = num_kv * per_head  # row h * per_head + b: block b of kv head h
    far, far_scales, far_values = pages(rows, block, dim, kv_type, g)
    near, near_scales, near_values = pages(rows, block, dim, kv_type, g)
    q = torch.randn(num_kv * group, dim, generator=g).to(torch.bfloat16)
    blocks = torch.stack([torch.randperm(per_head, generator=g)[:selected] for _ in range(num_kv)])
    hit_index = blocks + torch.arange(num_kv)[:, None] * per_head
    hit_valid = torch.tensor([selected * block, 3 * block])
    count = 3  # blocks 0, 1, 2 of each head are on the device
    to = dict(device=DEVICE)
    scales = lambda s, p: None if s is None else s[p].to(**to)
    copy = NearPages(torch.tensor(count, **to), per_head, near[0].to(**to), near[1].to(**to),
                     scales(near_scales, 0), scales(near_scales, 1))
    out = torch.empty(num_kv * group, dim, **to)
    got, lse = selected_blocks_attention(q.to(**to), far[0].to(**to), far[1].to(**to), scales(far_scales, 0),
                                         scales(far_scales, 1), hit_index.to(**to), hit_valid.to(**to), 0.125,
                                         near=copy, out=out)
    assert got is out
    from_copy = (blocks < count)[..., None, None]
    k, v = (torch.where(from_copy, near_values[p][hit_index], far_values[p][hit_index]).view(num_kv, -1, dim)
            for p in range(2))
    ref_out, ref_lse = attention_over_prefix(q.float(), k, v, hit_valid, 0.125)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
