"""Layer-major chunked prefill equals the plain dense forward, and fills the DRAM cache right."""

import functools
import numpy as np
import pytest
import torch

from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.prefill import LayerMajorPrefill
from operators.block_summary import anchor_keys, fixed_offsets
from tests.anchors_reference import build_anchors_reference
from tests.settings import compact_settings, flashprefill_settings
from tests.tiny_gguf import TinySpec, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=3), seed=11)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):  # head_dim 32: one q8_0 block per row
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=2, hidden=128, head_dim=32), seed=13)


def dense(lm, ids):
    c = lm.config
    cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), lm.model.device, torch.float32)
    return lm.model.forward(torch.tensor(ids), cache, 0)[-1], cache


def prefill(lm, ids, block_size, chunk_size, max_seq_len=None):
    c = lm.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, max_seq_len or len(ids), "fp32")
    host = HostKVCache(layout, pin=False)
    engine = LayerMajorPrefill(lm.model, layout, chunk_size, "torch", hidden_on_device=True)
    logits, stats = engine.run(ids, host)
    return logits, host, stats


@pytest.mark.parametrize("num_tokens,block_size,chunk_size", [
    (1, 16, 16), (2, 16, 32), (37, 16, 16), (37, 16, 32), (64, 16, 64), (100, 32, 64),
    (129, 16, 48), (200, 64, 128)])
def test_last_logits_equal_dense_forward(tiny, num_tokens, block_size, chunk_size):
    ids = list(np.random.default_rng(num_tokens).integers(0, 300, size=num_tokens))
    expected, _ = dense(tiny, ids)
    logits, host, stats = prefill(tiny, ids, block_size, chunk_size, max_seq_len=num_tokens + 5)
    assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-4
    assert host.num_tokens == num_tokens and stats.num_tokens == num_tokens


def test_host_cache_holds_every_layers_kv_head_major(tiny):
    ids = list(np.random.default_rng(0).integers(0, 300, size=75))
    _, cache = dense(tiny, ids)
    _, host, _ = prefill(tiny, ids, 16, 32)
    c = tiny.config
    for layer in range(c.num_layers):
        k = host.k[layer].view(c.num_kv_heads, -1, c.head_dim)[:, :75]
        v = host.v[layer].view(c.num_kv_heads, -1, c.head_dim)[:, :75]
        torch.testing.assert_close(k, cache.k[layer, :, :75], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, cache.v[layer, :, :75], rtol=1e-5, atol=1e-5)


def test_side_tables_summarise_valid_tokens_of_each_block(tiny):
    ids = list(np.random.default_rng(1).integers(0, 300, size=75))  # last block of 16 is partial
    _, host, _ = prefill(tiny, ids, 16, 32)
    for layer in range(tiny.config.num_layers):
        k = host.tokens(layer, "k", 0, 75).numpy()  # the keys the host cache itself holds
        for h in range(tiny.config.num_kv_heads):
            for b in range(5):
                keys = k[h, b * 16:min((b + 1) * 16, 75)]
                # max and min pick one of the stored values: exact; a mean's summation order may differ
                np.testing.assert_array_equal(host.key_max[layer][h, b], keys.max(0))
                np.testing.assert_array_equal(host.key_min[layer][h, b], keys.min(0))
                np.testing.assert_allclose(host.key_mean[layer][h, b], keys.mean(0), rtol=1e-5, atol=1e-6)


def test_importance_is_attention_from_the_chunks_last_queries():
    from operators.block_summary import token_importance

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=g)  # last 3 queries of a 10-token chunk, 4 heads
    k = torch.randn(2, 10, 8, generator=g)  # 2 kv heads
    got = token_importance(q, k, 0.5)
    expected = torch.zeros(2, 10)
    for head in range(4):
        kv = head // 2
        for i in range(3):
            pos = 7 + i
            w = torch.softmax((k[kv, :pos + 1] @ q[i, head]) * 0.5, 0)
            expected[kv, :pos + 1] = torch.maximum(expected[kv, :pos + 1], w)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("anchor_type", ["DYNAMIC", "FIX"])
