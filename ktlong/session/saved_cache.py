"""A long-context session's KV cache saved to one file, and loaded back to go on talking.

The file: a fixed preamble (magic, format version, header length, sha256 of the header), a JSON
header (the fingerprint of everything the cache depends on, the token ids, the conversation, and
an index of the tensors with their offsets, shapes, types and CRC-32s per 64 MiB piece), then
the tensors, each 4096-aligned, as the host cache holds them: K/V in their DRAM type (q8_0 /
q4_0 values and scales included), the side tables and the preselection masses, only the blocks
that hold tokens. No pickle: the header is JSON and the rest raw bytes.

Writing goes to a temporary file in the same folder, flushed to disk, then renamed into place.
Reading maps the file and checks every offset and size against it. A cache that is not pinned
(the CPU's) then has the file's pages mapped into its tables in place, copy-on-write, rather than
copied (ktlong/kv/host_memory.py); a pinned one (a GPU copies from it) gets the pieces copied in
parallel threads. Either way every piece's CRC-32 is checked on the cache's own bytes; anything
wrong is refused in one sentence and the session is left empty, not half-loaded. Our own saves
replace the file by renaming, so a cache mapped from it keeps the old file; a file changed in
place by another program while a session maps it is not supported.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ktlong.errors import KtlongError
from ktlong.kv.host_memory import map_file_pages

MAGIC = b"KTLONGKV"
VERSION = 1
PREAMBLE = struct.Struct("<8sIQ32s")  # magic, version, header bytes, sha256 of the header
ALIGN = 4096
PIECE = 64 << 20  # bytes per CRC-32 and per copy task
THREADS = 8


class CacheFileError(KtlongError):
    """A saved cache that cannot be written or used as it is."""


def model_identity(path: Path) -> str:
    """sha256 of a GGUF's size, its first 8 MiB (metadata, tokenizer, tensor index) and last 1 MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(8 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()


