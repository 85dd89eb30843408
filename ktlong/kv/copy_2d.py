"""One asynchronous 2-D copy (cuMemcpy2DAsync) for a [rows, ...] view whose rows are contiguous
ranges a fixed pitch apart, between pinned host memory and a GPU or within a GPU.

A head-major table's block or token range is such a view: one range per kv head. torch copies
it either through a contiguous pageable host tensor (which holds the host until the stream gets
there) or, row by row, as one copy call each, which a 128K follow-up made about 120 times a
layer. The driver's 2-D copy moves every row in one call, on the current stream, as the
row-by-row copies did.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

MEMORYTYPE_HOST, MEMORYTYPE_DEVICE = 1, 2
DEVICE_ATTRIBUTE_MAX_PITCH = 11
POINTER_ATTRIBUTE_MEMORY_TYPE = 2
POINTER_ATTRIBUTE_RANGE_START_ADDR, POINTER_ATTRIBUTE_RANGE_SIZE = 11, 12


class _Memcpy2D(ctypes.Structure):  # CUDA_MEMCPY2D of cuda.h
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


class _Driver:
    """The CUDA driver's 2-D copy and the queries it needs (_get_driver loads it once, or gives None)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.copy = lib.cuMemcpy2DAsync_v2
        self.copy.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self.copy.restype = ctypes.c_int
        self.attribute = lib.cuDeviceGetAttribute
        self.attribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.attribute.restype = ctypes.c_int
        self.pointer_attribute = lib.cuPointerGetAttribute
        self.pointer_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self.pointer_attribute.restype = ctypes.c_int
        self.max_pitch: dict[int, int] = {}

    def is_page_locked(self, address: int) -> bool:
        """Host memory the driver knows as page-locked (cudaHostAlloc'd or cudaHostRegister'ed).
        Asked of the driver: torch's is_pinned() said False for the KV cache's registered tables."""
        kind = ctypes.c_uint(0)
        err = self.pointer_attribute(ctypes.byref(kind), POINTER_ATTRIBUTE_MEMORY_TYPE, address)
        return err == 0 and kind.value == MEMORYTYPE_HOST

    def registered_end(self, address: int) -> int | None:
        """Where the page-locked range holding `address` ends (None where the driver does not say)."""
        start, size = ctypes.c_uint64(0), ctypes.c_uint64(0)
        if (self.pointer_attribute(ctypes.byref(start), POINTER_ATTRIBUTE_RANGE_START_ADDR, address)
                or self.pointer_attribute(ctypes.byref(size), POINTER_ATTRIBUTE_RANGE_SIZE, address) or not size.value):
            return None
        return start.value + size.value

    def pitch_limit(self, device: int) -> int:
        if device not in self.max_pitch:
            value = ctypes.c_int(0)
            err = self.attribute(ctypes.byref(value), DEVICE_ATTRIBUTE_MAX_PITCH, device)
            self.max_pitch[device] = value.value if err == 0 else 0
        return self.max_pitch[device]


@functools.cache
def _get_driver() -> _Driver | None:
    try:
        return _Driver()
    except (OSError, AttributeError):  # no CUDA driver here
        return None


def _row_bytes(t: torch.Tensor) -> int | None:
    """Bytes of one row (t[i]) when each row is one contiguous range, else None."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return math.prod(t.shape[1:]) * t.element_size()


CUDA_ERROR_INVALID_VALUE = 1


def registered_runs(t: torch.Tensor) -> list[tuple[int, int]]:
    """A contiguous host view [rows, ...] as spans of rows [a, b) that each lie in one page-locked
    range: a copy over two ranges is refused, and a KV cache's kv-head range is locked in the
    pieces it grew by (ktlong/kv/host_cache.py). One span where the driver says nothing."""
    driver, rows = _get_driver(), t.shape[0]
    row_bytes = t[0].numel() * t.element_size() if rows else 0
    if driver is None or not row_bytes:
        return [(0, rows)]
    spans, a = [], 0
    while a < rows:
        end = driver.registered_end(t.data_ptr() + a * row_bytes)
        b = rows if end is None else min(rows, max(a + 1, (end - t.data_ptr()) // row_bytes))
        spans.append((a, b))
        a = b
    return spans


def copy_rows_2d(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Queue dst[i] = src[i] for every row as one 2-D copy on the current stream of the GPU side;
    False (nothing queued) where it does not apply: no GPU side, a host side that is not pinned,
    rows that are not contiguous ranges, no driver, a pitch past the device's limit. A follow-up
    makes a few of these per layer, so the checks stay cheap: no torch device or stream objects."""
    if src.shape != dst.shape or src.dtype != dst.dtype or src.dim() < 2 or src.shape[0] < 2:
        return False
    dst_gpu, src_gpu = dst.is_cuda, src.is_cuda
    if not (dst_gpu or src_gpu):
        return False
    device = (dst if dst_gpu else src).get_device()
    if dst_gpu and src_gpu and src.get_device() != device:
        return False
    width = _row_bytes(dst)
    if width is None or width == 0 or _row_bytes(src) != width:
        return False
    size = dst.element_size()
    dst_pitch, src_pitch = dst.stride(0) * size, src.stride(0) * size
    if dst_pitch < width or src_pitch < width:  # rows that overlap (a broadcast view)
        return False
    driver = _get_driver()
    if driver is None or max(dst_pitch, src_pitch) > driver.pitch_limit(device):
        return False
    host = None if (dst_gpu and src_gpu) else (src if dst_gpu else dst)
    if host is not None and not driver.is_page_locked(host.data_ptr()):  # pageable: the copy would hold the host
        return False
    p = _Memcpy2D(WidthInBytes=width, Height=src.shape[0], srcPitch=src_pitch, dstPitch=dst_pitch,
                  srcMemoryType=MEMORYTYPE_DEVICE if src_gpu else MEMORYTYPE_HOST,
                  dstMemoryType=MEMORYTYPE_DEVICE if dst_gpu else MEMORYTYPE_HOST)
    if src_gpu:
        p.srcDevice = src.data_ptr()
    else:
        p.srcHost = src.data_ptr()
    if dst_gpu:
        p.dstDevice = dst.data_ptr()
    else:
        p.dstHost = dst.data_ptr()
    # the raw handle of the device's current stream, as Triton's launcher reads it; the driver
    # call runs in that device's context (entered only when it is not the current one)
    stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(device))
    if device == torch.cuda.current_device():
        err = driver.copy(ctypes.byref(p), stream)
    else:
        with torch.cuda.device(device):
            err = driver.copy(ctypes.byref(p), stream)
    if err == CUDA_ERROR_INVALID_VALUE and host is not None:
        # the host rows lie in page-locked ranges of their own, not in one (a KV cache's kv heads
        # as it grows: ktlong/kv/host_cache.py): the caller copies them a locked piece at a time
        return False
    if err != 0:
        raise RuntimeError(f"cuMemcpy2DAsync failed with CUDA error {err} ({tuple(src.shape)}, pitches "
                           f"{src_pitch} -> {dst_pitch})")
    return True
