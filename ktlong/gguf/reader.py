"""Open a GGUF file, read its header (ktlong/gguf/header.py) and check every tensor against the
file before use; the tensors' bytes stay in a read-only memory map."""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ktlong.errors import GGUFError
from ktlong.gguf.header import HeaderError, TensorEntry, read_header

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: outermost first (GGUF stores innermost first)
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    """Metadata and raw tensor bytes of one GGUF file, memory-mapped, validated on open."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise GGUFError(f"GGUF file {self.path} does not exist; check the path given to --gguf_path or --model.")
        if not self.path.is_file():
            raise GGUFError(f"{self.path} is not a file; give the .gguf file itself to --gguf_path or --model.")
        self.file_size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with 'GGUF'); "
                            "convert the model with llama.cpp's convert_hf_to_gguf.py.")
        self._data = np.memmap(self.path, mode="r")
        try:
            header = read_header(self._data)
        except HeaderError as e:
            raise GGUFError(f"{self.path} is truncated or corrupt ({e}); download or convert it again.") from None
        self._metadata = header.metadata
        self.tensors: dict[str, TensorInfo] = {}
        for t in header.tensors:
            self.tensors[t.name] = self._checked_tensor_info(t)

    @property
    def num_weight_elements(self) -> int:
        """Elements of every tensor: what the weights take once dequantised."""
        return sum(math.prod(t.shape) for t in self.tensors.values())

    def _checked_tensor_info(self, t: TensorEntry) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(t.type_id)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {t.name} has unknown type id {t.type_id}; "
                            "the file is corrupt or from a newer llama.cpp.") from None
        shape = tuple(reversed(t.dims))
        num_elements = math.prod(shape)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if num_elements % block_size or shape[-1] % block_size:
            raise GGUFError(f"{self.path}: tensor {t.name} of shape {shape} does not fit "
                            f"{ggml_type.name} blocks of {block_size}; the file is corrupt.")
        num_bytes = num_elements // block_size * type_size
        offset = t.offset
        if offset + num_bytes > self.file_size:
            raise GGUFError(f"{self.path} is truncated: tensor {t.name} needs bytes up to "
                            f"{offset + num_bytes:,} but the file has {self.file_size:,}; "
                            "download or convert it again.")
        return TensorInfo(t.name, ggml_type, shape, offset, num_bytes)

    def get(self, key: str, default=None):
        """A metadata value as a Python object (str, int, float, bool or list)."""
        return self._metadata.get(key, default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path} lacks the metadata key '{key}'; convert it with a "
                            "recent llama.cpp.")
        return value

    def check_shape(self, name: str, shape: tuple[int, ...]):
        """Refuse a tensor whose shape is not the one the metadata implies (kernels index by it)."""
        if self.tensors[name].shape != tuple(shape):
            raise GGUFError(f"{self.path}: tensor {name} has shape {self.tensors[name].shape}, the metadata "
                            f"implies {tuple(shape)}; the file is corrupt.")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the memory map."""
        info = self.tensors[name]
        return self._data[info.offset:info.offset + info.num_bytes]

    def forget_metadata(self):
        """Free the parsed metadata (the vocabulary's lists); tensors stay readable, get() sees
        nothing."""
        self._metadata = {}

    def release_pages(self):
        """Drop the map's pages from this process's resident memory (they stay in the page
        cache, and are read back if touched again): the loader calls it once the tensors it
        read are copied, so that the file does not add its size to the peak."""
        mapping = getattr(self._data, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))