@pytest.mark.parametrize("anchor_num", [1, 3])
def test_anchor_keys_equal_per_block_reference(anchor_type, anchor_num):
    rng = np.random.default_rng(6)
    keys = rng.standard_normal((2, 5, 16, 8)).astype(np.float32)
    importance = rng.integers(0, 4, (2, 5, 16)).astype(np.float32)  # many ties: the earlier token wins
    num_tokens = 4 * 16 + 2  # the last block holds 2 tokens, fewer than 3 anchors
    got = anchor_keys(torch.from_numpy(keys), num_tokens, anchor_type, anchor_num,
                      torch.from_numpy(importance).view(2, -1)).numpy()
    expected = build_anchors_reference(keys, num_tokens, anchor_type, anchor_num, importance)
    np.testing.assert_array_equal(got, expected)
    if anchor_type == "FIX":
        assert fixed_offsets(16, 3) == [2, 8, 13] and (got[:, 4, :] == keys[:, 4, [1] * anchor_num]).all()


@pytest.mark.parametrize("anchor_type", ["DYNAMIC", "FIX"])
def test_prefill_anchor_keys_come_from_the_unquantised_keys(tiny32, anchor_type, monkeypatch):
    """With a q8_0 cache the anchor keys are the block's keys as computed, not as stored: each
    equals the reference picked from the dense forward's keys with the importance prefill
    measured (recorded here), and differs from the stored, rounded key."""
    import ktlong.prefill

    recorded = []
    original = ktlong.prefill.token_importance
    monkeypatch.setattr(ktlong.prefill, "token_importance",
                        lambda *a: recorded.append(original(*a)) or recorded[-1])
    tiny = tiny32
    ids = list(np.random.default_rng(12).integers(0, 300, size=75))
    _, cache = dense(tiny, ids)
    c = tiny.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 80, "q8_0", page_type="fp32",
                       anchor_type=anchor_type, anchor_num=2)
    host = HostKVCache(layout, pin=False)
    LayerMajorPrefill(tiny.model, layout, 32, "torch", hidden_on_device=True).run(ids, host)
    chunks = 3  # of 32 tokens: 32, 32, 11
    for layer in range(c.num_layers):
        keys = torch.zeros(c.num_kv_heads, 80, c.head_dim)
        keys[:, :75] = cache.k[layer, :, :75]
        importance = np.zeros((c.num_kv_heads, 80), np.float32)
        if anchor_type == "DYNAMIC":
            importance[:, :75] = torch.cat(recorded[layer * chunks:(layer + 1) * chunks], 1).numpy()
        keys = keys.view(c.num_kv_heads, 5, 16, -1).numpy()
        expected = build_anchors_reference(keys, 75, anchor_type, 2, importance.reshape(c.num_kv_heads, 5, 16))
        got = host.anchor_keys[layer][:, :5].numpy()  # the capacity is whole pages: more blocks, unwritten
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        stored = host.unquantized(layer, "k", 0, 75, torch.float32).numpy()
        stored_blocks = np.zeros((c.num_kv_heads, 80, c.head_dim), np.float32)
        stored_blocks[:, :75] = stored
        rounded = build_anchors_reference(stored_blocks.reshape(keys.shape), 75, anchor_type, 2,
                                          importance.reshape(c.num_kv_heads, 5, 16))
        assert np.abs(got - rounded).max() > 10 * np.abs(got - expected).max()


