"""The decode step's append kernel against torch ops: the window rows as index_copy_ writes them
and the stored rows (DRAM's, or the exchange's) as quantize_kv (q8_0, the same bytes) or a cast
gives them. On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); on a GPU
compiled, on the device."""

import pytest
import torch

from operators.decode_append_kernel import StoredRows, append_token, kernel_applies
from operators.kv_quant import quantize_kv

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
    expected = [None if t is None else t.clone() for t in host]
    if quant:
        expected[0][:, :, position], expected[1][:, :, position] = quantize_kv(torch.stack([k, v]), "q8_0")
    elif data is not None:
        expected[0][:, :, position] = torch.stack([k, v])
    append_token(k.to(**to), v.to(**to), torch.tensor([slot], **to), keys_d, values_d, stored)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(keys_d.cpu(), ref_keys) and torch.equal(values_d.cpu(), ref_values)
    for got, want in zip(host, expected):
        assert got is None or torch.equal(got, want)


def test_formats_the_kernel_takes():
    assert kernel_applies("bf16", 128) and kernel_applies("q8_0", 64)
    assert not kernel_applies("q4_0", 128) and not kernel_applies("bf16", 80) and not kernel_applies("fp16", 16)
