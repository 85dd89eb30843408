"""The selected blocks' Triton attention kernel against torch ops: gather each kv head's selected
pages, widen them to float32, attend over its valid tokens. On the CPU the kernel
runs in Triton's interpreter (tests/conftest.py); on a GPU compiled, on the device."""

import pytest
import torch

from operators.selected_blocks_kernel import KeptBlocks, LayerPages, NearPages, selected_blocks_attention, kernel_applies
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
    layer = LayerPages(data[0].to(**to), data[1].to(**to), None if scales is None else scales[0].to(**to),
                       None if scales is None else scales[1].to(**to), hit_index.to(**to), hit_valid.to(**to))
    out, lse = (t[0] for t in selected_blocks_attention(q[None].to(**to), [layer], 0.125))
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
    state, calls = (base_out[None].to(**to), base_lse[None].to(**to)), []

    def joined():
        calls.append(1)
        return state
    layer = LayerPages(data[0].to(**to), data[1].to(**to), None, None, hit_index.to(**to), hit_valid.to(**to))
    out, lse = (t[0] for t in selected_blocks_attention(q[None].to(**to), [layer], 0.125,
                                                        base=joined if deferred else state))
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
    out = torch.empty(1, num_kv * group, dim, **to)
    layer = LayerPages(far[0].to(**to), far[1].to(**to), scales(far_scales, 0), scales(far_scales, 1),
                       hit_index.to(**to), hit_valid.to(**to), near=copy)
    got, lse = selected_blocks_attention(q[None].to(**to), [layer], 0.125, out=out)
    assert got is out
    out, lse = out[0], lse[0]
    from_copy = (blocks < count)[..., None, None]
    k, v = (torch.where(from_copy, near_values[p][hit_index], far_values[p][hit_index]).view(num_kv, -1, dim)
            for p in range(2))
    ref_out, ref_lse = attention_over_prefix(q.float(), k, v, hit_valid, 0.125)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)


def conversation(g, kv_type, num_kv, per_head, block, dim, selected, count):
    """One conversation's DRAM pages, a device copy of its first `count` blocks per head (other
    values than DRAM's), a selection of distinct blocks per head -> (LayerPages, the values each
    selected entry should read [2, KV, S * block, D])."""
    rows = num_kv * per_head
    far, far_scales, far_values = pages(rows, block, dim, kv_type, g)
    near, near_scales, near_values = pages(rows, block, dim, kv_type, g)
    blocks = torch.stack([torch.randperm(per_head, generator=g)[:selected] for _ in range(num_kv)])
    index = blocks + torch.arange(num_kv)[:, None] * per_head
    scales = lambda s, p: None if s is None else s[p].to(DEVICE)
    copy = NearPages(torch.tensor(count, device=DEVICE), per_head, near[0].to(DEVICE), near[1].to(DEVICE),
                     scales(near_scales, 0), scales(near_scales, 1))
    layer = LayerPages(far[0].to(DEVICE), far[1].to(DEVICE), scales(far_scales, 0), scales(far_scales, 1),
                       index.to(DEVICE), torch.zeros(num_kv, dtype=torch.int64, device=DEVICE), near=copy)
    from_copy = (blocks < count)[..., None, None]
    values = torch.stack([torch.where(from_copy, near_values[p][index], far_values[p][index]).view(num_kv, -1, dim)
                          for p in range(2)])
    return layer, values


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_one_launch_attends_each_conversation_to_its_own_blocks(kv_type):
    """Three conversations, each with its own DRAM tables, device copy (of a different count),
    selection and valid tokens, in one launch: each equals its own attention over its blocks, and
    the windows' states of all three merge in each to its own."""
    from operators.merge_state import merge_states

    g = torch.Generator().manual_seed(5)
    num_kv, group, dim, block, per_head, selected = 2, 4, 32, 32, 7, 4
    batch = [conversation(g, kv_type, num_kv, per_head, block, dim, selected, count) for count in (0, 3, 7)]
    valid = [torch.tensor([4 * block, 2 * block]), torch.tensor([0, 4 * block]), torch.tensor([3 * block, 1 * block])]
    layers = []
    for (layer, _), tokens in zip(batch, valid):
        layer.valid.copy_(tokens)
        layers.append(layer)
    q = torch.randn(3, num_kv * group, dim, generator=g)
    base_out, base_lse = torch.randn(3, num_kv * group, dim, generator=g), torch.randn(3, num_kv * group, generator=g)
    out, lse = selected_blocks_attention(q.to(DEVICE), layers, 0.125, base=(base_out.to(DEVICE), base_lse.to(DEVICE)))
    for b, ((_, values), tokens) in enumerate(zip(batch, valid)):
        ref_out, ref_lse = attention_over_prefix(q[b], values[0], values[1], tokens, 0.125)
        ref_out, ref_lse = merge_states(ref_out, ref_lse, base_out[b], base_lse[b])
        torch.testing.assert_close(out[b].cpu(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b].cpu(), ref_lse, rtol=1e-5, atol=1e-5)


