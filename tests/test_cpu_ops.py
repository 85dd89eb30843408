"""Numba decode operators against plain numpy references."""

import math

import numba
import numpy as np
import pytest

from cpu_ops.anchors import stored_anchors
from cpu_ops.bf16 import from_bf16, to_bf16
from cpu_ops.block_select import QUEST, block_scores, score_blocks, select_blocks, select_blocks_reference
from cpu_ops.kv_storage import KIND, KV_TYPES, decode, encode, half_value, load_rows
from cpu_ops.sparse_attention import NO_SCALES, attend_into, sparse_attention, sparse_attention_reference
from tests.anchors_reference import build_anchors_reference

KV, H, D, B = 2, 8, 64, 16


def data(num_blocks=12, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((KV, num_blocks, B, D)).astype(np.float32)
    v = rng.standard_normal((KV, num_blocks, B, D)).astype(np.float32)
    q = rng.standard_normal((H, D)).astype(np.float32)
    return q, k, v


def as_arrays(lists):
    width = max(len(x) for x in lists) or 1
    blocks = np.zeros((len(lists), width), np.int32)
    for h, lst in enumerate(lists):
        blocks[h, :len(lst)] = lst
    return blocks, np.array([len(x) for x in lists], np.int32)


def dense_with_lse(q, k, v, num_tokens, scale):
    """Dense float64 attention over the first num_tokens tokens of every block."""
    keys = k.reshape(KV, -1, D)[:, :num_tokens].astype(np.float64)
    vals = v.reshape(KV, -1, D)[:, :num_tokens].astype(np.float64)
    out, lse = np.zeros((H, D)), np.zeros(H)
    for h in range(H):
        s = keys[h // (H // KV)] @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = p @ vals[h // (H // KV)] / p.sum()
        lse[h] = s.max() + math.log(p.sum())
    return out, lse


def test_all_blocks_selected_equals_dense_attention_with_partial_last_block():
    q, k, v = data()
    num_tokens = 11 * B + 5  # block 11 holds 5 tokens; the rest of it is garbage and masked
    blocks, counts = as_arrays([list(range(12))] * KV)
    out, lse = sparse_attention(q, encode(k, "bf16"), encode(v, "bf16"), blocks, counts, num_tokens, B, 0.125)
    ref_out, ref_lse = dense_with_lse(q, decode(encode(k, "bf16")), decode(encode(v, "bf16")), num_tokens, 0.125)
    assert np.abs(out - ref_out).max() / np.abs(ref_out).max() < 1e-4
    assert np.abs(lse - ref_lse).max() < 1e-4


@pytest.mark.parametrize("kind", KV_TYPES)
def test_given_selection_equals_dense_attention_restricted_to_it(kind):
    q, k, v = data(seed=1)
    lists = [[0, 4, 5, 11], [2, 3, 11]]
    blocks, counts = as_arrays(lists)
    ks, vs = encode(k, kind), encode(v, kind)
    out, lse = sparse_attention(q, ks, vs, blocks, counts, 12 * B - 3, B, 0.125)
    ref_out, ref_lse = sparse_attention_reference(q, ks, vs, lists, 12 * B - 3, B, 0.125)
    assert np.abs(out - ref_out).max() / np.abs(ref_out).max() < 1e-4
    assert np.abs(lse - ref_lse).max() < 1e-4


@pytest.mark.parametrize("num_kv, num_heads, dim", [(1, 4, 256), (2, 14, 64), (3, 9, 32), (1, 1, 64), (1, 2, 64),
                                                   (2, 12, 64), (1, 5, 32)])
def test_head_groups_of_any_size_equal_the_reference(num_kv, num_heads, dim):
    """The kernel scores four query heads per pass, padding a remainder of 2 or 3 heads to a pass
    and taking a remainder of 1 alone, and reads bfloat16 in place for one pass, widened for more:
    groups of 4 (Gemma 3), 7 (Qwen2.5-0.5B), 3 (SmolLM2), 1, 2, 6 and 5."""
    rng = np.random.default_rng(11)
    k, v = (rng.standard_normal((num_kv, 6, B, dim)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((num_heads, dim)).astype(np.float32)
    ks, vs = encode(k, "bf16"), encode(v, "bf16")
    lists = [[0, 2, 5], [1, 3, 4, 5], [5]][:num_kv]
    out, lse = sparse_attention(q, ks, vs, *as_arrays(lists), 6 * B - 7, B, dim ** -0.5)
    ref_out, ref_lse = sparse_attention_reference(q, ks, vs, lists, 6 * B - 7, B, dim ** -0.5)
    assert np.abs(out - ref_out).max() / np.abs(ref_out).max() < 1e-4
    assert np.abs(lse - ref_lse).max() < 1e-4


def test_lse_merges_two_parts_into_the_full_result():
    q, k, v = data(seed=2)
    ks, vs = encode(k, "bf16"), encode(v, "bf16")
    a, b = as_arrays([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]), as_arrays([[5, 6, 7, 8, 9, 10, 11]] * KV)
    oa, la = sparse_attention(q, ks, vs, *a, 12 * B, B, 0.125)
    ob, lb = sparse_attention(q, ks, vs, *b, 12 * B, B, 0.125)
    m = np.maximum(la, lb)
    wa, wb = np.exp(la - m), np.exp(lb - m)
    merged = (oa * wa[:, None] + ob * wb[:, None]) / (wa + wb)[:, None]
    full, full_lse = sparse_attention(q, ks, vs, *as_arrays([list(range(12))] * KV), 12 * B, B, 0.125)
    assert np.abs(merged - full).max() < 1e-5
    assert np.abs(m + np.log(wa + wb) - full_lse).max() < 1e-5


def test_quantised_kv_error_against_bf16_is_bounded():
    q, k, v = data(num_blocks=16, seed=3)
    exact, _ = dense_with_lse(q, k, v, 16 * B, 0.125)
    blocks, counts = as_arrays([list(range(16))] * KV)
    errors = {}
    for kind in KV_TYPES:
        out, _ = sparse_attention(q, encode(k, kind), encode(v, kind), blocks, counts, 16 * B, B, 0.125)
        errors[kind] = float(np.abs(out - exact).max() / np.abs(exact).max())
    # measured: fp16 2.8e-4, bf16 4.3e-3, q8_0 6.4e-3, q4_0 1.6e-1 of the largest output
    assert errors["fp16"] < 1e-3 and errors["bf16"] < 1e-2
    assert errors["q8_0"] < 3e-2 and errors["q4_0"] < 0.3
    assert errors["fp16"] < errors["bf16"] < errors["q8_0"] < errors["q4_0"]


def test_storage_round_trip_precision():
    _, k, _ = data(seed=4)
    for kind, tol in (("bf16", 2 ** -8), ("fp16", 2 ** -11)):
        rel = np.abs(decode(encode(k, kind)) - k) / np.maximum(np.abs(k), 1e-3)
        assert rel.max() <= tol * 1.01
    # q8_0: half a step of amax/127; q4_0 (ggml's scheme, scale = extreme / -8): half a step,
    # except one full step where +8 * scale clips to +7 on the side opposite the extreme; both
    # plus the rounding of GGML's float16 scale (relative 2^-11 of amax)
    for kind, bound in (("q8_0", 1 / 127 / 2), ("q4_0", 1 / 8)):
        err = np.abs(decode(encode(k, kind)) - k).reshape(KV, 12, B, -1, 32)
        amax = np.abs(k).reshape(KV, 12, B, -1, 32).max(-1, keepdims=True)
        assert (err <= amax * (bound + 2 ** -11) * 1.01 + 1e-7).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_work_shares_do_not_change_results(threads):
    """Shares that start and end inside a head, span heads, or are empty (16 shares of 3+5+12+1
    blocks) all give the single-share result."""
    q, k, v = data(seed=5)
    ks, vs = encode(k, "fp16"), encode(v, "fp16")
    blocks, counts = as_arrays([[0, 4, 7], [1, 2, 3, 9, 11], list(range(12)), [6]][:KV])
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        a = sparse_attention(q, ks, vs, blocks, counts, 12 * B, B, 0.125, threads=threads)
        b = sparse_attention(q, ks, vs, blocks, counts, 12 * B, B, 0.125, threads=16)  # 16 shares
        one = sparse_attention(q, ks, vs, blocks, counts, 12 * B, B, 0.125, threads=1)
    finally:
        numba.set_num_threads(before)
    ref, ref_lse = sparse_attention_reference(q, ks, vs, [list(r[:n]) for r, n in zip(blocks, counts)], 12 * B, B,
                                              0.125)
    for out, lse in (a, b, one):
        assert np.abs(out - ref).max() < 1e-5 and np.abs(lse - ref_lse).max() < 1e-5


def test_stale_partial_states_in_reused_buffers_never_reach_the_output():
    """A decode step reuses attend_into's buffers every layer: a share that touches no block of a
    head leaves that head's partial state as the last call left it (NaN here) and marks it empty,
    and the merge skips it, as it must under any compiler flags (16 shares of 2+1 blocks)."""
    q, k, v = data(seed=6)
    ks, vs = encode(k, "bf16"), encode(v, "bf16")
    lists = [[3, 10], [5]]
    items, group = 16, H // KV
    parts = (np.full((KV, items, group), np.nan, np.float32), np.full((KV, items, group), np.nan, np.float32),
             np.full((KV, items, group, D), np.nan, np.float32))
    out, lse = np.full((H, D), np.nan, np.float32), np.full(H, np.nan, np.float32)
    attend_into("bf16", ks.data, NO_SCALES, vs.data, NO_SCALES, q, *as_arrays(lists), 12 * B, B, np.float32(0.125),
                *parts, out, lse)
    ref, ref_lse = sparse_attention_reference(q, ks, vs, lists, 12 * B, B, 0.125)
    assert np.abs(out - ref).max() < 1e-5 and np.abs(lse - ref_lse).max() < 1e-5


@pytest.mark.parametrize("shared", [False, True])
def test_quest_score_bounds_every_key_of_the_block(shared):
    """Min and max are stored as bfloat16 rounded outwards, so the bound survives the rounding."""
    q, k, _ = data(seed=8)
    anchors = stored_anchors(build_anchors_reference(k, 12 * B, "QUEST", 1), "QUEST")
    ids = np.arange(12, dtype=np.int32)
    scores = np.zeros((1 if shared else KV, 12), np.float32)
    score_blocks(q, anchors, ids, QUEST, shared, scores)
    group = H // KV
    best = np.array([[sum((k[h, b] @ q[h * group + g]).max() for g in range(group)) for b in range(12)]
                     for h in range(KV)])
    assert (scores >= (best.sum(0, keepdims=True) if shared else best) - 1e-4).all()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("anchor_type, anchor_num", [("MAX", 1), ("MEAN", 1), ("FIX", 2), ("DYNAMIC", 2), ("DYNAMIC", 1)])
def test_block_scores_are_max_anchor_dot_summed_over_the_group(anchor_type, anchor_num, shared):
    """Against float64 on the stored (bfloat16) anchors, for a subset of blocks out of order."""
    q, k, _ = data(seed=9)
    stored = stored_anchors(build_anchors_reference(k, 12 * B, anchor_type, anchor_num,
                                        np.random.default_rng(1).random((KV, 12, B))), anchor_type)
    anchors = from_bf16(stored).astype(np.float64)
    ids = np.array([7, 0, 3, 11, 5], np.int32)
    scores = np.zeros((1 if shared else KV, len(ids)), np.float32)
    score_blocks(q, stored, ids, 0, shared, scores)
    group = H // KV
    expected = np.array([[sum((anchors[h, b] @ q[h * group + g]).max() for g in range(group)) for b in ids]
                         for h in range(KV)])
    np.testing.assert_allclose(scores, expected.sum(0, keepdims=True) if shared else expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(block_scores(q, stored, ids, 0, shared), scores)  # the checked launcher
    with pytest.raises(ValueError, match="ids must lie in 0..11, got 3..12"):
        block_scores(q, stored, np.array([3, 12], np.int32), 0, shared)


@pytest.mark.parametrize("rows", [1, KV])
def test_selection_equals_reference_in_position_order_without_minus_inf(rows):
    rng = np.random.default_rng(10)
    ids = np.sort(rng.choice(100, 30, replace=False)).astype(np.int32)
    scores = rng.standard_normal((rows, 30)).astype(np.float32)
    scores[:, ::7] = -np.inf  # masked candidates never win, even when fewer than k remain
    scores[:, 5] = scores[:, 6]  # a tie: the earlier block wins
    for k in (6, 26, 40):
        out_blocks, out_counts = np.zeros((KV, 40), np.int32), np.zeros(KV, np.int32)
        select_blocks(scores, ids, k, out_blocks, out_counts)
        expected = select_blocks_reference(scores if rows == KV else np.repeat(scores, KV, 0), ids, k)
        for h in range(KV):
            got = list(out_blocks[h, :out_counts[h]])
            assert got == expected[h] and got == sorted(got) and len(got) == min(k, 25)


def test_selection_with_many_ties_keeps_the_earliest_blocks():
    rng = np.random.default_rng(11)
    for n, k in [(1, 1), (50, 7), (300, 32), (4000, 96)]:
        ids = np.arange(n, dtype=np.int32) * 2
        scores = rng.integers(-2, 3, (1, n)).astype(np.float32)  # five values: ties everywhere
        scores[0, rng.random(n) < 0.1] = -np.inf
        out_blocks, out_counts = np.zeros((2, max(k, 1)), np.int32), np.zeros(2, np.int32)
        select_blocks(scores, ids, k, out_blocks, out_counts)
        expected = select_blocks_reference(scores, ids, k)[0]
        assert list(out_blocks[0, :out_counts[0]]) == expected == list(out_blocks[1, :out_counts[1]])


def test_bf16_rounding_directions():
    x = np.random.default_rng(3).standard_normal(10000).astype(np.float32) * 10
    for rounding in ("nearest", "up", "down"):
        y = from_bf16(to_bf16(x, rounding)).astype(np.float64)
        assert (np.abs(y - x) <= np.abs(x) * 2.0 ** (-8 if rounding == "nearest" else -7)).all()
    assert (from_bf16(to_bf16(x, "up")) >= x).all() and (from_bf16(to_bf16(x, "down")) <= x).all()
    import torch

    np.testing.assert_array_equal(to_bf16(x), torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16))


@numba.njit
def _widen_all(kind, data, scales, out):
    """Every row of a stored [KV, NB, B, D] tensor through the kernels' own widening, in runs of
    rows that start anywhere in a block (as the decode operator reads them)."""
    words = out.view(np.uint32)
    for h in range(out.shape[0]):
        for b in range(out.shape[1]):
            for t in range(0, out.shape[2], 3):
                n = min(3, out.shape[2] - t)
                load_rows(kind, data, scales, h, b, t, n, words[h, b, t:], out[h, b, t:])


@pytest.mark.parametrize("kind", ["bf16", "fp16", "q8_0", "q4_0"])
def test_kernel_widening_equals_the_numpy_decoding_bit_for_bit(kind):
    _, k, _ = data(seed=5)
    k[0, 0, 0, :32] = 0.0  # a zero scale
    k[0, 0, 1, :32] *= 1e-4  # subnormal float16 scales
    stored = encode(k, kind)
    out = np.empty(k.shape, np.float32)
    scales = stored.scales if stored.scales.ndim == 4 else np.zeros((1, 1, 1, 1), np.uint16)
    _widen_all(KIND[kind], stored.data, scales, out)
    np.testing.assert_array_equal(out.view(np.uint32), decode(stored).view(np.uint32))


def test_half_words_widen_as_numpy_float16_for_every_word():
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(len(words), np.float32)
    _half_all(words, out)
    expected = words.view(np.float16).astype(np.float32)
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(out[finite].view(np.uint32), expected[finite].view(np.uint32))
    assert np.isnan(out[~finite]).all()


@numba.njit
def _half_all(words, out):
    for i in range(len(words)):
        out[i] = half_value(words[i])


def test_bf16_rounding_of_a_large_slice_on_every_thread_into_its_place():
    """Past PARALLEL_FROM values (a long cache's anchors) the rounding runs on every thread, from
    a slice of blocks straight into the slice of the table it belongs in: torch's bfloat16, and
    nothing outside the slice written."""
    import torch

    from cpu_ops.bf16 import PARALLEL_FROM

    x = np.random.default_rng(4).standard_normal((4, 1100, 2, 128)).astype(np.float32) * 100
    x[1, 7, 0, :3] = [np.inf, -np.inf, 3.0e38]
    part = x[:, 30:1090]
    assert part.size > PARALLEL_FROM and not part.flags.c_contiguous
    table = np.full(x.shape, 7, np.uint16)
    to_bf16(part, out=table[:, 30:1090])
    expected = torch.from_numpy(np.ascontiguousarray(part)).bfloat16().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(table[:, 30:1090], expected)
    assert (table[:, :30] == 7).all() and (table[:, 1090:] == 7).all()
    np.testing.assert_array_equal(to_bf16(part), expected)