def fingerprint(model_path: Path, session, config) -> dict:
    """What the cached values depend on: the model file, its shapes and RoPE, how DRAM stores
    K/V, and the prefill options that change them."""
    c, layout = session.model.config, session.layout
    compact = session.engine.compact if session.engine.is_sparse else None
    return {
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


def _tensors(session, num_tokens: int, masses: dict[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Every host tensor the cache needs, per kv head (so each is one contiguous range), cut to
    the blocks that hold tokens: views. masses: {layer: blocks} of the preselection masses to
    make room for (when loading), else the host's own."""
    host, layout = session.host, session.layout
    blocks = -(-num_tokens // layout.block_size)
    if masses is not None:
        host.prompt_block_mass = {layer: np.zeros((layout.num_kv_heads, n), np.float32) for layer, n in masses.items()}
    out = {}
    for layer in range(layout.num_layers):
        for name in TABLES:
            t = getattr(host, name)[layer]
            if t.shape[1] and t.shape[-1]:
                for h in range(layout.num_kv_heads):
                    out[f"{name}.{layer}.{h}"] = t[h, :blocks]
        if layer in host.prompt_block_mass:
            mass = torch.from_numpy(host.prompt_block_mass[layer])
            for h in range(layout.num_kv_heads):
                out[f"prompt_block_mass.{layer}.{h}"] = mass[h]
    return out


def _pieces(nbytes: int):
    return [(s, min(nbytes, s + PIECE)) for s in range(0, nbytes, PIECE)] or [(0, 0)]


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


def save_cache(path: str | os.PathLike, session, fp: dict, turns: list) -> int:
    """Write the session's cache to path atomically; returns the bytes written."""
    path = Path(path).expanduser()
    num_tokens = session.host.num_tokens
    if not num_tokens:
        raise CacheFileError("There is no cache to save yet; send a prompt first.")
    tensors = _tensors(session, num_tokens)
    index, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        index.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    header = {"fingerprint": fp, "num_tokens": num_tokens, "token_ids": session.ids[:num_tokens],
              "turns": [list(t) for t in turns], "tensors": index}
    with ThreadPoolExecutor(THREADS) as pool:  # CRC-32 of each piece (zlib lets go of the GIL)
        for entry, t in zip(index, tensors.values()):
            raw = _as_bytes(t)
            entry["crc32"] = list(pool.map(lambda p: zlib.crc32(raw[p[0]:p[1]]), _pieces(len(raw))))
    blob = json.dumps(header, separators=(",", ":")).encode()
    data_start = -(-(PREAMBLE.size + len(blob)) // ALIGN) * ALIGN
    total = data_start + offset
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise CacheFileError(f"Cannot save the cache to {path}: folder {folder} does not exist.")
    free = shutil.disk_usage(folder).free
    if free < total:
        raise CacheFileError(f"Saving the cache needs {total / 2**30:.2f} GiB but {folder} has "
                             f"{free / 2**30:.2f} GiB free; free some space or save elsewhere.")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(PREAMBLE.pack(MAGIC, VERSION, len(blob), hashlib.sha256(blob).digest()))
            f.write(blob)
            for entry, t in zip(index, tensors.values()):
                f.seek(data_start + entry["offset"])
                f.write(memoryview(_as_bytes(t)))
            f.truncate(total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return total


def _read_header(path: Path, mapped: mmap.mmap) -> tuple[dict, int]:
    if len(mapped) < PREAMBLE.size:
        raise CacheFileError(f"{path} is not a saved ktlong cache (too short); check --load_kv.")
    magic, version, header_len, digest = PREAMBLE.unpack_from(mapped, 0)
    if magic != MAGIC:
        raise CacheFileError(f"{path} is not a saved ktlong cache; check --load_kv.")
    if version != VERSION:
        raise CacheFileError(f"{path} is a saved cache of format {version}, this ktlong reads {VERSION}; "
                             "save it again with this version.")
    end = PREAMBLE.size + header_len
    if end > len(mapped):
        raise CacheFileError(f"{path} is truncated (its header ends past the file); save it again.")
    blob = mapped[PREAMBLE.size:end]
    if hashlib.sha256(blob).digest() != digest:
        raise CacheFileError(f"{path} is corrupted (its header does not match its checksum); save it again.")
    return json.loads(blob), -(-end // ALIGN) * ALIGN


def _differences(saved: dict, ours: dict) -> str:
    keys = sorted(set(saved) | set(ours))
    diffs = [f"{k} {saved.get(k)!r} (this session: {ours.get(k)!r})" for k in keys if saved.get(k) != ours.get(k)]
    return "; ".join(diffs)


def load_cache(path: str | os.PathLike, session, fp: dict) -> list:
    """Fill the session's cache from path; returns the saved conversation turns. A file refused
    before its data is read (missing, foreign, made for other settings, truncated) leaves the
    session as it was; bad data found while copying leaves it empty. Either way a CacheFileError
    says what is wrong."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CacheFileError(f"Saved cache {path} does not exist; check --load_kv.")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise CacheFileError(f"{path} is empty, not a saved ktlong cache; check --load_kv.")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return _load(path, f.fileno(), mapped, session, fp)


def _load(path: Path, fd: int, mapped: mmap.mmap, session, fp: dict) -> list:
    source, overwritten = None, False
    try:
        header, data_start = _read_header(path, mapped)
        diffs = _differences(header["fingerprint"], fp)
        if diffs:
            raise CacheFileError(f"{path} was saved for other settings: {diffs}; load it with the "
                                 "model and options it was made with.")
        num_tokens = header["num_tokens"]
        if not 0 < num_tokens <= session.layout.capacity or len(header["token_ids"]) != num_tokens:
            raise CacheFileError(f"{path} holds {num_tokens:,} tokens and this session's max_seq_len is "
                                 f"{session.layout.capacity:,}; raise --max_seq_len to at least {num_tokens:,}.")
        entries = {e["name"]: e for e in header["tensors"]}
        masses = {int(n.split(".")[1]): entries[n]["shape"][0] for n in entries
                  if n.startswith("prompt_block_mass.") and n.endswith(".0")}
        if any(not 0 < n <= session.layout.num_blocks for n in masses.values()):
            raise CacheFileError(f"{path} holds preselection tables larger than this session's cache; save it again.")
        session.reset()  # what was checked holds: from here the session's cache is overwritten
        overwritten = True
        expected = _tensors(session, num_tokens, masses)
        if set(entries) != set(expected):
            raise CacheFileError(f"{path} holds other tables than this session keeps; save it again.")
        tasks = []
        for name, dst in expected.items():
            e = entries[name]
            nbytes = dst.numel() * dst.element_size()
            if (e["shape"] != list(dst.shape) or e["dtype"] != str(dst.dtype).removeprefix("torch.")
                    or e["nbytes"] != nbytes or len(e["crc32"]) != len(_pieces(nbytes))):
                raise CacheFileError(f"{path}: table {name} has another shape or type than this session's; "
                                     "save it again.")
            start = data_start + e["offset"]
            if e["offset"] < 0 or start + nbytes > len(mapped):
                raise CacheFileError(f"{path} is truncated: {name} ends past the file; save it again.")
            for (lo, hi), crc in zip(_pieces(nbytes), e["crc32"]):
                tasks.append((name, dst, start, lo, hi, crc))
        source = np.frombuffer(mapped, np.uint8)
        # the host tables, when not pinned, take the file's pages in place (the preselection masses
        # are numpy arrays of the general allocator: copied)
        maps = {name: session.host.maps_files and name.split(".")[0] in TABLES for name in expected}

        def copy(task):  # what is not mapped is copied; either way the checksum is of the cache's bytes
            name, dst, start, lo, hi, crc = task
            out = _as_flat_bytes(dst)[lo:hi]
            mapped_bytes = map_file_pages(out, fd, start + lo, hi - lo) if maps[name] else 0
            if mapped_bytes < hi - lo:
                out.numpy()[mapped_bytes:] = source[start + lo + mapped_bytes:start + hi]
            return name if zlib.crc32(out.numpy()) != crc else None

        with ThreadPoolExecutor(THREADS) as pool:
            bad = [name for name in pool.map(copy, tasks) if name]
        if bad:
            raise CacheFileError(f"{path} is corrupted (table {bad[0]} does not match its checksum); save it again.")
    except CacheFileError:
        if overwritten:
            session.reset()
        raise
    except (ValueError, KeyError, TypeError, IndexError) as e:
        if overwritten:
            session.reset()
        raise CacheFileError(f"{path} has a malformed header ({type(e).__name__}: {e}); save it again.") from None
    finally:
        source = None
        try:
            mapped.close()
        except BufferError:  # a view of it is still referenced by an exception's frame: the GC closes it
            pass
    session.host.advance(num_tokens)
    session.ids = list(header["token_ids"])
    return [tuple(t) for t in header["turns"]]


def _as_flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).view(-1)