def bytes_copied_into(host: HostKVCache, monkeypatch) -> list[int]:
    """Counts the bytes every Tensor.copy_ writes into the host cache's memory."""
    tensors = host.k + host.v + host.key_mean + host.key_max + host.key_min + host.anchor_keys
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]
    copied = [0]
    original = torch.Tensor.copy_

    def copy_(dst, src, non_blocking=False):
        if any(lo <= dst.data_ptr() < hi for lo, hi in spans):
            copied[0] += dst.numel() * dst.element_size()
        return original(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return copied


def test_dram_traffic_is_what_is_copied_and_linear_in_prompt_length(tiny, monkeypatch):
    c = tiny.config
    observed = {}
    for n in (64, 128):
        layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, n, "fp32")
        host = HostKVCache(layout, pin=False)
        with monkeypatch.context() as m:
            copied = bytes_copied_into(host, m)
            _, stats = LayerMajorPrefill(tiny.model, layout, 32, "torch", hidden_on_device=True).run(list(range(n)), host)
        assert stats.bytes_to_host == copied[0] > 0  # the counter reports the bytes really copied
        observed[n] = copied[0]
    assert observed[128] == 2 * observed[64]  # O(prompt): no history is copied twice


def test_compact_prefill_keeping_everything_equals_dense(tiny):
    ids = list(np.random.default_rng(9).integers(0, 300, size=150))
    expected, _ = dense(tiny, ids)
    c = tiny.config
    for params in (flashprefill_settings(alpha=0.0),
                   compact_settings(selector="xattention", threshold=1.0, stride=4)):
        layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 150, "fp32")
        engine = LayerMajorPrefill(tiny.model, layout, 32, "torch", True, compact=params)
        logits, stats = engine.run(ids, HostKVCache(layout, pin=False))
        assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-5
        assert stats.density_per_layer == [1.0] * c.num_layers


def test_compact_prefill_logs_density_per_layer(tiny):
    ids = list(np.random.default_rng(10).integers(0, 300, size=256))
    c = tiny.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 256, "fp32")
    engine = LayerMajorPrefill(tiny.model, layout, 32, "torch", True,
                               compact=flashprefill_settings(alpha=0.9, sink_blocks=0, window_blocks=0))
    logits, stats = engine.run(ids, HostKVCache(layout, pin=False))
    assert len(stats.density_per_layer) == c.num_layers
    assert all(0 < d <= 1 for d in stats.density_per_layer) and min(stats.density_per_layer) < 1


def test_topk_prefill_keeps_keep_blocks_per_chunk_and_keeping_every_block_is_dense_prefill(tiny):
    """topk in the prefill: each chunk past keep_blocks history blocks keeps exactly that many
    (the density per layer is their share, averaged over the chunks with history); with
    keep_blocks past the prompt every chunk keeps every block and the logits are dense prefill's."""
    ids = list(np.random.default_rng(12).integers(0, 300, size=256))
    c = tiny.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 256, "fp32")
    expected, _ = dense(tiny, ids)

    def run(keep_blocks):
        params = compact_settings(selector="topk", keep_blocks=keep_blocks, sink_blocks=1, window_blocks=1)
        engine = LayerMajorPrefill(tiny.model, layout, 32, "torch", True, compact=params)
        return engine.run(ids, HostKVCache(layout, pin=False))

    logits, stats = run(3)
    shares = [min(3, h) / h for h in range(2, 16, 2)]  # chunks of 2 blocks: history 2, 4, ..., 14 blocks
    assert stats.density_per_layer == pytest.approx([sum(shares) / len(shares)] * c.num_layers)
    assert float((logits - expected).abs().max() / expected.abs().max()) > 1e-3  # it did select
    all_logits, everything = run(1 << 10)
    assert everything.density_per_layer == [1.0] * c.num_layers
    assert float((all_logits - expected).abs().max() / expected.abs().max()) < 1e-5


def selective_prefill(lm, ids, **options):
    """A compact prefill that selects hard (alpha 0.9, no sinks or window), chunk 32, block 16."""
    c = lm.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, len(ids), "fp32")
    params = flashprefill_settings(alpha=0.9, sink_blocks=0, window_blocks=0, **options)
    engine = LayerMajorPrefill(lm.model, layout, 32, "torch", True, compact=params)
    return engine.run(ids, HostKVCache(layout, pin=False))


