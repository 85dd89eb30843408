"""A prefill run a slice at a time (ktlong/session/sliced_prefill.py) on a GPU: it queues on a
stream of its own, first waiting for what its owner queued; while other conversations wait its
host loop keeps at most AHEAD chunks in flight, which go on running while the owner steps; and
its results are complete before the owner reads them. The device is simulated: an event records
the chunks queued so far, and each time the host asks whether they are done one more is."""

import contextlib
import types

import pytest

import ktlong.session.sliced_prefill as sliced_prefill
from ktlong.session.sliced_prefill import AHEAD, TURNS_AHEAD, SlicedPrefill, prefill_sms


class Device:
    """Chunks queued and done, as a stream's events would report them; what the owner queued."""

    def __init__(self):
        self.queued = self.done = 0
        self.owner_work_done = False
        self.on_prefill_stream = False
        self.runs = True  # while the host asks, the device finishes a chunk at each ask
        self.step_waits_for = []  # the chunks queued up to each event the owner's next step waits for
        self.chunks_wait_from = []  # the chunks queued when the prefill's stream waited for the owner's
        device = self

        class Owner:
            def wait_event(self, event):
                device.step_waits_for.append(event.upto)
        self.owner = Owner()

    def reset(self):
        self.queued = self.done = 0

    def Event(self):  # noqa: N802 (torch.cuda's names)
        device = self

        class Event:
            def record(self):
                self.upto = device.queued

            def query(self):
                if device.runs and device.done < self.upto:
                    device.done += 1
                return device.done >= self.upto
        return Event()

    def current_stream(self, _device=None):
        return self.owner

    def Stream(self, _device=None):  # noqa: N802
        device = self

        class Stream:
            def wait_stream(self, other):
                assert other is device.owner
                device.owner_work_done = True
                device.chunks_wait_from.append(device.queued)

            def synchronize(self):
                device.done = device.queued

            def record_event(self):
                event = device.Event()
                event.record()
                return event
        return Stream()

    def green(self, monkeypatch):
        """A green context's streams for the prefill (sms > 0): it runs beside the steps."""
        self.GreenContext = types.SimpleNamespace(create=lambda num_sms, device_id: types.SimpleNamespace(
            Stream=lambda: self.Stream()))
        self.current_device = lambda: 0
        monkeypatch.setattr(sliced_prefill, "_GREEN", {})

    @contextlib.contextmanager
    def stream(self, _stream):
        self.on_prefill_stream = True
        yield
        self.on_prefill_stream = False


def run_chunks(device: Device, chunks: int, seen: list):
    def run(pause):
        assert device.owner_work_done and device.on_prefill_stream
        for _ in range(chunks):
            device.queued += 1  # a chunk's kernels queued
            pause()
            seen.append(device.queued - device.done)  # chunks the host is ahead of the device
        return "logits"
    return run


@pytest.mark.parametrize("sms", [112, 0])
def test_a_prefill_keeps_at_most_a_few_chunks_in_flight_on_its_own_stream_while_others_wait(monkeypatch, sms):
    """On a green context (sms 112) AHEAD chunks, which run beside the steps; taking turns with
    them on every SM (sms 0), TURNS_AHEAD, which the next step waits for."""
    device = Device()
    device.green(monkeypatch)
    monkeypatch.setattr(sliced_prefill, "torch", types.SimpleNamespace(cuda=device))
    cuda = types.SimpleNamespace(type="cuda", index=None)
    ahead_most = AHEAD if sms else TURNS_AHEAD
    # a slice of 0 s: every boundary hands back at once; the chunks queued keep running meanwhile
    ahead, handed_back = [], []
    p = SlicedPrefill(run_chunks(device, 6, ahead), 0.0, lambda: True, cuda, sms)
    assert p.turns == (not sms)
    while not p.advance():
        handed_back.append(device.queued - device.done)
    assert p.result == "logits" and handed_back == [min(k, ahead_most) for k in range(1, 7)]
    assert device.done == device.queued == 6  # complete before the owner reads the result
    # a long slice: the host waits for the chunk `ahead_most` boundaries back
    device.reset()
    ahead.clear()
    p = SlicedPrefill(run_chunks(device, 6, ahead), 3600.0, lambda: True, cuda, sms)
    while not p.advance():
        pass
    assert ahead == [min(k, ahead_most) for k in range(1, 7)]
    # nothing waits: no fence, the host runs ahead as far as it likes
    device.reset()
    ahead.clear()
    p = SlicedPrefill(run_chunks(device, 4, ahead), 0.0, lambda: False, cuda)
    assert p.advance() and ahead == [1, 2, 3, 4] and device.done == 4


