"""A saved KV cache loads back into a session that then answers as the one that saved it; files
that are missing, truncated, foreign, corrupted or made for other settings are refused."""

import sys

import numpy as np
import pytest
import torch

from ktlong.kv.layout import kv_layout
from ktlong.session.long_context import LongContextSession
from ktlong.session.saved_cache import CacheFileError, load_cache, save_cache
from tests.settings import selection, with_anchors
from tests.tiny_gguf import TinySpec, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=2, hidden=128, head_dim=32), seed=8)


def session_for(lm, kv_type="fp32", max_seq_len=400, block_size=16):
    c = lm.config
    chosen = selection(second_select_num=1000, preselect_block=True, preselect_block_count=4)
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, max_seq_len, kv_type,
                       page_type="fp32" if kv_type in ("q8_0", "q4_0") else None)
    return LongContextSession(lm.model, with_anchors(layout, chosen), chunk_size=32, backend="torch",
                              hidden_on_device=True, compact=None, selection=chosen, local_windows_len=24,
                              use_cuda_graph=False, max_seq_len=max_seq_len)


FP = {"model": "abc", "kv_type": "fp32"}
TURNS = [("what is in the document?", "a passkey")]


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 300, size=n)]


@pytest.mark.parametrize("kv_type", ["fp32", "q8_0", "q4_0"])
def test_a_loaded_cache_continues_as_the_saved_session(tiny, tmp_path, kv_type):
    saved = session_for(tiny, kv_type)
    saved.prefill(prompt(100))
    for t in (4, 5, 6):
        saved.step(t)
    path = tmp_path / "doc.kv"
    save_cache(path, saved, FP, TURNS)
    loaded = session_for(tiny, kv_type)
    assert load_cache(path, loaded, FP) == TURNS
    assert loaded.ids == saved.ids and loaded.host.num_tokens == 103
    for layer in range(tiny.config.num_layers):
        n = 103
        for which in ("k", "v"):
            assert torch.equal(loaded.host.tokens(layer, which, 0, n), saved.host.tokens(layer, which, 0, n))
        assert torch.equal(loaded.host.key_max[layer][:, :7], saved.host.key_max[layer][:, :7])
        assert torch.equal(loaded.host.anchor_keys[layer][:, :7], saved.host.anchor_keys[layer][:, :7])
        np.testing.assert_array_equal(loaded.block_mass[layer], saved.block_mass[layer])
    follow = saved.ids + prompt(40, seed=1)
    a, b = saved.prefill(follow), loaded.prefill(follow)
    assert loaded.last_stats.num_tokens == 40  # only the new tokens
    assert torch.equal(a, b)
    assert torch.equal(saved.step(9), loaded.step(9))