def test_chunks_that_keep_nearly_everything_run_dense(tiny):
    """dense_above: a chunk whose union keeps more of its history than the threshold runs the
    dense path; those below it stay compact."""
    ids = list(np.random.default_rng(10).integers(0, 300, size=256))
    expected, _ = dense(tiny, ids)
    c = tiny.config

    def run(dense_above):
        return selective_prefill(tiny, ids, dense_above=dense_above)

    sparse_logits, sparse = run(1.0)
    chosen = sparse.density_per_layer
    assert sparse.dense_chunks == 0 and min(chosen) < 1
    everything_dense, all_dense = run(1e-6)  # every chunk with history keeps more than that
    assert all_dense.dense_chunks == c.num_layers * (256 // 32 - 1)
    assert all_dense.density_per_layer == [1.0] * c.num_layers
    assert float((everything_dense - expected).abs().max() / expected.abs().max()) < 1e-5
    assert float((sparse_logits - expected).abs().max() / expected.abs().max()) > 1e-3  # it was sparse
    middle = sorted(chosen)[len(chosen) // 2]
    _, some = run(middle)  # per chunk: the denser chunks go dense, the rest stay compact
    assert 0 < some.dense_chunks < all_dense.dense_chunks


def test_paged_dense_route_runs_dense_and_mid_block_chunks_too(tiny):
    """With fa3, dense chunks (and compact chunks that fall back) go through a keep-everything
    CompactAttention; here its torch twin stands in for FlashInfer, and a follow-up's first chunk
    that starts mid-block takes the plain dense kernel."""
    from operators.compact_attention import CompactAttention, CompactParams

    ids = list(np.random.default_rng(12).integers(0, 300, size=200))
    expected, _ = dense(tiny, ids)
    c = tiny.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 200, "fp32")
    engine = LayerMajorPrefill(tiny.model, layout, 32, "torch", True,
                               compact=flashprefill_settings(alpha=0.9, dense_above=1e-6))
    engine.dense_paged = CompactAttention(CompactParams.keep_all(), c.num_heads, c.num_kv_heads, 16,
                                          tiny.model.scale, "torch", tiny.model.device)
    calls = []
    original = engine.dense_paged.__call__
    engine.dense_paged = type("Spy", (), {"__call__": lambda self, *a: calls.append(a[-2:]) or original(*a)})()
    host = HostKVCache(layout, pin=False)
    engine.run(ids[:150], host)
    logits, stats = engine.run(ids[150:], host, history=150)  # 150 is mid-block: first chunk plain dense
    assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-5
    assert stats.dense_chunks == 2 * c.num_layers  # (160, 192) and (192, 200) in each layer
    assert (150, 160) not in calls and calls.count((160, 192)) == calls.count((192, 200)) == c.num_layers


@pytest.mark.parametrize("num_layers", [3, 4])  # the last layer on either set of pages
def test_a_follow_up_that_prefetches_its_history_equals_one_that_does_not(tmp_path, num_layers):
    """prefetch_history: each layer's pages and pooled keys come from the set the previous layer
    did not use (loaded ahead; on the CPU one after the other), so a selective CompactAttention
    reads the right layer's pooled keys; the results are those of the single set, bit for bit."""
    lm = tiny_model(tmp_path, TinySpec(num_layers=num_layers), seed=31)
    c = lm.config
    ids = list(np.random.default_rng(13).integers(0, 300, size=260))
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 300, "fp32")
    results = []
    for prefetch in (False, True):
        engine = LayerMajorPrefill(lm.model, layout, 64, "torch", True, compact=flashprefill_settings(alpha=0.9, window_blocks=1))
        own_pages = engine.pages
        host = HostKVCache(layout, pin=False)
        engine.run(ids[:192], host)
        logits, stats = engine.run(ids[192:], host, history=192, prefetch_history=prefetch)
        assert engine.pages is own_pages and min(stats.density_per_layer) < 1.0  # it did drop blocks
        results.append((logits, host))
    (a, host_a), (b, host_b) = results
    assert torch.equal(a, b)
    for layer in range(c.num_layers):
        assert torch.equal(host_a.tokens(layer, "k", 0, 260), host_b.tokens(layer, "k", 0, 260))
        assert torch.equal(host_a.key_mean[layer], host_b.key_mean[layer])


