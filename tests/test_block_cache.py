"""The device's cache of recently selected blocks (ktlong/decode/block_cache.py): its bookkeeping
against a plain LRU written here, its attention against attention over the valid keys, and decode
with it against decode without it (the same blocks selected, so the same logits). On the CPU the
"device" is the CPU and the parts run eagerly; tests/test_gpu_block_cache.py replays them."""

import numpy as np
import pytest
import torch

from cpu_ops.block_cache import admit_misses, gather_pages, split_hits
from ktlong.kv.layout import model_kv_layout
from ktlong.session.long_context import LongContextSession
from operators.window_attention import attention_over_prefix, attention_with_lse
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model


class LruReference:
    """One kv head's slots, least recently used evicted first, never a slot read this step."""

    def __init__(self, slots):
        self.held, self.used = [None] * slots, [-1] * slots

    def step(self, selected, step, budget):
        """-> (hits, admitted [(block, slot)], misses left to the CPU)."""
        hits = [b for b in selected if b in self.held]
        for b in hits:
            self.used[self.held.index(b)] = step
        misses = [b for b in selected if b not in self.held]
        admitted = []
        for b in misses[:budget]:
            candidates = [s for s in range(len(self.held)) if self.used[s] < step]
            if not candidates:
                break
            s = min(candidates, key=lambda s: (self.used[s], s))
            self.held[s], self.used[s] = b, step
            admitted.append((b, s))
        return hits, admitted, misses[len(admitted):]


@pytest.mark.parametrize("slots", [3, 6])
def test_split_and_admission_follow_a_plain_lru(slots):
    rng = np.random.default_rng(0)
    num_blocks, k, budget = 40, 4, 3
    slot_of = np.full((1, num_blocks), -1, np.int32)
    block_in = np.full((1, slots), -1, np.int32)
    last_used = np.full((1, slots), -1, np.int64)
    ref = LruReference(slots)
    hit_index, hit_valid = np.zeros((1, k), np.int64), np.zeros(1, np.int64)
    miss_blocks, miss_counts = np.zeros((1, k), np.int32), np.zeros(1, np.int32)
    heads, blocks, where = np.zeros(8, np.int64), np.zeros(8, np.int32), np.zeros(8, np.int32)
    recent = list(range(8))
    for step in range(60):  # a slowly drifting selection: mostly hits, some misses
        selected = list(rng.choice(recent, k, replace=False)) if step % 5 else list(rng.choice(num_blocks, k, replace=False))
        recent = recent[1:] + [int(rng.integers(num_blocks))] if step % 3 == 0 else recent
        chosen = np.array([selected], np.int32)
        split_hits(chosen, np.array([k], np.int32), slot_of, last_used, step, slots + 1, 16, hit_index, hit_valid,
                   miss_blocks, miss_counts)
        n = admit_misses(miss_blocks, miss_counts, slot_of, block_in, last_used, step, budget, slots + 1, 16,
                         hit_index, hit_valid, heads, blocks, where)
        hits, admitted, left = ref.step(selected, step, budget)
        device = hits + [b for b, _ in admitted]  # the device attends to the hits, then the admitted
        assert hit_valid[0] == 16 * len(device)
        assert [int(ref.held[s]) for s in hit_index[0, :len(device)]] == device
        assert list(zip(blocks[:n].tolist(), where[:n].tolist())) == admitted
        assert list(miss_blocks[0, :miss_counts[0]]) == left  # what the CPU reads
        assert [-1 if b is None else b for b in ref.held] == block_in[0].tolist()
        held = {b: s for s, b in enumerate(ref.held) if b is not None}
        assert {b: int(slot_of[0, b]) for b in np.nonzero(slot_of[0] >= 0)[0]} == held


def test_admission_takes_heads_in_turn_and_gathers_their_pages():
    slot_of, block_in = np.full((2, 20), -1, np.int32), np.full((2, 4), -1, np.int32)
    last_used = np.full((2, 4), -1, np.int64)
    miss_blocks = np.array([[3, 4, 5, 6], [7, 8, 0, 0]], np.int32)
    miss_counts = np.array([4, 2], np.int32)
    hit_index, hit_valid = np.zeros((2, 4), np.int64), np.array([0, 16])  # head 1 already has one hit
    heads, blocks, where = np.zeros(3, np.int64), np.zeros(3, np.int32), np.zeros(3, np.int32)
    n = admit_misses(miss_blocks, miss_counts, slot_of, block_in, last_used, 0, 3, 5, 16, hit_index, hit_valid,
                     heads, blocks, where)
    assert n == 3 and heads.tolist() == [0, 1, 0] and blocks.tolist() == [3, 7, 4]
    assert hit_valid.tolist() == [32, 32] and hit_index[0, :2].tolist() == [0, 1] and hit_index[1, 1] == 5 + 0
    assert miss_counts.tolist() == [2, 1] and miss_blocks[0, :2].tolist() == [5, 6] and miss_blocks[1, 0] == 8
    k = np.arange(2 * 20 * 2 * 3, dtype=np.float32).reshape(2, 20, 2, 3)
    out = np.zeros((4, 2, 2, 3), np.float32)
    gather_pages(k, -k, heads, blocks, n, out)
    np.testing.assert_array_equal(out[:3, 0], k[heads, blocks])
    np.testing.assert_array_equal(out[:3, 1], -k[heads, blocks])
    assert not out[3].any()


