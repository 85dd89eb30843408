"""Whatever lies in cache_dir, the server starts: a file that is damaged or whose header is not
what ktlong writes (a JSON list, nesting 100,000 deep, a fingerprint that is a list or null) is
skipped with one log line and removed; one made for other settings is skipped and kept; a pipe
or a folder named *.ktkv is skipped without a wait; a partial write whose process is gone is
removed. --load_kv pointed at any of them says what it is in one sentence."""

import hashlib
import json
import os
import signal
from contextlib import contextmanager

import pytest

from ktlong.server.cache_store import CacheStore
from ktlong.session.cache_records import PREAMBLE, VERSION, WHOLE
from ktlong.session.saved_cache import CacheFileError, load_cache, save_cache
from tests.test_saved_cache import FP, TURNS, prompt, session_for
from tests.tiny_gguf import TinySpec, tiny_model

NAMES = [f"{i:012x}" for i in range(1, 20)]  # entry ids as the store names its files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=2, hidden=128, head_dim=32), seed=8)


@pytest.fixture(scope="module")
def saved_bytes(tiny, tmp_path_factory):
    session = session_for(tiny)
    session.prefill(prompt(70))
    path = tmp_path_factory.mktemp("saved") / "c.ktkv"
    save_cache(path, session, FP, TURNS)
    return path.read_bytes()


def checksummed(header_text: bytes) -> bytes:
    """A whole record's preamble with a right checksum over any header text, no tables."""
    return PREAMBLE.pack(WHOLE, VERSION, len(header_text), hashlib.sha256(header_text).digest()) + header_text


def dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


@contextmanager
def within(seconds: int):
    """Fail rather than hang (a FIFO opened for reading blocks until a writer comes)."""
    def expired(*_):
        raise TimeoutError(f"still waiting after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


BAD_HEADERS = {
    "json_list": checksummed(b"[1, 2, 3]"),
    "deep": checksummed(b"[" * 100_000 + b"]" * 100_000),
    "fingerprint_list": checksummed(json.dumps({"fingerprint": [1], "tensors": [], "num_tokens": 1,
                                                "token_ids": [1], "turns": []}).encode()),
    "fingerprint_null": checksummed(json.dumps({"fingerprint": None, "tensors": [], "num_tokens": 1,
                                                "token_ids": [1], "turns": []}).encode()),
    "tables_not_objects": checksummed(json.dumps({"fingerprint": FP, "tensors": [[1], "x"]}).encode()),
    "offset_a_float": checksummed(json.dumps({"fingerprint": FP, "tensors": [
        {"name": "k.0", "dtype": "float32", "shape": [1], "offset": 0.5, "nbytes": 4, "crc32": [0]}]}).encode()),
    "random": bytes(range(256)) * 8,
}


def make_store(tiny, folder, lines, disk_bytes=1 << 30):
    return CacheStore(session_for(tiny), FP, 0, str(folder), disk_bytes, 16, lines.append)


def test_start_up_skips_what_it_cannot_use_in_one_line_each_and_never_waits(tiny, tmp_path, saved_bytes):
    names = iter(NAMES)
    bad = {}
    for what, data in BAD_HEADERS.items():
        bad[what] = tmp_path / f"{next(names)}.ktkv"
        bad[what].write_bytes(data)
    good = tmp_path / f"{next(names)}.ktkv"
    good.write_bytes(saved_bytes)
    other = tmp_path / f"{next(names)}.ktkv"  # another model's: a sound file, kept for it
    other_session = session_for(tiny)
    other_session.prefill(prompt(40))
    save_cache(other, other_session, {**FP, "model": "another"}, TURNS)
    fifo, folder = tmp_path / f"{next(names)}.ktkv", tmp_path / f"{next(names)}.ktkv"
    os.mkfifo(fifo)
    folder.mkdir()
    orphan = tmp_path / f".{next(names)}.ktkv.{dead_pid()}.abcd.tmp"  # a kill -9 during a spill
    orphan.write_bytes(b"x" * 1000)
    writing = tmp_path / f".{next(names)}.ktkv.{os.getpid()}.abcd.tmp"  # a write under way: left alone
    writing.write_bytes(b"x")
    lines = []
    with within(20):
        store = make_store(tiny, tmp_path, lines)
    assert list(store.entries) == [good.stem]
    assert store.entries[good.stem].ids == prompt(70)
    assert len(lines) == len(BAD_HEADERS) + 3 and all("\n" not in line and "Traceback" not in line for line in lines)
    for what, path in bad.items():
        assert not path.exists(), what  # damaged: removed, so it takes no space outside cache_disk_gb
        assert any(path.name in line and "removed" in line for line in lines), what
    assert other.exists() and any(other.name in line and "other settings" in line for line in lines)
    assert fifo.exists() and folder.exists() and not orphan.exists() and writing.exists()


@pytest.mark.parametrize("what", ["folder", "fifo", "device", "missing", *BAD_HEADERS])
def test_load_kv_says_what_the_path_is_in_one_sentence(tiny, tmp_path, what):
    path = tmp_path / "c.ktkv"
    if what == "folder":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "device":
        path = "/dev/zero"
    elif what != "missing":
        path.write_bytes(BAD_HEADERS[what])
    expected = {"folder": "is a folder", "fifo": "not a regular file", "device": "not a regular file",
                "missing": "does not exist"}.get(what, "")
    session = session_for(tiny)
    with within(20), pytest.raises(CacheFileError) as e:
        load_cache(path, session, FP)
    assert expected in str(e.value) and "\n" not in str(e.value) and session.host.num_tokens == 0
