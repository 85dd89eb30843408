"""A prefill's slices beside decode steps on a real GPU (ktlong/session/sliced_prefill.py): on
every SM the two take turns (no chunk of the prefill runs while a step does), on a green context
they run side by side. Steps and chunks are sleeping kernels, timed by events."""

import functools

import pytest
import torch

from ktlong.session.sliced_prefill import SlicedPrefill, green_contexts_supported, prefill_sms

pytestmark = pytest.mark.gpu

STEP_MS, CHUNK_MS = 20.0, 5.0


@functools.lru_cache(maxsize=None)
def cycles_a_ms() -> int:
    return int(torch.cuda.clock_rate() * 1e3)  # MHz (NVML's, asked once: its first call is slow)


def sleep_ms(ms: float) -> tuple:
    """A kernel that spins for about ms on one SM, between two timed events."""
    cycles = int(ms * cycles_a_ms())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    return start, end


def timeline(sms: int) -> tuple[list, list, list]:
    """Steps with slices of the prefill (six chunks in all) beside them, as the server's worker
    runs them: each step queued, a slice run while the device works on it (on until the step is
    done), then the owner's work on the step's result, waited for -> the steps' and the chunks'
    (start, end) and the owner's work's end, in ms from the first step's start."""
    device = torch.device("cuda", torch.cuda.current_device())
    steps, chunks, tokens = [], [], []

    def run(pause):
        for _ in range(6):
            chunks.append(sleep_ms(CHUNK_MS))
            pause()
        return "done"

    with torch.cuda.stream(torch.cuda.Stream(device)):
        p = SlicedPrefill(run, 0.0, lambda: True, device, sms)
        while True:
            p.before_step()
            steps.append(sleep_ms(STEP_MS))
            ended = p.advance(steps[-1][1].query)
            tokens.append(torch.cuda.Event(enable_timing=True))  # the owner's work on the step's logits
            tokens[-1].record()
            tokens[-1].synchronize()
            if ended:
                break
        torch.cuda.synchronize(device)
    assert p.error is None and p.result == "done"
    base = steps[0][0]
    return ([(base.elapsed_time(s), base.elapsed_time(e)) for s, e in steps],
            [(base.elapsed_time(s), base.elapsed_time(e)) for s, e in chunks],
            [base.elapsed_time(t) for t in tokens])


def test_on_every_sm_the_prefills_chunks_and_the_steps_take_turns():
    steps, chunks, tokens = timeline(0)
    spans = sorted(steps + chunks)
    # no two overlap: each starts once the one before has ended
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans
    # and the chunks ran between the steps, not after them all
    assert chunks[0][1] <= steps[1][0] and len(steps) > 2, (steps, chunks)
    # the owner's work on a step's result waits for the step only, not for the chunks queued
    # beside it: it is done before the first chunk after the step ends
    for step, token in zip(steps, tokens):
        after = [c for c in chunks if c[0] >= step[1]]
        assert not after or token < after[0][1], (steps, chunks, tokens)


@pytest.mark.skipif(not torch.cuda.is_available() or not green_contexts_supported(),
                    reason="this torch makes no CUDA green contexts")
def test_on_a_green_context_the_prefills_chunks_run_beside_the_steps():
    sms = prefill_sms(0.15, torch.cuda.get_device_properties(0).multi_processor_count)
    steps, chunks, _ = timeline(sms)
    # the first chunk waits for what the owner queued before the prefill (the first step); the
    # rest run while the steps do (here five of the six chunks whole)
    assert chunks[0][0] >= steps[0][1]
    beside = sum(max(0.0, min(c[1], s[1]) - max(c[0], s[0])) for c in chunks for s in steps)
    assert beside >= 0.5 * len(chunks) * CHUNK_MS, (steps, chunks)
