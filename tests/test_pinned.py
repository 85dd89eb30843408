"""Page-locking in place against a model of CUDA's rules (no GPU here): a range whose pages are
page-locked already is refused (712), unlocking an address that is not locked says so (713), and
an unlock may be refused for a while (as during a stream capture). A tensor whose unlock was
refused must keep its memory: given back, its addresses could go to a new mapping that CUDA still
counts as locked, whose own lock would then fail."""

import mmap

import pytest
import torch

from ktlong.errors import KtlongError
from ktlong.kv import pinned
from ktlong.kv.host_memory import mapped_empty

PAGE = mmap.PAGESIZE


class Driver:
    def __init__(self):
        self.locked = {}  # address -> (first page, last page)
        self.refuse_unlocks = False

    def cudaHostRegister(self, ptr, nbytes, flags):
        pages = (ptr // PAGE, (ptr + nbytes - 1) // PAGE)
        if any(a <= pages[1] and pages[0] <= b for a, b in self.locked.values()):
            return 712
        self.locked[ptr] = pages
        return 0

    def cudaHostUnregister(self, ptr):
        if self.refuse_unlocks:
            return 900  # cudaErrorStreamCaptureUnsupported
        return 0 if self.locked.pop(ptr, None) else 713


@pytest.fixture
def driver(monkeypatch):
    d = Driver()
    monkeypatch.setattr(pinned.torch.cuda, "cudart", lambda: d)
    monkeypatch.setattr(pinned.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(pinned, "_STILL_LOCKED", [])
    return d


def test_a_refused_unlock_keeps_the_memory_until_the_next_lock_unlocks_it(driver):
    keep = pinned.PinnedTensors()
    t = keep.pin(mapped_empty((4, 1024), torch.float32))
    address = t.data_ptr()
    driver.refuse_unlocks = True
    del keep, t
    assert list(driver.locked) == [address]  # still locked, so still held:
    assert [x.data_ptr() for x in pinned._STILL_LOCKED] == [address]
    driver.refuse_unlocks = False
    other = pinned.PinnedTensors()
    u = other.pin(mapped_empty((2, 1024), torch.float32))  # the next lock unlocks it first
    assert list(driver.locked) == [u.data_ptr()] and pinned._STILL_LOCKED == []
    other.close()
    assert driver.locked == {}


def test_an_unlock_of_what_is_not_locked_keeps_nothing(driver):
    t = mapped_empty((1024,), torch.float32)
    pinned.unpin(t)
    assert pinned._STILL_LOCKED == []


def test_released_ranges_lock_again_and_a_range_locked_twice_is_refused_in_one_sentence(driver):
    keep = pinned.PinnedTensors()
    t = keep.pin(mapped_empty((8, 1024), torch.float32))
    with keep.released():
        assert driver.locked == {}
    assert list(driver.locked) == [t.data_ptr()]
    with pytest.raises(KtlongError, match=r"page-locked already \(error 712\).*defect"):
        pinned.pin_in_place(t[1:])  # pages of t's range
    keep.close()
    assert driver.locked == {} and pinned._STILL_LOCKED == []


def test_collection_is_paused_inside_and_restored_after():
    import gc

    assert gc.isenabled()
    with pinned.collection_paused():
        assert not gc.isenabled()
        with pinned.collection_paused():  # nested: the outer one restores
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with pinned.collection_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
