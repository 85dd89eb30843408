"""A prefill's slices beside decode steps on a real GPU (ktlong/session/sliced_prefill.py): on
every SM the two take turns (no chunk of the prefill runs while a step does), on a green context
they run side by side. Steps and chunks are sleeping kernels, timed by events."""

import pytest
import torch

from ktlong.session.sliced_prefill import SlicedPrefill, green_contexts_supported, prefill_sms

pytestmark = pytest.mark.gpu

STEP_MS, CHUNK_MS = 20.0, 5.0


def sleep_ms(ms: float) -> tuple:
    """A kernel that spins for about ms on one SM, between two timed events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(ms * 1e-3 * torch.cuda.clock_rate() * 1e6))
    end.record()
    return start, end


def timeline(sms: int) -> tuple[list, list]:
    """Four steps with a slice of the prefill (three chunks in all, a chunk a slice) beside each
    -> the steps' and the chunks' (start, end) in ms from the first step's start."""
    device = torch.device("cuda", torch.cuda.current_device())
    steps, chunks = [], []

    def run(pause):
        for _ in range(3):
            chunks.append(sleep_ms(CHUNK_MS))
            pause()
        return "done"

    with torch.cuda.stream(torch.cuda.Stream(device)):
        p = SlicedPrefill(run, 0.0, lambda: True, device, sms)
        while True:
            steps.append(sleep_ms(STEP_MS))
            if p.advance():
                break
        torch.cuda.synchronize(device)
    assert p.error is None and p.result == "done"
    base = steps[0][0]
    return ([(base.elapsed_time(s), base.elapsed_time(e)) for s, e in steps],
            [(base.elapsed_time(s), base.elapsed_time(e)) for s, e in chunks])


def test_on_every_sm_the_prefills_chunks_and_the_steps_take_turns():
    steps, chunks = timeline(0)
    spans = sorted(steps + chunks)
    # no two overlap: each starts once the one before has ended
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans
    # the chunk of each slice runs after the step it was queued beside, before the next step
    for (step, nxt), chunk in zip(zip(steps, steps[1:]), chunks):
        assert step[1] <= chunk[0] and chunk[1] <= nxt[0]


@pytest.mark.skipif(not torch.cuda.is_available() or not green_contexts_supported(),
                    reason="this torch makes no CUDA green contexts")
def test_on_a_green_context_the_prefills_chunks_run_beside_the_steps():
    sms = prefill_sms(0.15, torch.cuda.get_device_properties(0).multi_processor_count)
    steps, chunks = timeline(sms)
    # the first chunk waits for what the owner queued before the prefill (the first step); each
    # later slice's chunk starts while the step it was queued beside still runs
    assert chunks[0][0] >= steps[0][1]
    assert all(step[0] <= chunk[0] < step[1] for step, chunk in zip(steps[1:], chunks[1:])), (steps, chunks)