def test_attention_over_prefix_equals_attention_over_each_heads_valid_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 16, generator=g), torch.randn(3, 40, 16, generator=g), torch.randn(3, 40, 16, generator=g)
    valid = torch.tensor([40, 0, 17])
    out, lse = attention_over_prefix(q, k, v, valid, 0.25)
    for h, n in enumerate(valid.tolist()):
        rows = slice(2 * h, 2 * h + 2)
        if n == 0:  # nothing held: an empty state, merged away
            assert torch.isinf(lse[rows]).all() and (out[rows] == 0).all()
            continue
        ref_out, ref_lse = attention_with_lse(q[rows], k[h:h + 1, :n], v[h:h + 1, :n], 0.25)
        torch.testing.assert_close(out[rows], ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[rows], ref_lse, rtol=1e-5, atol=1e-6)


def session(lm, cache_blocks, kv_type="fp32", context_attention=None, **settings):
    chosen = selection(**{"preselect_block": False, "dense_layer_num": 0, **settings})
    layout = with_anchors(model_kv_layout(lm.config, 16, 512, kv_type, local_windows_len=48,
                                          page_type="fp32" if kv_type in ("q8_0", "q4_0") else None), chosen)
    return LongContextSession(lm.model, layout, chunk_size=64, backend="torch", hidden_on_device=True, compact=None,
                              selection=chosen, local_windows_len=48, use_cuda_graph=False,
                              device_cache_blocks=cache_blocks, context_attention=context_attention)


@pytest.mark.parametrize("kv_type, settings", [("fp32", {}), ("fp32", {"token_step": 3, "layer_step": 2}),
                                               ("q8_0", {}), ("q4_0", {"head_select_mode": "SEPARATE"})])
def test_decode_with_the_block_cache_equals_decode_without(tmp_path, kv_type, settings):
    """3 slots for 4 selected blocks: every step the device attends to some (held or taken in),
    the CPU to the rest."""
    wide = kv_type != "fp32"  # q8_0 and q4_0 rows are 32 values
    spec = TinySpec(num_layers=3, hidden=128 if wide else 64, num_heads=4, num_kv_heads=2, head_dim=32 if wide else 16)
    lm = tiny_model(tmp_path, spec, seed=9)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 298, size=300)]
    plain, cached = session(lm, 0, kv_type, second_select_num=4, **settings), session(lm, 3, kv_type, second_select_num=4, **settings)
    a, b = plain.prefill(prompt), cached.prefill(prompt)
    for _ in range(40):  # the window slides: context blocks join selection while the cache fills
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a.argmax())
        a, b = plain.step(token), cached.step(token)
    times = cached.decoder.times
    assert plain.decoder.cache is None and times.selected == plain.decoder.times.selected > 0
    assert 0 < times.cached < times.selected  # some blocks came from the cache, some from DRAM
    assert times.kv_bytes == plain.decoder.times.kv_bytes * (times.selected - times.cached) // times.selected


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_the_plan_counts_the_bytes_the_cache_allocates(kv_type):
    from ktlong.decode.block_cache import DeviceBlockCache, block_cache_bytes
    from ktlong.kv.layout import kv_layout

    layout = kv_layout(3, 2, 64, 16, 2048, kv_type)
    cache = DeviceBlockCache(layout, len(layout.global_layers), 10, 4, 0.125, torch.device("cpu"))
    held = [cache.data, cache.stage] + ([cache.scales, cache.stage_scales] if cache.scales is not None else [])
    allocated = sum(t.nbytes for t in held)
    # what attend gathers of one layer: the 4 selected blocks of 2 kv heads, K and V, as stored
    # (the held pages' own rows) and widened to float32
    page = cache.data[0, 0, 0].nbytes + (cache.scales[0, 0, 0].nbytes if cache.scales is not None else 0)
    gathered = 2 * 2 * 4 * (page + 16 * 64 * 4)
    assert block_cache_bytes(layout, 10, 4) == allocated + gathered
    assert block_cache_bytes(layout, 0, 4) == 0
