"""The header of a GGUF file (its metadata and tensor table) read into plain Python values.

Every count and length is checked against the bytes left before anything is read or allocated
for it, so a damaged or hostile file fails with a HeaderError, never with an allocation of
what it claims. Arrays become Python lists: a 151K-token vocabulary is then a list of strings
(tens of MB), where a reader that keeps an array object per entry (the `gguf` package's) holds
hundreds of MB of them while the model loads. Versions 2 and 3, little-endian (what llama.cpp
writes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays: deeper nesting is refused
STRING, ARRAY = 8, 9
# value type id -> numpy dtype of a scalar of it
SCALARS = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
           4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
           10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8")}


class HeaderError(ValueError):
    """What is wrong with the header, in a few words."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    type_id: int
    dims: tuple[int, ...]  # as stored: innermost first
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    metadata: dict
    tensors: list[TensorEntry]
    data_offset: int


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int):
        if n < 0 or self.pos + n > self.size:
            raise HeaderError(f"it ends at byte {self.size:,}, inside its header")
        start, self.pos = self.pos, self.pos + n
        return self.buf[start:self.pos]

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, item_bytes: int, what: str) -> int:
        """A uint64 count of items of at least item_bytes each, no more than the bytes left hold."""
        n = self.unpack("<Q")
        if n * item_bytes > self.size - self.pos:
            raise HeaderError(f"it claims {n:,} {what}, more than its {self.size:,} bytes can hold")
        return n

    def string(self) -> str:
        n = self.count(1, "bytes of a string")
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"a string at byte {self.pos - n:,} is not UTF-8") from None

    def value(self, type_id: int, depth: int = 0):
        if type_id in SCALARS:
            return np.frombuffer(self.take(SCALARS[type_id].itemsize), SCALARS[type_id])[0].item()
        if type_id == STRING:
            return self.string()
        if type_id == ARRAY and depth < MAX_ARRAY_DEPTH:
            item_type = self.unpack("<I")
            if item_type in SCALARS:
                dtype = SCALARS[item_type]
                n = self.count(dtype.itemsize, "array items")
                return np.frombuffer(self.take(n * dtype.itemsize), dtype).tolist()
            n = self.count(8 if item_type in (STRING, ARRAY) else 1, "array items")
            return [self.value(item_type, depth + 1) for _ in range(n)]
        raise HeaderError(f"a value at byte {self.pos:,} has type {type_id}, which GGUF does not define")


def read_header(buf) -> Header:
    """buf: the file's bytes (a read-only memory map) -> its Header; HeaderError when damaged."""
    cur = _Cursor(buf)
    if bytes(cur.take(4)) != MAGIC:
        raise HeaderError("it does not start with 'GGUF'")
    version = cur.unpack("<I")
    if version not in VERSIONS:
        raise HeaderError(f"it is GGUF version {version} (big-endian or unknown); ktlong reads versions 2 and 3")
    tensor_count = cur.count(24, "tensors")  # name length, dims, type, offset: 24 bytes at least
    kv_count = cur.count(12, "metadata keys")  # key length and value type
    metadata = {}
    for _ in range(kv_count):
        key = cur.string()
        if key in metadata:
            raise HeaderError(f"the metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.unpack("<I"))
    entries = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise HeaderError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        entries.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise HeaderError(f"its general.alignment {alignment!r} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, type_id, offset in entries:
        if name in names:
            raise HeaderError(f"tensor {name} appears twice")
        names.add(name)
        tensors.append(TensorEntry(name, type_id, dims, data_offset + offset))
    return Header(version, metadata, tensors, data_offset)
