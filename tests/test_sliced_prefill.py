"""A prefill run a slice at a time (ktlong/session/sliced_prefill.py) on a GPU: while other
conversations wait, its host loop stays at most one chunk ahead of the device, and a slice hands
control back only once its device work is done, so that a decode step never queues behind it.
The device is simulated: an event records the chunks queued so far, and waiting on it marks them
done."""

import types

import ktlong.session.sliced_prefill as sliced_prefill
from ktlong.session.sliced_prefill import SlicedPrefill


class Device:
    """Chunks queued and done, as a stream's events would report them."""

    def __init__(self):
        self.queued = self.done = 0
        self.device = self

    def Event(self):  # noqa: N802 (torch.cuda.Event's name)
        device = self

        class Event:
            def record(self):
                self.upto = device.queued

            def synchronize(self):
                device.done = max(device.done, self.upto)
        return Event()


def run_chunks(device: Device, chunks: int, seen: list):
    def run(pause):
        for _ in range(chunks):
            device.queued += 1  # a chunk's kernels queued
            pause()
            seen.append(device.queued - device.done)  # chunks the host is ahead of the device
        return "logits"
    return run


def test_while_others_wait_the_host_stays_a_chunk_ahead_and_a_slice_ends_with_its_work_done(monkeypatch):
    device = Device()
    monkeypatch.setattr(sliced_prefill, "torch", types.SimpleNamespace(cuda=device))
    cuda = types.SimpleNamespace(type="cuda")
    ahead = []
    # a slice of 0 s: every boundary ends one (each decode step in between sees the device idle)
    p = SlicedPrefill(run_chunks(device, 5, ahead), 0.0, lambda: True, cuda)
    handed_back = []
    while not p.advance():
        handed_back.append(device.queued - device.done)
    assert p.result == "logits" and handed_back == [0, 0, 0, 0, 0]
    # a long slice: the host waits for the chunk before the last one at each boundary
    device.queued = device.done = 0
    ahead.clear()
    p = SlicedPrefill(run_chunks(device, 6, ahead), 3600.0, lambda: True, cuda)
    while not p.advance():
        pass
    assert ahead == [1, 1, 1, 1, 1, 1]
    # nothing waits: no fence, the host runs ahead as far as it likes
    device.queued = device.done = 0
    ahead.clear()
    p = SlicedPrefill(run_chunks(device, 4, ahead), 0.0, lambda: False, cuda)
    assert p.advance() and ahead == [1, 2, 3, 4]