def test_a_slice_beside_a_step_lasts_until_the_steps_device_work_is_done_if_that_is_longer(monkeypatch):
    """advance(owner_done): past slice_seconds the prefill goes on, boundary by boundary, while
    the owner's step is still running on the device (the owner would only wait for it), and hands
    back at the first boundary after it is done; without it, slice_seconds alone decides."""
    device = Device()
    monkeypatch.setattr(sliced_prefill, "torch", types.SimpleNamespace(cuda=device))
    cuda = types.SimpleNamespace(type="cuda")
    seen = []
    p = SlicedPrefill(run_chunks(device, 9, seen), 0.0, lambda: True, cuda)
    step_done_after = iter([False, False, True, True, False, True])  # the step's event, asked at each boundary
    chunks_per_slice = []
    while True:
        before = device.queued
        ended = p.advance(lambda: next(step_done_after, True))
        chunks_per_slice.append(device.queued - before)
        if ended:
            break
    # first slice: the step ran on for two boundaries, so three chunks; second: done at once;
    # third: one boundary more; then one chunk a slice (the step is done at every ask)
    assert chunks_per_slice[:3] == [3, 1, 2] and sum(chunks_per_slice) == 9 and p.result == "logits"
    device.reset()
    seen.clear()
    p = SlicedPrefill(run_chunks(device, 3, seen), 0.0, lambda: True, cuda)
    assert [p.advance(), device.queued] == [False, 1]  # no step to wait for: one chunk a slice


def test_a_prefill_waiting_for_its_oldest_chunk_hands_back_once_the_step_is_done(monkeypatch):
    """With AHEAD chunks in flight the prefill's host waits for the oldest before it queues
    another; if the owner's step is done meanwhile (and slice_seconds passed), it hands back at
    once, not at that chunk's end, and waits on for it at its next slice (the bound holds)."""
    device = Device()
    device.green(monkeypatch)
    monkeypatch.setattr(sliced_prefill, "torch", types.SimpleNamespace(cuda=device))
    monkeypatch.setattr(sliced_prefill, "POLL_SECONDS", 0.0)
    cuda = types.SimpleNamespace(type="cuda", index=None)
    seen = []
    p = SlicedPrefill(run_chunks(device, 6, seen), 0.0, lambda: True, cuda, 112)
    device.runs = False  # the chunks run for long: none ends while the host asks
    asks = iter([False] * 5 + [True] * 100)  # the step's event: done at the sixth ask
    assert not p.advance(lambda: next(asks))
    # it queued AHEAD + 1 chunks, then waited for the first while the step ran, and handed back
    # when the step was done, the chunk still running
    assert device.queued == AHEAD + 1 and device.done == 0
    assert not p.advance(lambda: True) and device.queued == AHEAD + 1  # still waiting: nothing more queued
    device.runs = True
    while not p.advance(lambda: True):
        assert device.queued - device.done <= AHEAD + 1
    assert p.result == "logits" and device.done == device.queued == 6


def test_taking_turns_each_step_waits_for_the_chunks_queued_before_it_and_the_next_chunks_for_it(monkeypatch):
    """On every SM beside decode steps: the owner's stream waits, before each step (before_step),
    for every chunk queued up to the last hand-back, and at each resume the prefill's stream
    waits for the owner's step before its next chunk; on a green context neither waits (they run
    side by side)."""
    for sms in (0, 112):
        device = Device()
        device.green(monkeypatch)
        monkeypatch.setattr(sliced_prefill, "torch", types.SimpleNamespace(cuda=device))
        cuda = types.SimpleNamespace(type="cuda", index=None)
        p = SlicedPrefill(run_chunks(device, 4, []), 0.0, lambda: True, cuda, sms)
        queued_at_hand_back = []
        while True:
            p.before_step()  # as the worker does, then its step
            if p.advance():
                break
            queued_at_hand_back.append(device.queued)
        if sms:  # only the first chunk waits, for what the owner queued before the prefill
            assert device.step_waits_for == [] and device.chunks_wait_from == [0]
        else:  # the first step waits for nothing; each later one for the chunks before it
            assert queued_at_hand_back == [1, 2, 3, 4] and device.step_waits_for == [1, 2, 3, 4]
            assert device.chunks_wait_from == [0, 1, 2, 3, 4]  # the first, then after each step