def test_copy_rows_2d_declines_without_a_gpu_and_copy_heads_copies_each_head():
    from ktlong.kv.copy_2d import _row_bytes, copy_rows_2d
    from ktlong.kv.pinned import copy_heads

    table = torch.arange(4 * 10 * 6, dtype=torch.float32).view(4, 10, 6)
    assert _row_bytes(table[:, 2:7]) == 5 * 6 * 4  # a token range of each head: contiguous rows
    assert _row_bytes(table[:, :, :3]) is None  # a column slice: not one range per head
    assert _row_bytes(table[:, 3:4]) == 6 * 4
    out = torch.zeros(4, 5, 6)
    assert not copy_rows_2d(out, table[:, 2:7])  # nothing on a GPU
    copy_heads(out, table[:, 2:7])
    assert torch.equal(out, table[:, 2:7])


def test_first_layers_named_by_prefill_dense_layer_num_never_select(tiny):
    """prefill_dense_layer_num: those layers run dense attention whatever the selector would keep;
    the layers after them select as before. All of them dense is dense prefill."""
    ids = list(np.random.default_rng(10).integers(0, 300, size=256))
    num_layers = tiny.config.num_layers
    expected, _ = dense(tiny, ids)
    run = functools.partial(selective_prefill, tiny, ids)
    _, selecting = run(prefill_dense_layer_num=0)
    assert all(d < 1 for d in selecting.density_per_layer)
    first_dense_logits, first_dense = run(prefill_dense_layer_num=1)
    assert first_dense.density_per_layer[0] == 1.0
    assert first_dense.density_per_layer[1:] != [1.0] * (num_layers - 1)
    assert float((first_dense_logits - expected).abs().max() / expected.abs().max()) > 1e-3  # later layers select
    all_dense_logits, all_dense = run(prefill_dense_layer_num=num_layers)
    assert all_dense.density_per_layer == [1.0] * num_layers
    assert float((all_dense_logits - expected).abs().max() / expected.abs().max()) < 1e-5


def test_quantising_k_and_v_in_one_pass_stores_the_bytes_of_one_pass_each(tiny32, monkeypatch):
    """Short chunks (a follow-up's question) quantise K and V together; the bytes in DRAM are those
    of quantising each plane on its own, as whole chunks still do."""
    import ktlong.prefill as prefill_module

    ids = list(np.random.default_rng(12).integers(0, 300, size=150))
    c = tiny32.config
    tables = []
    for joint in (0, 1024):
        monkeypatch.setattr(prefill_module, "JOINT_QUANTIZE_TOKENS", joint)
        layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 150, "q8_0")
        host = HostKVCache(layout, pin=False)
        LayerMajorPrefill(tiny32.model, layout, 32, "torch", True).run(ids, host)
        tables.append([(host.tokens(l, w, 0, 150).clone(), host.scale_tokens(l, w, 0, 150).clone())
                       for l in range(c.num_layers) for w in "kv"])
    for (data_a, scales_a), (data_b, scales_b) in zip(*tables):
        assert torch.equal(data_a, data_b) and torch.equal(scales_a, scales_b)
    assert any(bool(data.any()) for data, _ in tables[0])