def kept_slots(layer: LayerPages, slots: int) -> KeptBlocks:
    num_kv = layer.index.shape[0]
    like = lambda t: None if t is None else torch.zeros((num_kv * slots, *t.shape[1:]), dtype=t.dtype, device=DEVICE)
    return KeptBlocks(like(layer.k), like(layer.v), like(layer.k_scales), like(layer.v_scales),
                      torch.full((num_kv, slots), -1, dtype=torch.int64, device=DEVICE),
                      torch.zeros((2, num_kv, slots), dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_kept_blocks_are_read_from_their_slots_and_the_rest_from_dram(kv_type):
    """Two conversations over three steps. Step 1 reads its blocks from DRAM (those below the
    device copy's count from the copy) and keeps them; then DRAM is overwritten with other
    values, so the reference can tell where each block was read: step 2 must read its blocks
    that step 1 read from DRAM from their slots (the old values) and its new ones from DRAM (the
    new values), and keep those in slots no selected block holds; step 3 goes back to step 1's
    blocks and reads old values exactly where the slots still hold them."""
    g = torch.Generator().manual_seed(9)
    num_kv, group, dim, block, per_head, slots, count = 2, 4, 32, 32, 9, 4, 2
    layers, old_values = [], []
    for b in range(2):
        layer, _ = conversation(g, kv_type, num_kv, per_head, block, dim, slots, count)
        layers.append(layer._replace(kept=kept_slots(layer, slots)))
        old_values.append(dram_values(layer))
    steps = [[torch.stack([torch.randperm(per_head, generator=g)[:slots] for _ in range(num_kv)]) for _ in range(2)]]
    # step 2 keeps two of step 1's blocks per head and takes two others; step 3 is step 1 again
    second = []
    for first in steps[0]:
        rest = [torch.tensor([x for x in torch.randperm(per_head, generator=g).tolist() if x not in f.tolist()][:2])
                for f in first]
        second.append(torch.stack([torch.cat([f[:2], r]) for f, r in zip(first, rest)]))
    steps += [second, steps[0]]
    valid = torch.tensor([slots * block, 3 * block])  # kv head 1 reads only its first three
    held = [[{} for _ in range(num_kv)] for _ in range(2)]  # per conversation and head: row -> values it was kept with
    for step, chosen in enumerate(steps):
        if step == 1:  # DRAM changes under the slots
            for layer in layers:
                overwrite_dram(layer, g, kv_type)
        q = torch.randn(2, num_kv * group, dim, generator=g)
        for layer, blocks in zip(layers, chosen):
            layer.index.copy_(blocks + torch.arange(num_kv)[:, None] * per_head)
            layer.valid.copy_(valid)
        out, lse = selected_blocks_attention(q.to(DEVICE), layers, 0.125)
        for b, (layer, blocks) in enumerate(zip(layers, chosen)):
            now = dram_values(layer)
            near = near_values(layer)
            k, v = [], []
            for h in range(num_kv):
                read = []
                for e, block_id in enumerate(blocks[h].tolist()):
                    row = h * per_head + block_id
                    if block_id < count:
                        read.append(near[:, row])
                    elif row in held[b][h]:
                        read.append(held[b][h][row])
                    else:
                        read.append(now[:, row])
                k.append(torch.cat([r[0] for r in read]))
                v.append(torch.cat([r[1] for r in read]))
            ref_out, ref_lse = attention_over_prefix(q[b], torch.stack(k), torch.stack(v), valid, 0.125)
            torch.testing.assert_close(out[b].cpu(), ref_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[b].cpu(), ref_lse, rtol=1e-5, atol=1e-5)
            rows = layer.kept.rows.cpu()
            for h in range(num_kv):
                live = [h * per_head + x for x in blocks[h, :int(valid[h]) // block].tolist() if x >= count]
                kept = [r for r in rows[h].tolist() if r >= 0]
                assert len(set(kept)) == len(kept) and set(live) <= set(kept)  # every block read from DRAM is held
                for row in live:
                    held[b][h].setdefault(row, now[:, row])
                held[b][h] = {row: held[b][h][row] for row in kept}  # what the slots hold after the step


def dram_values(layer: LayerPages) -> torch.Tensor:
    """[2, rows, B, D] float32 values of the DRAM pages."""
    return _values(layer.k, layer.v, layer.k_scales, layer.v_scales)


def near_values(layer: LayerPages) -> torch.Tensor:
    n = layer.near
    return _values(n.k, n.v, n.k_scales, n.v_scales)


def _values(k, v, ks, vs) -> torch.Tensor:
    data = torch.stack([k, v]).cpu()
    if ks is None:
        return data.float()
    return dequantize_kv(data, torch.stack([ks, vs]).cpu(), "q8_0", torch.float32)


def overwrite_dram(layer: LayerPages, g, kv_type):
    rows, block, dim = layer.k.shape  # q8_0: a byte a value
    data, scales, _ = pages(rows, block, dim, kv_type, g)
    layer.k.copy_(data[0])
    layer.v.copy_(data[1])
    if scales is not None:
        layer.k_scales.copy_(scales[0])
        layer.v_scales.copy_(scales[1])


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_a_block_that_conversations_sharing_a_document_select_is_read_once(kv_type):
    """Conversations 0, 2 and 3 share one document (one copy of its pages), conversation 1 has
    its own. Over two steps, each block that a later one of the group would read from DRAM and
    an earlier one reads from DRAM in the same step, or holds in a slot, is read from the first
    such one's slot instead (its plan's source <= -2, naming that one), and kept in its own slot
    as if read from DRAM: conversation 3 borrows from 0, or from 2 what 2 did not borrow itself;
    blocks of the device copy and blocks a conversation holds itself are not borrowed; a
    conversation outside the group borrows nothing. Every output equals its attention over its
    blocks' values (the device copy's below its count, DRAM's otherwise)."""
    g = torch.Generator().manual_seed(11)
    num_kv, group, dim, block, per_head, slots, count = 2, 4, 32, 32, 12, 5, 2
    own, _ = conversation(g, kv_type, num_kv, per_head, block, dim, slots, count)
    document, _ = conversation(g, kv_type, num_kv, per_head, block, dim, slots, count)
    layers = [document._replace(kept=kept_slots(document, slots), share_group=7, shared_blocks=per_head),
              own._replace(kept=kept_slots(own, slots), share_group=-1),
              *(document._replace(index=document.index.clone(), valid=document.valid.clone(),
                                  kept=kept_slots(document, slots), share_group=7, shared_blocks=per_head)
                for _ in range(2))]
    picks = [  # per step, per conversation, per kv head: its blocks, best first
        [[[2, 3, 4, 5, 6], [0, 7, 8, 9, 10]], [[3, 4, 5, 6, 7], [1, 2, 3, 4, 5]], [[4, 5, 9, 1, 11], [8, 9, 3, 0, 2]],
         [[8, 11, 4, 7, 2], [3, 9, 10, 5, 11]]],
        [[[2, 3, 8, 9, 10], [7, 8, 11, 5, 6]], [[3, 4, 5, 6, 7], [1, 2, 3, 4, 5]],
         [[3, 8, 9, 10, 11], [7, 8, 10, 4, 6]], [[9, 10, 2, 6, 5], [9, 4, 6, 11, 2]]],
    ]
    valid = torch.tensor([slots * block, 4 * block])  # kv head 1 reads its first four
    held = [[set() for _ in range(num_kv)] for _ in layers]  # the blocks each one's slots hold
    for step, chosen in enumerate(picks):
        q = torch.randn(len(layers), num_kv * group, dim, generator=g)
        for layer, blocks in zip(layers, chosen):
            layer.index.copy_(torch.tensor(blocks) + torch.arange(num_kv)[:, None] * per_head)
            layer.valid.copy_(valid)
        out, lse = selected_blocks_attention(q.to(DEVICE), layers, 0.125)
        for b, (layer, blocks) in enumerate(zip(layers, chosen)):
            far, near = dram_values(layer), near_values(layer)
            k, v = [], []
            for h in range(num_kv):
                read = [near[:, h * per_head + x] if x < count else far[:, h * per_head + x] for x in blocks[h]]
                k.append(torch.cat([r[0] for r in read]))
                v.append(torch.cat([r[1] for r in read]))
            ref_out, ref_lse = attention_over_prefix(q[b], torch.stack(k), torch.stack(v), valid, 0.125)
            torch.testing.assert_close(out[b].cpu(), ref_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[b].cpu(), ref_lse, rtol=1e-5, atol=1e-5)
        source = [layer.kept.plan[0].cpu() for layer in layers]
        for h in range(num_kv):
            live = [[x for x in chosen[b][h][:int(valid[h]) // block] if x >= count] for b in range(len(layers))]
            lenders = {x: 0 for x in live[0]}  # conversation 0 reads each of its live blocks from DRAM or its slot
            for b in (2, 3):
                expected = {x: lenders[x] for x in live[b] if x in lenders and x not in held[b][h]}
                codes = {x: int(source[b][h, e]) for e, x in enumerate(chosen[b][h]) if source[b][h, e] <= -2}
                assert {x: (-2 - code) % len(layers) for x, code in codes.items()} == expected, (step, b, h)
                assert expected or b == 3, (step, h)
                for x in live[b]:  # what it reads itself (from DRAM or its slot), the later ones may borrow
                    lenders.setdefault(x, b)
            assert step or any(lender == 2 for lender in expected.values())  # 3 borrows from 2 at least once
            assert not step or h or expected[9] == 0  # 0 reads block 9 and 2 holds it: 3 takes the first's
            assert (source[0][h] > -2).all() and (source[1][h] > -2).all()  # the first, and one outside, borrow nothing
            for b in range(len(layers)):
                held[b][h] |= set(live[b])
                rows = layers[b].kept.rows[h].cpu().tolist()
                assert {r - h * per_head for r in rows if r >= 0} >= set(live[b])
        # each slot of conversations 2 and 3 holds its block's DRAM values, borrowed or read
        for layer in layers[2:]:
            kept_values = _values(*layer.kept[:4])
            far = dram_values(layer)
            for h in range(num_kv):
                for s, row in enumerate(layer.kept.rows[h].tolist()):
                    if row >= 0:
                        assert torch.equal(kept_values[:, h * slots + s], far[:, row])
