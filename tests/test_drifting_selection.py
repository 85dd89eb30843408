"""The decode bench's drifting selection keeps the previous token's blocks at the asked rate and
fills the rest from the real selection."""

import numpy as np
import pytest
import torch

from ktlong.bench.drifting_selection import DriftingSelection


def real_selection(rng, shared):
    def select(layer, step, q, first, last, device_scores=None):
        rows = 1 if shared else 4
        blocks = np.stack([rng.choice(200, 8, replace=False) for _ in range(rows)]).astype(np.int32)
        return np.repeat(blocks, 4 // rows, 0), np.full(4, 8, np.int32)
    return select


def run(share, shared, steps=300):
    rng = np.random.default_rng(1)
    drifting = DriftingSelection(real_selection(rng, shared), share, seed=2)
    history = [drifting(0, t, None, 0, 200)[0] for t in range(steps)]
    return history


def test_share_one_keeps_the_first_selection_and_zero_follows_the_real_one():
    history = run(1.0, False)
    assert all((h == history[0]).all() for h in history)
    rng = np.random.default_rng(1)
    real = real_selection(np.random.default_rng(1), False)
    drifting = DriftingSelection(real_selection(rng, False), 0.0)
    for t in range(20):
        np.testing.assert_array_equal(drifting(0, t, None, 0, 200)[0], real(0, t, None, 0, 200)[0])


def test_the_kept_share_matches_the_rate_and_rows_stay_valid():
    for shared in (False, True):
        history = run(0.72, shared)
        overlaps = [len(set(a[h]) & set(b[h])) / 8 for a, b in zip(history, history[1:]) for h in range(4)]
        assert abs(np.mean(overlaps) - 0.72) < 0.03
        for blocks in history:
            assert all(len(set(row)) == 8 for row in blocks)  # 8 distinct blocks per head
            assert ((blocks == blocks[:1]).all()) == shared  # SHARED stays one list


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the kernel runs in Triton's interpreter


class FakeDeviceSelection:
    """What DeviceDrift reads of a DeviceSelection: one scoring layer whose select writes a new
    random selection of 8 blocks of 200 per kv head into its index (rows h * 200 + block)."""

    def __init__(self, full: bool = True, seed: int = 4):
        self.rng = np.random.default_rng(seed)
        self.index = [torch.zeros((4, 8), dtype=torch.int64, device=DEVICE)]
        self.valid = [torch.full((4,), (8 if full else 5) * 16, dtype=torch.int64, device=DEVICE)]
        self.role, self.block_size = ["score"], 16
        self.real = []
        self.adjust = None

    def select(self, j, q):
        blocks = np.stack([self.rng.choice(200, 8, replace=False) for _ in range(4)]) + np.arange(4)[:, None] * 200
        self.real.append(blocks)
        self.index[j].copy_(torch.from_numpy(blocks))
        return self.index[j], self.valid[j]


def device_run(share, steps=80, full=True):
    from ktlong.bench.device_drift import DeviceDrift

    selection = FakeDeviceSelection(full)
    selection.adjust = DeviceDrift(selection, share, seed=3)  # after each real selection
    history = []
    for _ in range(steps):
        index, _ = selection.select(0, None)
        selection.adjust([selection], 0)
        history.append(index.cpu().numpy().copy())
    return history, selection.real


def test_a_batch_drifts_in_one_launch_as_each_member_alone():
    """Three conversations' selections drifted together (one launch, each with its own seed,
    previous rows and counter; one not full) give each the rows it gets drifted alone."""
    from ktlong.bench.device_drift import DeviceDrift

    def members():
        made = [FakeDeviceSelection(full, seed) for full, seed in ((True, 4), (False, 5), (True, 6))]
        for i, selection in enumerate(made):
            selection.adjust = DeviceDrift(selection, 0.6, seed=i)
        return made

    together, alone = members(), members()
    for _ in range(6):
        for selection in together + alone:
            selection.select(0, None)
        together[0].adjust(together, 0)
        for selection in alone:
            selection.adjust([selection], 0)
        for a, b in zip(together, alone):
            assert torch.equal(a.index[0], b.index[0])
    assert not torch.equal(together[0].index[0], torch.from_numpy(together[0].real[-1]).to(DEVICE))  # it drifted


def test_the_device_drift_keeps_the_share_and_fills_in_the_real_order():
    history, real = device_run(0.72)
    np.testing.assert_array_equal(history[0], real[0])  # no previous token: the real selection
    overlaps = []
    for before, now, chosen in zip(history, history[1:], real[1:]):
        for h in range(4):
            kept = [x for x in now[h] if x in before[h]]
            assert len(set(now[h])) == 8  # 8 distinct blocks
            # what is not kept comes from the real selection, in its order
            rest = [x for x in now[h] if x not in kept]
            assert rest == [x for x in chosen[h] if x in rest] and set(rest) <= set(chosen[h])
            overlaps.append(len(kept) / 8)
    # kept at 0.72, plus the real selection's own overlap (8 of 200: about 0.04 of the rest); 316
    # head-steps: the mean's standard deviation is about 0.009
    assert abs(np.mean(overlaps) - 0.72) < 0.04


def test_the_device_drift_at_the_ends_of_its_range():
    history, _ = device_run(1.0, steps=20)
    assert all((h == history[0]).all() for h in history)
    history, real = device_run(0.0, steps=20)
    assert all((h == r).all() for h, r in zip(history, real))
    history, real = device_run(1.0, steps=10, full=False)  # a selection that is not full is left alone
    assert all((h == r).all() for h, r in zip(history, real))


@pytest.mark.slow  # seconds on the 2-core machine: the full suite runs it, the fast lane does not
def test_a_batch_with_the_drift_on_the_device_path_steps_as_each_conversation_alone(tmp_path, monkeypatch):
    """The bench's drift where the device selects and reads, with the selection's kernels as a
    GPU runs them (Triton's interpreter here): two conversations decoded together (the drift one
    launch for both), each with its own drift, give each one's logits alone with the same drift,
    and the drift did change what was read."""
    from ktlong.bench.device_drift import DeviceDrift
    from ktlong.decode.batch import DecodeBatch
    from tests.settings import selection_kernels_as_on_a_gpu
    from tests.test_dram_blocks import session
    from tests.tiny_gguf import TinySpec, tiny_model

    selection_kernels_as_on_a_gpu(monkeypatch)
    calls = []
    batched = DeviceDrift.__call__
    monkeypatch.setattr(DeviceDrift, "__call__", lambda self, selections, j: (calls.append(len(selections)),
                                                                             batched(self, selections, j))[1])

    lm = tiny_model(tmp_path, TinySpec(num_layers=3, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16), seed=7)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 298, size=200)] for s in (3, 4)]

    def conversations():
        made = [session(lm, "fp32", "gpu", second_select_num=4, block_scoring="device") for _ in prompts]
        for i, (s, prompt) in enumerate(zip(made, prompts)):
            s.prefill(prompt)
            s.decoder.selection.adjust = DeviceDrift(s.decoder.selection, 0.5, seed=i)
        return made

    together, alone, plain = conversations(), conversations(), session(lm, "fp32", "gpu", second_select_num=4,
                                                                       block_scoring="device")
    plain.prefill(prompts[0])
    batch = DecodeBatch(lm.model, [s.decoder for s in together], use_cuda_graph=False)
    differs = False
    for step in range(4):
        tokens = [7 + step, 11 + step]
        logits = batch.step([s.decoder for s in together], tokens)
        for b, s in enumerate(alone):
            torch.testing.assert_close(logits[b], s.step(tokens[b]), rtol=1e-4, atol=1e-4)
        differs = differs or not torch.allclose(plain.step(tokens[0]), logits[0], rtol=1e-4, atol=1e-4)
    assert differs  # without the drift the first conversation reads other blocks
    assert 2 in calls  # the batch's drift: one call for both