def files_mapped_at(t: torch.Tensor) -> set[str]:
    """The files mapped over t's memory, from /proc/self/maps."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start < hi and end > lo and len(fields) == 6:
                found.add(fields[5].strip())
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapping over the cache is Linux's mmap")
def test_a_cpu_cache_maps_the_file_in_place_and_never_writes_to_it(tiny, tmp_path):
    # fp32, 32 tokens x head_dim 32: a block is one 4 KiB page, so every head's K/V maps whole
    saved = session_for(tiny, block_size=32, max_seq_len=512)
    saved.prefill(prompt(100))
    path = tmp_path / "doc.kv"
    save_cache(path, saved, FP, TURNS)
    before = path.read_bytes()
    loaded = session_for(tiny, block_size=32, max_seq_len=512)
    load_cache(path, loaded, FP)
    for layer in range(tiny.config.num_layers):
        for h in range(tiny.config.num_kv_heads):
            assert files_mapped_at(loaded.host.k[layer][h, :4]) == {str(path)}
            assert files_mapped_at(loaded.host.v[layer][h, :4]) == {str(path)}
            assert str(path) not in files_mapped_at(loaded.host.k[layer][h, 4:])  # room to grow stays DRAM
    follow = saved.ids + prompt(40, seed=1)  # writes into the last, mapped block: copy-on-write
    assert torch.equal(saved.prefill(follow), loaded.prefill(follow))
    assert torch.equal(saved.step(9), loaded.step(9))
    assert path.read_bytes() == before
    n = loaded.host.num_tokens
    save_cache(path, saved, FP, TURNS)  # replaced by rename: the loaded cache keeps the old file's pages
    assert path.read_bytes() != before
    for layer in range(tiny.config.num_layers):
        assert torch.equal(loaded.host.tokens(layer, "k", 0, n), saved.host.tokens(layer, "k", 0, n))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_host_tables_are_private_mappings_on_huge_page_boundaries():
    from ktlong.kv.host_memory import mapped_empty

    t = mapped_empty((3, 1000, 128), torch.float32)
    assert t.data_ptr() % (2 << 20) == 0 and not t.any()
    with open("/proc/self/maps") as maps:  # private ("p"), not shmem, which huge pages usually skip
        perms = [line.split()[1] for line in maps
                 if int(line.split("-")[0], 16) <= t.data_ptr() < int(line.split()[0].split("-")[1], 16)]
    assert perms == ["rw-p"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapping over the cache is Linux's mmap")
def test_a_file_mapping_that_fails_leaves_writable_memory_to_copy_into(tmp_path):
    import os

    from ktlong.kv.host_memory import PAGE, map_file_pages, mapped_empty

    t = mapped_empty((2, PAGE), torch.uint8)
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * (PAGE // 256))
    fd = os.open(path, os.O_WRONLY)  # cannot be mapped for reading: EACCES
    try:
        assert map_file_pages(t[0], fd, 0, PAGE) == 0
    finally:
        os.close(fd)
    t[0] = 7  # writable, not a hole or a read-only mapping
    assert int(t[0].sum()) == 7 * PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        assert map_file_pages(t[1], fd, 0, PAGE) == PAGE and t[1].tolist() == list(range(256)) * (PAGE // 256)
    finally:
        os.close(fd)
    t[1] = 1  # copy-on-write: the file keeps its bytes
    assert path.read_bytes()[:4] == bytes([0, 1, 2, 3])


def test_writes_are_atomic_and_leave_no_temporary(tiny, tmp_path):
    s = session_for(tiny)
    s.prefill(prompt(50))
    path = tmp_path / "c.kv"
    save_cache(path, s, FP, TURNS)
    first = path.read_bytes()
    s.prefill(s.ids + prompt(30, seed=2))
    save_cache(path, s, FP, TURNS)  # replaces the file whole
    assert path.read_bytes() != first and [p.name for p in tmp_path.iterdir()] == ["c.kv"]


@pytest.fixture()
def saved_file(tiny, tmp_path):
    s = session_for(tiny)
    s.prefill(prompt(60))
    path = tmp_path / "c.kv"
    save_cache(path, s, FP, TURNS)
    return path


def refused(path, session, fp=FP):
    with pytest.raises(CacheFileError) as e:
        load_cache(path, session, fp)
    return str(e.value)


def test_bad_files_are_refused_in_one_sentence(tiny, tmp_path, saved_file):
    s = session_for(tiny)
    assert "does not exist" in refused(tmp_path / "none.kv", s)
    (tmp_path / "empty.kv").write_bytes(b"")
    assert "empty" in refused(tmp_path / "empty.kv", s)
    (tmp_path / "foreign.kv").write_bytes(b"GGUF" + bytes(100))
    assert "not a saved ktlong cache" in refused(tmp_path / "foreign.kv", s)
    data = saved_file.read_bytes()
    (tmp_path / "short.kv").write_bytes(data[: len(data) // 2])
    assert "truncated" in refused(tmp_path / "short.kv", s)
    header = bytearray(data)
    header[60] ^= 0xFF  # inside the JSON header
    (tmp_path / "header.kv").write_bytes(bytes(header))
    assert "corrupted (a header" in refused(tmp_path / "header.kv", s)
    from ktlong.session.cache_records import ALIGN, PREAMBLE

    header_len = PREAMBLE.unpack_from(data, 0)[2]
    body = bytearray(data)
    body[-(-(PREAMBLE.size + header_len) // ALIGN) * ALIGN + 3] ^= 0x01  # one bit of the first K block
    (tmp_path / "body.kv").write_bytes(bytes(body))
    message = refused(tmp_path / "body.kv", s)
    assert "corrupted (table" in message and s.host.num_tokens == 0 and s.ids == []  # not half-loaded
    for text in (message,):
        assert text.count(". ") == 0 and text.endswith(".")


def test_a_cache_for_other_settings_is_refused_naming_them_and_the_session_goes_on(tiny, saved_file):
    s = session_for(tiny)
    s.prefill(prompt(20, seed=3))
    message = refused(saved_file, s, {"model": "abc", "kv_type": "q8_0"})
    assert "kv_type 'fp32' (this session: 'q8_0')" in message
    assert s.host.num_tokens == 20  # refused before anything was overwritten
    other = session_for(tiny, block_size=32)
    message = refused(saved_file, other, {"model": "abc", "kv_type": "fp32"})  # same fingerprint, other shapes
    assert "another shape" in message or "other tables" in message
    small = session_for(tiny, max_seq_len=48)
    assert "raise --max_seq_len to at least 60" in refused(saved_file, small)


def test_not_enough_disk_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    s = session_for(tiny)
    s.prefill(prompt(50))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 1000))
    with pytest.raises(CacheFileError, match="needs .* GiB but .* free"):
        save_cache(tmp_path / "c.kv", s, FP, TURNS)
    assert list(tmp_path.iterdir()) == []


def test_chat_saves_after_each_answer_and_a_new_chat_goes_on_from_the_file(tiny, tmp_path):
    """--save_kv writes after the answer; --load_kv (here ChatLoop.load) restores cache and
    conversation, and the next question prefills only its own tokens; /save PATH works too."""
    import io

    from ktlong.chat.loop import ChatLoop
    from ktlong.config import default_config

    config = default_config(max_new_tokens=5, kv_type="fp32", local_windows_len=24)
    path = tmp_path / "chat.kv"
    first = ChatLoop(tiny, config, 400, None, out=io.StringIO(), err=io.StringIO(), session=session_for(tiny),
                     save_kv=str(path))
    first.ask("tell me about the document")
    assert path.is_file() and "wrote the whole file" in first.err.getvalue()
    err = io.StringIO()
    second = ChatLoop(tiny, config, 400, None, out=io.StringIO(), err=err, session=session_for(tiny))
    second.load(str(path))
    assert second.conversation.turns == first.conversation.turns and second.session.ids == first.session.ids
    a, b = first.ask("and then?"), second.ask("and then?")
    assert a.token_ids == b.token_ids and "appended the new blocks" in first.err.getvalue()  # after its 2nd answer
    assert "from the cache" in err.getvalue() and second.session.last_stats.num_tokens < len(second.session.ids) // 2
    lines = iter([f"/save {tmp_path / 'again.kv'}", "/load", "/exit"])
    assert second.next_prompt(lambda: next(lines, None)) is None
    assert (tmp_path / "again.kv").is_file() and "/load needs a file path" in err.getvalue()


def same_cache(a, b):
    """Two sessions hold the same tokens, K/V, side tables and preselection masses."""
    n = a.host.num_tokens
    assert n == b.host.num_tokens and a.ids == b.ids
    blocks = -(-n // a.layout.block_size)
    for layer in range(a.layout.num_layers):
        for which in ("k", "v"):
            assert torch.equal(a.host.tokens(layer, which, 0, n), b.host.tokens(layer, which, 0, n))
        for table in ("key_mean", "key_max", "key_min", "anchor_keys"):
            assert torch.equal(getattr(a.host, table)[layer][:, :blocks], getattr(b.host, table)[layer][:, :blocks])
        np.testing.assert_array_equal(a.block_mass[layer], b.block_mass[layer])


def test_a_follow_ups_save_appends_only_what_changed_and_loads_as_a_whole_save(tiny, tmp_path):
    s = session_for(tiny)
    s.prefill(prompt(100))
    s.step(4)
    path, whole = tmp_path / "doc.kv", tmp_path / "whole.kv"
    first_size = save_cache(path, s, FP, TURNS)
    first = path.read_bytes()
    sizes = []
    for turn in range(3):  # question, answer tokens, save: each save appends
        s.prefill(s.ids + prompt(30, seed=turn + 1))
        for t in (5, 6):
            s.step(t)
        sizes.append(save_cache(path, s, FP, TURNS * (turn + 2)))
    data = path.read_bytes()
    assert data[:first_size] == first and len(data) == first_size + sum(sizes)
    assert all(size < first_size / 2 for size in sizes)  # the new blocks only, not the document
    save_cache(whole, s, FP, TURNS * 4)  # another file: written whole
    loaded, reference = session_for(tiny), session_for(tiny)
    assert load_cache(path, loaded, FP) == [tuple(t) for t in TURNS * 4]
    load_cache(whole, reference, FP)
    same_cache(loaded, s)
    same_cache(loaded, reference)
    follow = s.ids + prompt(20, seed=9)
    assert torch.equal(s.prefill(follow), loaded.prefill(follow)) and torch.equal(s.step(7), loaded.step(7))
    size = save_cache(path, loaded, FP, TURNS)  # a loaded session appends to the file it loaded
    assert len(path.read_bytes()) == len(data) + size and size < first_size / 2


def test_an_edited_conversation_appends_from_where_it_was_cut(tiny, tmp_path):
    s = session_for(tiny)
    s.prefill(prompt(120))
    path = tmp_path / "doc.kv"
    first_size = save_cache(path, s, FP, TURNS)
    s.prefill(s.ids[:50] + prompt(40, seed=4))  # the conversation edited at token 50
    size = save_cache(path, s, FP, TURNS)
    assert len(path.read_bytes()) == first_size + size
    loaded = session_for(tiny)
    load_cache(path, loaded, FP)
    same_cache(loaded, s)


def saved_then_appended(tiny, path, turns):
    """A 100-token cache saved whole to path, then a 30-token follow-up's save appended:
    (the whole record's bytes, the file's bytes)."""
    s = session_for(tiny)
    s.prefill(prompt(100))
    first_size = save_cache(path, s, FP, TURNS)
    s.prefill(s.ids + prompt(30, seed=2))
    save_cache(path, s, FP, turns)
    data = path.read_bytes()
    return data[:first_size], data


def test_an_append_cut_short_reads_as_the_save_before_and_the_next_save_is_whole(tiny, tmp_path):
    path = tmp_path / "doc.kv"
    whole, data = saved_then_appended(tiny, path, TURNS * 2)
    first_size = len(whole)
    (tmp_path / "whole.kv").write_bytes(whole)
    before = session_for(tiny)
    load_cache(tmp_path / "whole.kv", before, FP)
    for cut in (first_size + 10, first_size + 200, len(data) - 1):  # in the preamble, header, data
        path.write_bytes(data[:cut])
        loaded = session_for(tiny)
        assert load_cache(path, loaded, FP) == [tuple(t) for t in TURNS]
        same_cache(loaded, before)
    loaded.prefill(loaded.ids + prompt(10, seed=3))
    size = save_cache(path, loaded, FP, TURNS)  # the file is not what the load left: written whole
    assert len(path.read_bytes()) == size
    again = session_for(tiny)
    load_cache(path, again, FP)
    same_cache(again, loaded)


def test_a_damaged_appended_record_reads_as_the_save_before_it(tiny, tmp_path):
    """A bit flipped in the last appended record (not cut short: damaged) loses that save only:
    the file loads as the whole save before it, as a copy of that save alone does."""
    path = tmp_path / "doc.kv"
    whole, data = saved_then_appended(tiny, path, TURNS * 2)
    first_size = len(whole)
    (tmp_path / "whole.kv").write_bytes(whole)
    expected = session_for(tiny)
    assert load_cache(tmp_path / "whole.kv", expected, FP) == TURNS
    import mmap

    from ktlong.session.cache_records import APPENDED, read_record

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        record = read_record(path, m, first_size, APPENDED)
    k_block = next(e for e in record.header["tensors"] if e["name"] == "k.1.0")  # layer 1's new K blocks
    inside = record.data_start + k_block["offset"] + k_block["nbytes"] // 2
    for where in (first_size + 70, inside):  # its header, its data
        broken = bytearray(data)
        broken[where] ^= 0x01
        bad = tmp_path / "bad.kv"
        bad.write_bytes(bytes(broken))
        loaded = session_for(tiny)
        assert load_cache(bad, loaded, FP) == TURNS and loaded.host.num_tokens == 100
        same_cache(loaded, expected)


def test_a_file_replaced_since_this_sessions_save_is_written_whole(tiny, tmp_path):
    a, b = session_for(tiny), session_for(tiny)
    a.prefill(prompt(100))
    b.prefill(prompt(90, seed=5))
    path = tmp_path / "doc.kv"
    save_cache(path, a, FP, TURNS)
    whole_b = save_cache(path, b, FP, TURNS)  # b's file now, renamed over a's
    a.prefill(a.ids + prompt(20, seed=6))
    size = save_cache(path, a, FP, TURNS)
    assert len(path.read_bytes()) == size and size != whole_b  # not appended to b's file
    loaded = session_for(tiny)
    load_cache(path, loaded, FP)
    same_cache(loaded, a)


def test_a_save_never_replaces_a_read_only_file_and_writes_through_a_link(tiny, tmp_path):
    s = session_for(tiny)
    s.prefill(prompt(40))
    protected = tmp_path / "protected.kv"
    protected.write_bytes(b"the user's")
    protected.chmod(0o444)
    with pytest.raises(CacheFileError, match="read-only"):
        save_cache(protected, s, FP, TURNS)
    assert protected.read_bytes() == b"the user's"
    target = tmp_path / "real.kv"
    link = tmp_path / "link.kv"
    link.symlink_to(target)
    save_cache(link, s, FP, TURNS)
    assert link.is_symlink() and target.stat().st_size > 0
    loaded = session_for(tiny)
    turns = load_cache(link, loaded, FP)
    assert [tuple(t) for t in turns] == TURNS and loaded.ids == s.ids


def test_a_temporary_left_by_a_killed_save_is_removed_by_the_next_save(tiny, tmp_path):
    import subprocess

    s = session_for(tiny)
    s.prefill(prompt(40))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".c.kv.{gone.stdout.strip()}.abcd.tmp"  # its process has exited
    orphan.write_bytes(b"half a cache")
    alive = tmp_path / f".c.kv.{1}.efgh.tmp"  # pid 1 runs: a save in progress is left alone
    alive.write_bytes(b"being written")
    save_cache(tmp_path / "c.kv", s, FP, TURNS)
    assert not orphan.exists() and alive.exists()


def test_a_one_shot_chat_that_could_not_load_or_save_answers_nothing_and_says_so(tiny, tmp_path, piped_input):
    """Piped input with a --load_kv that fails: no answer without the document; a --save_kv that
    fails after the answer: reported, so that local_chat exits non-zero."""
    import io

    from ktlong.chat.loop import ChatLoop
    from ktlong.config import default_config

    config = default_config(max_new_tokens=3, kv_type="fp32", local_windows_len=24)
    piped_input([])
    out = io.StringIO()
    missing = str(tmp_path / "missing.kv")
    loop = ChatLoop(tiny, config, 400, None, out=out, err=io.StringIO(), session=session_for(tiny), load_kv=missing)
    assert loop.run(interactive=False) == [f"--load_kv {missing}"] and out.getvalue() == ""
    doc = tmp_path / "doc.txt"
    doc.write_text("what is in the document?")
    protected = tmp_path / "protected.kv"
    protected.write_bytes(b"keep")
    protected.chmod(0o444)
    loop = ChatLoop(tiny, config, 400, str(doc), out=io.StringIO(), err=io.StringIO(), session=session_for(tiny),
                    save_kv=str(protected))
    assert loop.run(interactive=False) == [f"--save_kv {protected}"] and protected.read_bytes() == b"keep"


def test_save_and_load_in_the_chat_refuse_a_path_no_file_system_takes_and_the_chat_goes_on(tiny, piped_input):
    """/save and /load of a name past 255 bytes, or under a ~user who is no user here: a notice
    each (they were tracebacks that ended the chat), the next message answered, and a piped run
    reports the four as not done."""
    import io

    from ktlong.chat.loop import ChatLoop
    from ktlong.config import default_config

    config = default_config(max_new_tokens=3, kv_type="fp32", local_windows_len=24)
    long_name, no_user = "n" * 300, "~ktlong-no-such-user/c.kv"
    piped_input([f"/save {long_name}", f"/load {long_name}", f"/save {no_user}", f"/load {no_user}", "hello"])
    err = io.StringIO()
    loop = ChatLoop(tiny, config, 400, None, out=io.StringIO(), err=err, session=session_for(tiny))
    assert loop.run(interactive=False) == ["4 messages or commands of the piped input"]
    notices = err.getvalue()
    assert notices.count("longer than a file system takes") == 2
    assert notices.count("begins with ~ktlong-no-such-user, but this machine has no user") == 2
    assert [user for user, _ in loop.conversation.turns] == ["hello"]


@pytest.mark.parametrize("change", [{"turns": [[1, 2]]}, {"turns": [["only the question"]]}, {"num_tokens": -5},
                                    {"token_ids": "abc"}, {"num_tokens": True}])
def test_a_hand_made_header_with_a_fresh_checksum_is_refused_in_one_sentence(tiny, tmp_path, monkeypatch, change):
    import ktlong.session.saved_cache as saved_cache

    real = saved_cache.encode_record

    def edited(magic, header, *args, **kwargs):  # the header as an editor would change it, checksummed anew
        return real(magic, {**header, **change}, *args, **kwargs)

    s = session_for(tiny)
    s.prefill(prompt(40))
    path = tmp_path / "edited.kv"
    monkeypatch.setattr(saved_cache, "encode_record", edited)
    save_cache(path, s, FP, TURNS)
    monkeypatch.undo()
    loaded = session_for(tiny)
    message = refused(path, loaded)
    assert "header this version does not write" in message and loaded.host.num_tokens == 0


def test_ctrl_c_during_the_save_after_an_answer_keeps_the_session_and_the_file(tiny, tmp_path, monkeypatch):
    import io

    import ktlong.session.saved_cache as saved_cache
    from ktlong.chat.loop import ChatLoop
    from ktlong.config import default_config

    config = default_config(max_new_tokens=3, kv_type="fp32", local_windows_len=24)
    path = tmp_path / "chat.kv"
    err = io.StringIO()
    loop = ChatLoop(tiny, config, 400, None, out=io.StringIO(), err=err, session=session_for(tiny), save_kv=str(path))
    loop.ask("tell me about the document")
    saved = path.read_bytes()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(saved_cache, "encode_record", interrupted)
    tokens = loop.session.host.num_tokens
    loop.ask("and then?")  # its save is interrupted; the chat goes on
    assert "not saved: interrupted" in err.getvalue() and path.read_bytes() == saved
    assert loop.session.host.num_tokens > tokens and loop.failed == [f"--save_kv {path}"]


def test_a_cache_saved_for_another_count_of_ranks_is_named_with_the_option_that_reads_it(tmp_path):
    """One process asked for a cache saved a part a rank (or ranks for one process's file) hears
    which --tensor_parallel reads it, not only that the file is missing."""
    import types

    from ktlong.session.saved_cache import rank_path, saved_as

    two = types.SimpleNamespace(rank=1, world=2)
    path = tmp_path / "book.kv"
    assert rank_path(path, None) == path and rank_path(path, two) == tmp_path / "book.kv.rank1-of-2"
    assert saved_as(path, None) == ""  # nothing there at all
    (tmp_path / "book.kv.rank0-of-2").write_bytes(b"x")
    (tmp_path / "book.kv.rank1-of-2").write_bytes(b"x")
    assert saved_as(path, None) == f"; {path} was saved in 2 parts, a rank each: load it with --tensor_parallel 2"
    assert saved_as(path, two) == ""  # its own part is there
    other = tmp_path / "solo.kv"
    other.write_bytes(b"x")
    assert saved_as(other, two) == f"; {other} was saved by one process: load it with --tensor_parallel 1"
    four = types.SimpleNamespace(rank=0, world=4)
    assert saved_as(path, four).endswith("load it with --tensor_parallel 2")
