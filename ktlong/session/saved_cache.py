"""A long-context session's KV cache saved to one file (one a rank under tensor parallelism),
and loaded back to go on talking.

The file (records: ktlong/session/cache_records.py) holds the K/V in their DRAM type (q8_0 / q4_0
values and scales included), the side tables and the preselection masses, only the blocks that
hold tokens, per kv head, plus the token ids, the conversation and a fingerprint of everything
the values depend on.

Saving writes the whole cache as one record to a temporary file in the same folder, flushed,
renamed into place, the folder flushed. A later save by the same session, while the file is
still the one it wrote, appends a record with only what changed since: the blocks from the one
the last save ended in (or the one an edited conversation was cut at), the preselection masses,
the token ids and the conversation; flushed before it returns. A follow-up's save so costs its
own tokens, not the document's. Readers take the whole record and every complete record after
it, in order, so an append cut short (a crash) reads as the save before it. After
MAX_APPENDED records, or once they add up to the whole record's size, a save writes the whole
again.

Loading checks the fingerprint, then every offset, size and checksum; anything wrong is refused
in one sentence. A file refused before its data is read leaves the session as it was; bad data
found while filling the cache leaves it empty, never half-loaded.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ktlong.regular_file import NotRegularFile, open_regular, user_path, write_replacing
from ktlong.session.cache_records import (APPENDED, COPIED_ALIGN, WHOLE, CacheFileError, OtherSettings, Record,
                                          check_tables, encode_record, fill_tables, read_record, write_record)

MAX_APPENDED = 64


def model_identity(path: Path) -> str:
    """sha256 of a GGUF's size, its first 8 MiB (metadata, tokenizer, tensor index) and last 1 MiB;
    read once per file version (every save and load of a chat asks again)."""
    st = path.stat()
    return _identity(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _identity(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(8 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()


def rank_path(path: str | os.PathLike, tp) -> Path:
    """The file of this process's part of a saved cache: path itself, or under tensor parallelism
    (tp) each rank's own beside it, PATH.rank0-of-2 and so on: a rank holds only its kv heads."""
    path = user_path(path)
    return path if tp is None else path.with_name(f"{path.name}.rank{tp.rank}-of-{tp.world}")


def saved_as(path: str | os.PathLike, tp) -> str:
    """Where a cache this process cannot find at rank_path(path, tp) was saved instead, as the
    option that reads it ("" when there is no such file): one process's file, or a part a rank
    for another count of ranks."""
    path = user_path(path)
    if rank_path(path, tp).exists():
        return ""
    if tp is not None and path.is_file():
        return f"; {path} was saved by one process: load it with --tensor_parallel 1"
    for part in sorted(path.parent.glob(glob.escape(path.name) + ".rank0-of-*")):
        world = part.name.rsplit("-of-", 1)[1]
        if world.isdigit() and (tp is None or int(world) != tp.world):
            return f"; {path} was saved in {world} parts, a rank each: load it with --tensor_parallel {world}"
    return ""


def fingerprint(model_path: Path, session, config) -> dict:
    """What the cached values depend on: the model file, its shapes and RoPE, how DRAM stores
    K/V, the prefill options that change them, and under tensor parallelism the rank's part."""
    c, layout = session.model.config, session.layout
    compact = session.engine.compact if session.engine.is_sparse else None
    tp = session.model.tp
    return {**({"ranks": [tp.rank, tp.world]} if tp is not None else {}),
        "model": model_identity(model_path), "model_file": model_path.name,
        "shapes": [c.num_layers, c.num_kv_heads, c.head_dim],
        "rope": [c.rope.scaling_type, c.rope.factor, c.rope.original_context_length, c.rope.base],
        "compute_dtype": str(session.model.dtype).removeprefix("torch."),
        "block_size": layout.block_size, "kv_type": layout.kv_type, "page_type": layout.page_type,
        "anchors": [layout.anchor_type, layout.anchor_num], "chunk_size": session.engine.chunk_size,
        "prefill_attention": "dense" if compact is None else repr(compact.params),
        "use_chat_template": config.use_chat_template, "system_prompt": config.system_prompt,
    }


