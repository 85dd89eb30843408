"""The decode step's append kernel against torch ops: the window rows as index_copy_ writes them
and the stored rows (DRAM's, or the exchange's) as quantize_kv (q8_0, the same bytes) or a cast
gives them. On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); on a GPU
compiled, on the device."""

import pytest
import torch

from operators.decode_append_kernel import StoredRows, append_token, kernel_applies, stored_offsets
from operators.kv_quant import quantize_kv
from operators.window_attention_kernel import member_offsets

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0", "window only"])
def test_rows_land_where_the_torch_ops_put_them(kv_type):
    """The window's rows as index_copy_ puts them, and the stored rows at their position (the
    other rows untouched) as a cast or quantize_kv gives them."""
    g = torch.Generator().manual_seed(7)
    num_kv, dim, tokens, slot, stored_tokens, position = 3, 64, 40, 17, 6, 4
    k, v = torch.randn(2, num_kv, dim, generator=g).to(torch.bfloat16)
    k[1, :32] = 0  # a q8_0 block of zeros: scale 0, every value 0
    v[2, 5] = 1e-30  # float16's subnormal scale
    keys, values = torch.randn(2, num_kv, tokens, dim, generator=g).to(torch.bfloat16)
    ref_keys, ref_values = keys.clone(), values.clone()
    ref_keys.index_copy_(1, torch.tensor([slot]), k[:, None])
    ref_values.index_copy_(1, torch.tensor([slot]), v[:, None])
    quant = kv_type == "q8_0"
    data = (torch.full((2, num_kv, stored_tokens, dim), 9, dtype=torch.int8 if quant else torch.bfloat16)
            if kv_type != "window only" else None)
    scales = torch.full((2, num_kv, stored_tokens, dim // 32), 9, dtype=torch.int16) if quant else None
    to = dict(device=DEVICE)
    keys_d, values_d = keys.to(**to), values.to(**to)
    host = [t if t is None or DEVICE == "cpu" else t.pin_memory() for t in (data, scales)]
    stored = None if data is None else StoredRows(host[0][0], host[0][1], None if scales is None else host[1][0],
                                                  None if scales is None else host[1][1],
                                                  torch.tensor([position], **to))
    members = member_offsets([keys_d], [values_d])
    expected = [None if t is None else t.clone() for t in host]
    if quant:
        expected[0][:, :, position], expected[1][:, :, position] = quantize_kv(torch.stack([k, v]), "q8_0")
    elif data is not None:
        expected[0][:, :, position] = torch.stack([k, v])
    append_token(k[None].to(**to), v[None].to(**to), torch.tensor([slot], **to), keys_d, values_d, members, stored,
                 None if stored is None else stored_offsets([stored], keys_d.device))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(keys_d.cpu(), ref_keys) and torch.equal(values_d.cpu(), ref_values)
    for got, want in zip(host, expected):
        assert got is None or torch.equal(got, want)


def test_formats_the_kernel_takes():
    assert kernel_applies("bf16", 128) and kernel_applies("q8_0", 64)
    assert not kernel_applies("q4_0", 128) and not kernel_applies("bf16", 80) and not kernel_applies("fp16", 16)


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_one_launch_for_a_batch_writes_each_members_rows(kv_type):
    """Three conversations, separate window buffers and stored tables (as each decoder's are),
    each with its own slot and position: one call over the batch (its rows views of the layer's
    product) writes what each member's own call writes, and nothing else."""
    g = torch.Generator().manual_seed(11)
    num_kv, dim, tokens, stored_tokens = 2, 64, 24, 8
    to = dict(device=DEVICE)
    quant = kv_type == "q8_0"
    k, v = torch.randn(2, 3, num_kv, dim, generator=g).to(torch.bfloat16)

    def member():
        window = [t.to(**to) for t in torch.randn(2, num_kv, tokens, dim, generator=g).to(torch.bfloat16)]
        data = torch.zeros((2, num_kv, stored_tokens, dim), dtype=torch.int8 if quant else torch.bfloat16)
        scales = torch.zeros((2, num_kv, stored_tokens, dim // 32), dtype=torch.int16) if quant else None
        if DEVICE == "cuda":
            data, scales = data.pin_memory(), None if scales is None else scales.pin_memory()
        return window, data, scales

    slots, positions = torch.tensor([3, 17, 9], **to), torch.tensor([0, 5, 7], **to)
    batch, alone = [member() for _ in range(3)], []
    for b, (window, data, scales) in enumerate(batch):  # the same values, written member by member
        w, d, s = [t.clone() for t in window], data.clone(), None if scales is None else scales.clone()
        rows = StoredRows(d[0], d[1], None if s is None else s[0], None if s is None else s[1], positions[b:b + 1])
        append_token(k[b:b + 1].to(**to), v[b:b + 1].to(**to), slots[b:b + 1], w[0], w[1],
                     member_offsets([w[0]], [w[1]]), rows, stored_offsets([rows], w[0].device))
        alone.append((w, d, s))
    rows = [StoredRows(d[0], d[1], None if s is None else s[0], None if s is None else s[1], positions)
            for _, d, s in batch]
    # the batch's rows as the layer gives them: views of one product [B, (q, k, v) heads * dim], read in place
    fused = torch.cat([torch.zeros(3, 4 * dim, dtype=k.dtype), k.reshape(3, -1), v.reshape(3, -1)], 1).to(**to)
    k_view = fused[:, 4 * dim:(4 + num_kv) * dim].view(3, num_kv, dim)
    v_view = fused[:, (4 + num_kv) * dim:].view(3, num_kv, dim)
    assert not k_view.is_contiguous()
    append_token(k_view, v_view, slots, batch[0][0][0], batch[0][0][1],
                 member_offsets([w[0] for w, _, _ in batch], [w[1] for w, _, _ in batch]), rows[0],
                 stored_offsets(rows, batch[0][0][0].device))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for (w, d, s), (w_alone, d_alone, s_alone) in zip(batch, alone):
        assert torch.equal(w[0], w_alone[0]) and torch.equal(w[1], w_alone[1]) and torch.equal(d, d_alone)
        assert s is None or torch.equal(s, s_alone)
        assert d.any()  # the rows landed
