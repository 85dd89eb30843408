"""The records a saved KV cache file is made of (ktlong/session/saved_cache.py says what goes in
them).

A record: a fixed preamble (magic, format version, header length, sha256 of the header), a JSON
header that indexes its tensors (name, type, shape, offset, bytes, a CRC-32 per 64 MiB piece),
then the tensors' raw bytes, each aligned (4096 bytes in a whole record, whose pages may be
mapped into the cache; 64 in appended ones, which are copied). A file is one whole record,
possibly followed by appended ones. No pickle: headers are JSON, the rest raw.

Reading checks every offset and size against the file before use, and every piece's CRC-32 on
the bytes that land in the cache. Tables that are not pinned take the file's pages in place
(copy-on-write, ktlong/kv/host_memory.py); the others, and anything not page-aligned, are
copied, in parallel threads (zlib and the copies let go of the GIL).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ktlong.errors import KtlongError
from ktlong.kv.host_memory import map_file_pages

WHOLE, APPENDED = b"KTLONGKV", b"KTLAPPND"  # a file's first record; records added after it
VERSION = 2  # 1: one whole record, no appended ones
PREAMBLE = struct.Struct("<8sIQ32s")  # magic, version, header bytes, sha256 of the header
ALIGN = 4096  # a whole record's tables: the file's pages may be mapped into the cache
COPIED_ALIGN = 64  # an appended record's tables, a few blocks each, only ever copied
PIECE = 64 << 20  # bytes per CRC-32 and per copy task
THREADS = 8


class CacheFileError(KtlongError):
    """A saved cache that cannot be written or used as it is."""


class OtherSettings(CacheFileError):
    """A sound saved cache made by another version, model or setting: kept, not used."""


class TruncatedRecord(CacheFileError):
    """A record that runs past the end of the file: the last one, cut short while it was written."""


def aligned(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def pieces(nbytes: int) -> list[tuple[int, int]]:
    return [(s, min(nbytes, s + PIECE)) for s in range(0, nbytes, PIECE)] or [(0, 0)]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).view(-1)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return _flat_bytes(t.contiguous()).numpy()


def encode_record(magic: bytes, header: dict, tensors: dict[str, torch.Tensor],
                  align: int = ALIGN) -> tuple[bytes, list, int, str]:
    """(preamble + header bytes, [(file offset from the record's start, tensor)], record bytes,
    sha256 of the header in hex): the header gains the tensors' index, with their CRC-32s, and
    their alignment (4096 where the file's pages may be mapped into the cache; less for records
    that are only ever copied, whose tables are a few blocks each)."""
    index, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        index.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "offset": offset, "nbytes": nbytes})
        offset += aligned(nbytes, align)
    with ThreadPoolExecutor(THREADS) as pool:
        for entry, t in zip(index, tensors.values()):
            raw = _as_bytes(t)
            entry["crc32"] = list(pool.map(lambda p: zlib.crc32(raw[p[0]:p[1]]), pieces(len(raw))))
    blob = json.dumps({**header, "align": align, "tensors": index}, separators=(",", ":")).encode()
    digest = hashlib.sha256(blob)
    head = PREAMBLE.pack(magic, VERSION, len(blob), digest.digest()) + blob
    data_start = aligned(len(head), align)
    placed = [(data_start + e["offset"], t) for e, t in zip(index, tensors.values())]
    return head, placed, data_start + offset, digest.hexdigest()


def write_record(f, start: int, head: bytes, placed: list, size: int):
    """Write an encoded record at byte `start` of the open file f (start 4096-aligned)."""
    f.seek(start)
    f.write(head)
    for offset, t in placed:
        f.seek(start + offset)
        f.write(memoryview(_as_bytes(t)))
    f.truncate(start + size)


@dataclass
class Record:
    header: dict
    data_start: int  # file offset of the record's data
    end: int  # file offset just past it (4096-aligned): where the next record may start
    digest: str  # sha256 of its header, hex


def read_record(path: Path, mapped: mmap.mmap, start: int, magic: bytes) -> Record | None:
    """The record at byte `start`, or None when there is none there (end of file, or another
    magic). Raises TruncatedRecord for one whose header or data runs past the end of the file,
    CacheFileError for one that is there but broken."""
    if start + PREAMBLE.size > len(mapped):
        return None
    found, version, header_len, digest = PREAMBLE.unpack_from(mapped, start)
    if found != magic:
        return None
    if not 1 <= version <= VERSION:
        raise OtherSettings(f"{path} is a saved cache of format {version}, this ktlong reads up to {VERSION}; "
                             "save it again with this version.")
    end = start + PREAMBLE.size + header_len
    if end > len(mapped):
        raise TruncatedRecord(f"{path} is truncated (a header ends past the file); save it again.")
    blob = mapped[start + PREAMBLE.size:end]
    if hashlib.sha256(blob).digest() != digest:
        raise CacheFileError(f"{path} is corrupted (a header does not match its checksum); save it again.")
    try:
        header = json.loads(blob)
        if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
            raise TypeError("not an object with a list of tables")
        align = header.get("align", ALIGN)
        if align not in (COPIED_ALIGN, ALIGN) or start % align:
            raise ValueError(f"alignment {align}")
        for e in header["tensors"]:
            _check_entry(e)
        data_start = aligned(end, align)
        size = max((e["offset"] + aligned(e["nbytes"], align) for e in header["tensors"]), default=0)
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CacheFileError(f"{path} has a malformed header ({type(e).__name__}: {str(e)[:100]}); "
                             "save it again.") from None
    if data_start + size > len(mapped):
        raise TruncatedRecord(f"{path} is truncated (a table ends past the file); save it again.")
    return Record(header, data_start, aligned(data_start + size, align), digest.hex())


def _natural(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entry(e):
    """A table's index entry as encode_record writes it, or TypeError."""
    if not (isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("dtype"), str)
            and _natural(e.get("offset")) and _natural(e.get("nbytes"))
            and isinstance(e.get("shape"), list) and all(map(_natural, e["shape"]))
            and isinstance(e.get("crc32"), list) and all(map(_natural, e["crc32"]))):
        raise TypeError("a table's entry is not as written")


def check_tables(path: Path, record: Record, expected: dict[str, torch.Tensor]):
    """Refuse a record whose tables are not exactly `expected` (names, shapes, types, sizes)."""
    entries = {e["name"]: e for e in record.header["tensors"]}
    if set(entries) != set(expected):
        raise CacheFileError(f"{path} holds other tables than this session keeps; save it again.")
    for name, dst in expected.items():
        e = entries[name]
        nbytes = dst.numel() * dst.element_size()
        if (e["shape"] != list(dst.shape) or e["dtype"] != str(dst.dtype).removeprefix("torch.")
                or e["nbytes"] != nbytes or len(e["crc32"]) != len(pieces(nbytes)) or e["offset"] < 0):
            raise CacheFileError(f"{path}: table {name} has another shape or type than this session's; "
                                 "save it again.")


def fill_tables(path: Path, fd: int, mapped: mmap.mmap, record: Record, expected: dict[str, torch.Tensor],
                mappable: set[str]):
    """Put a checked record's tables into `expected` (views of the cache): the pages of those in
    `mappable` mapped from the file where aligned, the rest copied; every piece's CRC-32 checked
    on the cache's bytes. Raises CacheFileError naming a table that does not match."""
    entries = {e["name"]: e for e in record.header["tensors"]}
    source = np.frombuffer(mapped, np.uint8)
    tasks = []
    for name, dst in expected.items():
        e = entries[name]
        start = record.data_start + e["offset"]
        for (lo, hi), crc in zip(pieces(e["nbytes"]), e["crc32"]):
            tasks.append((name, dst, start, lo, hi, crc))

    def fill(task):
        name, dst, start, lo, hi, crc = task
        out = _flat_bytes(dst)[lo:hi]
        mapped_bytes = map_file_pages(out, fd, start + lo, hi - lo) if name in mappable else 0
        if mapped_bytes < hi - lo:
            out.numpy()[mapped_bytes:] = source[start + lo + mapped_bytes:start + hi]
        return name if zlib.crc32(out.numpy()) != crc else None

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            bad = [name for name in pool.map(fill, tasks) if name]
    finally:
        source = None
    if bad:
        raise CacheFileError(f"{path} is corrupted (table {bad[0]} does not match its checksum); save it again.")