TABLES = ("k", "v", "k_scales", "v_scales", "key_mean", "key_max", "key_min", "anchor_keys")


@dataclass
class SavedFile:
    """The file a session last saved to or loaded from, as it left it: what an append needs."""
    path: Path
    inode: int
    num_tokens: int
    whole_digest: str  # sha256 of the whole record's header, which appended records name
    whole_size: int
    appended: int = 0
    appended_size: int = 0

    @property
    def size(self) -> int:
        return self.whole_size + self.appended_size


def _tensors(session, first_block: int, num_tokens: int, masses: dict[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The host tensors of blocks first_block.. of the first num_tokens tokens, per kv head (so
    each is one contiguous range), and the preselection masses: views. masses: {layer: blocks}
    of the masses to make room for (when loading), else the host's own."""
    host, layout = session.host, session.layout
    blocks = -(-num_tokens // layout.block_size)
    if masses is not None:
        session.block_mass = {layer: np.zeros((layout.num_kv_heads, n), np.float32) for layer, n in masses.items()}
    out = {}
    for layer in range(layout.num_layers):
        for name in TABLES:
            t = getattr(host, name)[layer]
            if t.shape[1] and t.shape[-1]:
                for h in range(layout.num_kv_heads):
                    out[f"{name}.{layer}.{h}"] = t[h, first_block:blocks]
        if layer in session.block_mass:
            mass = torch.from_numpy(session.block_mass[layer])
            for h in range(layout.num_kv_heads):
                out[f"prompt_block_mass.{layer}.{h}"] = mass[h]
    return out


def _masses(record: Record) -> dict[int, int]:
    return {int(e["name"].split(".")[1]): e["shape"][0] for e in record.header["tensors"]
            if e["name"].startswith("prompt_block_mass.") and e["name"].endswith(".0")}


def _append_from(state: SavedFile | None, path: Path, session) -> int | None:
    """The block an appended record would start at, or None when the whole must be written: no
    earlier save of this session to this very file as it left it, a model with sliding-window
    layers (their DRAM tail moves), or enough appended already."""
    if state is None or state.path != path.resolve() or session.layout.sliding or state.appended >= MAX_APPENDED:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    if (st.st_ino, st.st_size) != (state.inode, state.size) or state.appended_size >= state.whole_size:
        return None
    first = min(state.num_tokens, session.stable_tokens) // session.layout.block_size
    return first or None  # from block 0 an append is the whole again


def save_cache(path: str | os.PathLike, session, fp: dict, turns: list, make_room=None) -> int:
    """Write the session's cache to path (appending to the file this session saved last when it
    can); returns the bytes written. session: a LongContextSession or what it detached (a
    HeldConversation). make_room(size): called with the bytes about to be written, before
    anything is, and whether they replace the file whole; it raises CacheFileError when they may
    not be written (a disk budget)."""
    path = check_save_path(path)
    num_tokens = session.host.num_tokens
    if not num_tokens:
        raise CacheFileError("There is no cache to save yet; send a prompt first.")
    header = {"num_tokens": num_tokens, "token_ids": session.ids[:num_tokens], "turns": [list(t) for t in turns]}
    folder = path.parent
    state = getattr(session, "saved_file", None)
    first_block = _append_from(state, path, session)
    if first_block is not None:
        header.update(whole=state.whole_digest, sequence=state.appended + 1, first_block=first_block)
        head, placed, size, _ = encode_record(APPENDED, header, _tensors(session, first_block, num_tokens), COPIED_ALIGN)
        _check_space(folder, size, make_room, False)
        with open(path, "r+b") as f:
            try:
                write_record(f, state.size, head, placed, size)
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                f.truncate(state.size)  # best effort: readers would skip a cut record anyway
                raise
        state.num_tokens, state.appended, state.appended_size = num_tokens, state.appended + 1, state.appended_size + size
        session.stable_tokens = num_tokens
        return size
    header["fingerprint"] = fp
    head, placed, size, digest = encode_record(WHOLE, header, _tensors(session, 0, num_tokens))
    _check_space(folder, size, make_room, True)
    remove_orphans(path)
    write_replacing(path, lambda f: write_record(f, 0, head, placed, size), durable=True)
    session.saved_file = SavedFile(path.resolve(), path.stat().st_ino, num_tokens, digest, size)
    session.stable_tokens = num_tokens
    return size


def check_save_path(path: str | os.PathLike) -> Path:
    """The file a save of `path` writes: what a symbolic link names (the link stays a link).
    Refused in one sentence, before anything is written: a missing folder, a folder, a file
    whose owner made it read-only (a save never replaces it), a folder that cannot be written."""
    given = user_path(path)
    target = given.resolve() if given.is_symlink() else given
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise CacheFileError(f"Cannot save the cache to {given}: folder {folder} does not exist.")
    if target.is_dir():
        raise CacheFileError(f"Cannot save the cache to {given}: it is a folder; name a file.")
    if target.exists() and not target.stat().st_mode & 0o222:
        raise CacheFileError(f"Cannot save the cache to {given}: the file is read-only; make it writable "
                             "or save elsewhere.")
    if not os.access(folder, os.W_OK):
        raise CacheFileError(f"Cannot save the cache to {given}: folder {folder} is not writable; save elsewhere.")
    return target


def remove_orphans(path: Path):
    """Temporary files of whole saves to `path` whose process is gone (killed mid-save): each
    is named .NAME.PID.XXXX.tmp by the process writing it."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            tmp.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_space(folder: Path, size: int, make_room=None, whole: bool = True):
    if make_room is not None:
        make_room(size, whole)
    free = shutil.disk_usage(folder).free
    if free < size:
        raise CacheFileError(f"Saving the cache needs {size / 2**30:.2f} GiB but {folder} has "
                             f"{free / 2**30:.2f} GiB free; free some space or save elsewhere.")


def _differences(saved: dict, ours: dict) -> str:
    keys = sorted(set(saved) | set(ours))
    diffs = [f"{k} {saved.get(k)!r} (this session: {ours.get(k)!r})" for k in keys if saved.get(k) != ours.get(k)]
    return "; ".join(diffs)


def load_cache(path: str | os.PathLike, session, fp: dict) -> list:
    """Fill the session's cache from path; returns the saved conversation turns. A file refused
    before its data is read (missing, foreign, made for other settings, truncated) leaves the
    session as it was; bad data found while filling leaves it empty. Either way a CacheFileError
    says what is wrong."""
    path = user_path(path)
    with open_saved(path) as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _load(path, f.fileno(), mapped, session, fp)
        finally:
            try:
                mapped.close()
            except BufferError:  # a view of it is still referenced by an exception's frame: the GC closes it
                pass


def open_saved(path: Path):
    """path opened for reading when it is a non-empty regular file; CacheFileError otherwise,
    without blocking on a pipe or reading a device."""
    try:
        f, size = open_regular(path)
    except NotRegularFile as e:
        raise CacheFileError(f"Saved cache {path} {e}; check the path.") from None
    if size == 0:
        f.close()
        raise CacheFileError(f"Saved cache {path} is empty, not a saved ktlong cache; check the path.")
    return f


def _records(path: Path, mapped: mmap.mmap, fp: dict, capacity: int) -> list[Record]:
    """The whole record and the complete appended ones after it, checked against this session."""
    whole = read_record(path, mapped, 0, WHOLE)
    if whole is None:
        raise CacheFileError(f"{path} is not a saved ktlong cache; check the path.")
    saved = whole.header.get("fingerprint", {})
    if not isinstance(saved, dict):
        raise CacheFileError(f"{path} has a malformed header (its fingerprint is not an object); save it again.")
    diffs = _differences(saved, fp)
    if diffs:
        raise OtherSettings(f"{path} was saved for other settings: {diffs[:500]}; load it with the "
                            "model and options it was made with.")
    records = [whole]
    while True:
        try:
            record = read_record(path, mapped, records[-1].end, APPENDED)
        except CacheFileError:  # cut short by a crash while appending, or damaged: the saves before it hold
            break
        if record is None or record.header.get("whole") != whole.digest or \
                record.header.get("sequence") != len(records):
            break
        records.append(record)
    for r in records:
        n, ids, turns = r.header.get("num_tokens"), r.header.get("token_ids"), r.header.get("turns")
        if (not isinstance(n, int) or isinstance(n, bool) or n <= 0 or not isinstance(ids, list) or len(ids) != n
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
                or not isinstance(turns, list)
                or not all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in turns)):
            raise CacheFileError(f"{path} has a header this version does not write (its token count, token ids "
                                 "or conversation); save the cache again.")
        if n > capacity:
            raise OtherSettings(f"{path} holds {n:,} tokens and this session's max_seq_len is {capacity:,}; "
                                 f"raise --max_seq_len to at least {n}.")
    return records


def saved_token_ids(path: str | os.PathLike, fp: dict, capacity: int) -> list[int]:
    """The token ids a saved cache holds, its header checked as load_cache checks it (the
    fingerprint, every record's header) without reading the tables; CacheFileError otherwise."""
    path = Path(path)
    with open_saved(path) as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return list(_records(path, mapped, fp, capacity)[-1].header["token_ids"])


class DamagedAppend(Exception):
    """An appended record whose data does not match its checksums."""

    def __init__(self, index: int):
        self.index = index


def _fill(path: Path, fd: int, mapped: mmap.mmap, session, records: list[Record]):
    """The session's cache emptied and filled from the records, in order. Raises DamagedAppend
    for an appended record whose tables fail their checks (CacheFileError for the whole one)."""
    layout = session.layout
    session.reset()
    done_tokens = 0
    for i, r in enumerate(records):
        first = r.header["first_block"] if i else 0
        if not isinstance(first, int) or not 0 <= first <= -(-done_tokens // layout.block_size):
            raise CacheFileError(f"{path} has an appended record that leaves a gap; save it again.")
        expected = _tensors(session, first, r.header["num_tokens"], _masses(r))
        check_tables(path, r, expected)
        session.host.reserve(r.header["num_tokens"])  # memory for them before they are written
        # the whole record's host tables take the file's pages in place when not pinned
        mappable = {n for n in expected if n.split(".")[0] in TABLES} if session.host.maps_files and not i else set()
        try:
            fill_tables(path, fd, mapped, r, expected, mappable)
        except CacheFileError:
            if not i:
                raise
            raise DamagedAppend(i) from None
        done_tokens = r.header["num_tokens"]


def _load(path: Path, fd: int, mapped: mmap.mmap, session, fp: dict) -> list:
    layout, overwritten = session.layout, False
    try:
        records = _records(path, mapped, fp, session.max_seq_len)
        for r in records:
            if any(not 0 < n <= layout.num_blocks for n in _masses(r).values()):
                raise CacheFileError(f"{path} holds preselection tables larger than this session's cache; "
                                     "save it again.")
        overwritten = True
        try:
            _fill(path, fd, mapped, session, records)
        except DamagedAppend as e:  # the saves before the damaged record hold: load those
            records = records[:e.index]
            _fill(path, fd, mapped, session, records)
    except CacheFileError:
        if overwritten:
            session.reset()
        raise
    except (ValueError, KeyError, TypeError, IndexError) as e:
        if overwritten:
            session.reset()
        raise CacheFileError(f"{path} has a malformed header ({type(e).__name__}: {e}); save it again.") from None
    last = records[-1].header
    session.host.advance(last["num_tokens"])
    session.stable_tokens = last["num_tokens"]
    session.ids = list(last["token_ids"])
    st = os.fstat(fd)
    session.saved_file = SavedFile(path.resolve(), st.st_ino, last["num_tokens"], records[0].digest, records[0].end,
                                   len(records) - 1, records[-1].end - records[0].end)
    return [tuple(t) for t in last["turns"]]