def test_the_prefills_own_time_is_counted_as_work_or_waits_and_never_the_owners():
    """work_seconds: the prefill thread's chunks; wait_seconds: its waits at boundaries; the
    owner's time between slices is in neither (here three chunks of 30 ms of host work, and the
    owner away 100 ms after each slice)."""
    import time

    def run(pause):
        for _ in range(3):
            time.sleep(0.03)  # a chunk's host work
            pause()
        return "logits"

    p = SlicedPrefill(run, 0.0, lambda: True)
    while not p.advance():
        time.sleep(0.1)  # the owner's own work
    assert p.result == "logits"
    assert p.work_seconds >= 0.09
    assert p.work_seconds + p.wait_seconds < 0.09 + 0.1  # none of the owner's 0.3 s


def test_the_sms_kept_for_decode_steps_leave_the_prefill_a_multiple_of_eight():
    """decode_sm_share of a GPU's SMs: the prefill beside decode steps gets the rest, rounded down
    to a green context's granularity (8), or no partition at all."""
    assert prefill_sms(0.15, 132) == 112  # the H200: 112.2 -> 112, 20 SMs kept for the steps
    assert prefill_sms(0.05, 132) == 120  # 125.4 -> 120
    assert prefill_sms(0.9, 132) == 8  # 13.2 -> 8
    assert prefill_sms(0.01, 16) == 8  # 15.84 -> 8
    assert prefill_sms(0.0, 132) == 0  # a share of 0: every SM shared
    assert prefill_sms(0.15, 8) == 0  # 6.8: fewer than 8 left to the prefill


def test_a_prefill_beside_decode_steps_runs_on_the_green_context_and_alone_on_every_sm(monkeypatch, capsys):
    """The stream is chosen when the prefill is made: the device's green context of `sms` SMs
    (made once) when the owner has work beside it, a stream on every SM when not or when sms is
    0; a driver that refuses the green context gives every SM, said once."""
    device = Device()
    made = []

    class GreenContext:
        @staticmethod
        def create(num_sms, device_id):
            made.append((num_sms, device_id))
            if refuse:
                raise RuntimeError("CUDA driver too old for green contexts\nmore")
            return types.SimpleNamespace(Stream=lambda: "green")

    device.GreenContext, device.current_device = GreenContext, lambda: 0
    plain = device.Stream
    device.Stream = lambda _device=None: ("every SM", plain())
    monkeypatch.setattr(sliced_prefill, "torch", types.SimpleNamespace(cuda=device))
    monkeypatch.setattr(sliced_prefill, "_GREEN", {})
    cuda = types.SimpleNamespace(type="cuda", index=None)
    refuse = False
    assert SlicedPrefill(lambda pause: None, 0.0, lambda: True, cuda, 112).stream == "green"
    assert SlicedPrefill(lambda pause: None, 0.0, lambda: True, cuda, 112).stream == "green"
    assert made == [(112, 0)]  # one context for the device
    assert SlicedPrefill(lambda pause: None, 0.0, lambda: False, cuda, 112).stream[0] == "every SM"
    assert SlicedPrefill(lambda pause: None, 0.0, lambda: True, cuda, 0).stream[0] == "every SM"
    monkeypatch.setattr(sliced_prefill, "_GREEN", {})
    refuse = True
    for _ in range(2):
        assert SlicedPrefill(lambda pause: None, 0.0, lambda: True, cuda, 112).stream[0] == "every SM"
    assert capsys.readouterr().err == ("[no green context (CUDA driver too old for green contexts): a prefill beside "
                                       "decode steps takes turns with them on every SM]\n")
