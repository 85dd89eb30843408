"""On the GPU: head-major views cross between pinned host memory and the device as one 2-D
copy (ktlong/kv/copy_2d.py) and land exactly where head-by-head copies put them."""

import pytest
import torch

from ktlong.kv.copy_2d import copy_rows_2d
from ktlong.kv.pinned import PinnedTensors, copy_heads

pytestmark = pytest.mark.gpu


def random_table(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 50).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32, torch.int16])
@pytest.mark.parametrize("start,end", [(0, 1000), (3, 517), (128, 129)])
def test_head_ranges_cross_both_ways_as_one_2d_copy(dtype, start, end):
    keep = PinnedTensors()
    host = keep.pin(random_table((8, 1024, 64), dtype, 0))  # head-major: head stride 1024 rows
    device = torch.zeros((8, 2048, 64), dtype=dtype, device="cuda")
    assert copy_rows_2d(device[:, start:end], host[:, start:end])  # the 2-D path, not the fallback
    torch.cuda.synchronize()
    assert torch.equal(device[:, start:end].cpu(), host[:, start:end])
    assert not device[:, :start].any() and not device[:, end:].any()  # nothing outside the range
    back = keep.pin(torch.zeros((8, 1024, 64), dtype=dtype))
    device[:, start:end] += 1 if dtype.is_floating_point else 0
    copy_heads(back[:, start:end], device[:, start:end])
    torch.cuda.synchronize()
    assert torch.equal(back[:, start:end], device[:, start:end].cpu())
    assert not back[:, :start].any() and not back[:, end:].any()


def test_copies_follow_the_current_stream():
    keep = PinnedTensors()
    host = keep.pin(random_table((4, 4096, 128), torch.bfloat16, 1))
    device = torch.zeros((4, 4096, 128), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        device.fill_(7)
        copy_heads(device[:, 100:3000], host[:, 100:3000])  # after the fill on the same stream
    side.synchronize()
    assert torch.equal(device[:, 100:3000].cpu(), host[:, 100:3000])
    assert bool((device[:, :100] == 7).all()) and bool((device[:, 3000:] == 7).all())


def test_views_that_do_not_fit_fall_back_to_head_by_head_copies():
    keep = PinnedTensors()
    host = keep.pin(random_table((4, 64, 32), torch.float32, 2))
    device = torch.zeros((4, 64, 32), device="cuda")
    # rows that are not contiguous ranges (a column slice), and pageable host memory
    assert not copy_rows_2d(device[:, :, :16], host[:, :, :16])
    assert not copy_rows_2d(device, host.clone())
    copy_heads(device[:, :, :16], host[:, :, :16])
    copy_heads(device[:, :, 16:], host.clone()[:, :, 16:])
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), host)


def test_a_kv_caches_heads_locked_in_the_pieces_they_grew_by_cross_a_piece_each():
    """A host cache page-locks each kv head's range apart, in the pieces it grows by (cudaHostRegister
    on its own mappings, which torch's is_pinned() does not report). The driver refuses a 2-D copy
    over ranges locked apart: copy_rows_2d says so, and copy_heads copies each head's rows a piece
    at a time, across the two pieces each head grew by here, both ways."""
    from ktlong.kv.copy_2d import registered_runs
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.layout import kv_layout

    host = HostKVCache(kv_layout(2, 8, 128, 128, 1 << 16, "q8_0"), pin=True)
    host.reserve(1000)
    first = host.committed[1] * 128  # tokens of layer 1's first piece
    host.reserve(first + 1)  # a second piece a head
    rows = host.tokens(1, "k", 100, first + 300)  # [KV, ..., 128] int8 over both pieces
    assert registered_runs(rows[0]) == [(0, first - 100), (first - 100, first + 200)]
    rows.copy_(random_table(tuple(rows.shape), torch.int8, 3))
    device = torch.zeros(rows.shape, dtype=torch.int8, device="cuda")
    assert not copy_rows_2d(device, rows)
    copy_heads(device, rows)
    back = host.tokens(0, "k", 100, first + 300)
    copy_heads(back, device)
    torch.cuda.synchronize()
    assert torch.equal(back, rows) and torch.equal(device.cpu(), rows)