def test_launch_pieces_cover_the_chunk_in_whole_waves_each_within_the_pairs():
    from ktlong.prefill import launch_pieces

    assert launch_pieces(0, 4096, 32, 0, 128) == [(0, 4096)]  # no bound: one launch
    assert launch_pieces(0, 4096, 32, 16_000_000_000, 128, 132) == [(0, 4096)]  # 5.4e8 pairs fit
    # the last chunk of a 1M prompt at 8B shapes: 1.37e11 pairs; 16e9 holds 3.7 tiles of 128
    # rows over 1M keys (32 heads): 3 tiles a piece where a program runs at a time, 10 of 384
    # rows and one of 256; on an H200's 132 SMs a wave is 4 tiles (128 programs), and a piece
    # at least a wave: 8 pieces of 512 rows
    s, e = 255 * 4096, 256 * 4096
    assert launch_pieces(s, e, 32, 16_000_000_000, 128) == [(a, min(a + 384, e)) for a in range(s, e, 384)]
    assert launch_pieces(s, e, 32, 16_000_000_000, 128, 132) == [(a, a + 512) for a in range(s, e, 512)]
    # at 256K keys 14.9 tiles fit: 3 waves of 4, 1,536 rows (the last piece 1,024)
    s, e = 63 * 4096, 64 * 4096
    assert launch_pieces(s, e, 32, 16_000_000_000, 128, 132) == [(s, s + 1536), (s + 1536, s + 3072), (s + 3072, e)]
    for s, e, heads, pairs, align, slots in [(0, 4096, 32, 10**8, 128, 1), (4096, 8192, 8, 3 * 10**7, 16, 1),
                                             (64, 200, 4, 9000, 16, 1), (4096, 8192, 8, 3 * 10**7, 16, 20),
                                             (0, 4096, 40, 10**8, 128, 132)]:
        pieces = launch_pieces(s, e, heads, pairs, align, slots)
        assert pieces[0][0] == s and pieces[-1][1] == e and all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
        wave = max(1, slots // heads) * align
        rows = pieces[0][1] - pieces[0][0]
        assert len(pieces) > 1 and rows % wave == 0 and all(b - a == rows for a, b in pieces[:-1])
        assert rows == wave or all((b - a) * b * heads <= pairs for a, b in pieces)


class Boundaries:
    """What a prefill reports: chunks done (update) and boundaries inside them (pace)."""

    def __init__(self):
        self.paces = 0

    def update(self, n):
        pass

    def pace(self):
        self.paces += 1


@pytest.mark.parametrize("paged", [False, True])
def test_dense_attention_in_short_launches_equals_one_launch_a_chunk(tiny, monkeypatch, paged):
    """short_launches: a chunk's dense attention over more query-key pairs than LAUNCH_PAIRS goes
    in pieces of its queries, a boundary (progress.pace) between two; the logits and the cache
    equal those of one launch a chunk, and the dense forward's (the plain kernel, and the paged
    route fa3 takes, its torch twin standing in)."""
    import ktlong.prefill as prefill_module
    from operators.compact_attention import CompactAttention, CompactParams

    monkeypatch.setattr(prefill_module, "PIECE_ROWS", 16)
    monkeypatch.setattr(prefill_module, "LAUNCH_PAIRS", 32 * 200 * tiny.config.num_heads)  # 32 rows over 200 keys
    ids = list(np.random.default_rng(5).integers(0, 300, size=200))
    expected, _ = dense(tiny, ids)
    c = tiny.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 200, "fp32")
    results = []
    for short in (False, True):
        engine = LayerMajorPrefill(tiny.model, layout, 64, "torch", True)
        if paged:
            engine.dense_paged = CompactAttention(CompactParams.keep_all(), c.num_heads, c.num_kv_heads, 16,
                                                  tiny.model.scale, "torch", tiny.model.device)
        host, boundaries = HostKVCache(layout, pin=False), Boundaries()
        logits, _ = engine.run(ids, host, boundaries, short_launches=short)
        results.append((logits, host.k[0].clone(), boundaries.paces))
        assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-4
    (one, k_one, paces_one), (pieces, k_pieces, paces) = results
    assert float((pieces - one).abs().max() / one.abs().max()) < 1e-5 and torch.equal(k_one, k_pieces)
    # chunks (0,64) (64,128) (128,192) (192,200): 64*64, 64*128, 64*192, 8*200 rows x keys against
    # 32*200 -> 1, 2, 2 (32 rows each), 1 pieces: a boundary in each of two chunks of each layer
    assert paces_one == 0 and paces == 2 * c.num_layers
