"""The head-major KV cache: one layer of pages on the compute device, every layer in DRAM.

Per layer, K and V are [num_kv_heads, num_blocks, block_size, head_dim] on both sides, so a
(kv head, block) pair is one contiguous page and a chunk of one head is one contiguous range.
DRAM holds per-block side tables next to the blocks: mean, max and min keys (Quest) and the
per-token prefill importance that DYNAMIC anchors use.

Sliding-window layers (gemma3) never read past their window, so DRAM keeps only the tail
that the decoder's device window loads after prefill: `sliding_blocks` blocks, placed at the
end of the prompt, and no side tables.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import torch

KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    sliding: tuple[bool, ...] = ()  # per layer: a sliding-window layer (DRAM keeps a tail only)
    sliding_blocks: int = 0  # DRAM blocks of a sliding layer

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding) and self.sliding[layer]

    @property
    def global_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_sliding(i)]

    def blocks_in_dram(self, layer: int) -> int:
        return self.sliding_blocks if self.is_sliding(layer) else self.num_blocks

    def layer_bytes(self, blocks: int | None = None) -> int:
        """K and V of one layer of `blocks` blocks (default: the whole capacity)."""
        blocks = self.num_blocks if blocks is None else blocks
        return 2 * self.num_kv_heads * blocks * self.block_size * self.head_dim * self.dtype.itemsize

    def side_table_bytes(self) -> int:
        """Side tables of one global layer: mean, max, min keys and token importance (float32)."""
        per_block = 3 * self.head_dim * 4 + self.block_size * 4
        return self.num_kv_heads * self.num_blocks * per_block

    def dram_kv_bytes(self, sliding: bool) -> int:
        """K/V bytes in DRAM of the sliding (True) or the global (False) layers."""
        return sum(self.layer_bytes(self.blocks_in_dram(i)) for i in range(self.num_layers)
                   if self.is_sliding(i) == sliding)

    def dram_side_table_bytes(self) -> int:
        return len(self.global_layers) * self.side_table_bytes()


def kv_layout(num_layers, num_kv_heads, head_dim, block_size, max_seq_len, kv_type,
              sliding: tuple[bool, ...] = (), local_tokens: int = 0) -> KVLayout:
    """sliding, local_tokens: the model's sliding-window layers keep in DRAM only what a device
    window of local_tokens loads after prefill."""
    if kv_type not in KV_DTYPES:
        from ktlong.errors import ConfigError

        raise ConfigError(f"kv_type '{kv_type}' is stored by the decode operator, not by prefill yet; "
                          "use --set kv_type=bf16 or fp16.")
    num_blocks = -(-max_seq_len // block_size)
    # the window starts block-aligned at most local_tokens + block_size back; one more block
    # because the prompt's end need not be block-aligned
    sliding_blocks = min(num_blocks, -(-local_tokens // block_size) + 2) if any(sliding) else 0
    return KVLayout(num_layers, num_kv_heads, head_dim, block_size, num_blocks, KV_DTYPES[kv_type],
                    tuple(sliding) if any(sliding) else (), sliding_blocks)


def model_kv_layout(c, block_size: int, max_seq_len: int, kv_type: str, local_tokens: int) -> KVLayout:
    """The layout for a model config: its sliding layers keep only the device window's tail."""
    return kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, max_seq_len, kv_type,
                     c.sliding_layers, local_tokens)


class DevicePages:
    """One layer's K/V pages on the compute device, reused layer after layer."""

    def __init__(self, layout: KVLayout, device: torch.device):
        shape = (layout.num_kv_heads, layout.num_blocks, layout.block_size, layout.head_dim)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.layout = layout

    def tokens(self, which: torch.Tensor) -> torch.Tensor:
        # [KV, num_blocks, block_size, D] -> [KV, capacity, D], a view
        return which.view(which.shape[0], -1, which.shape[-1])

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: [T, KV, D] at positions start..start+T."""
        end = start + k.shape[0]
        self.tokens(self.k)[:, start:end] = k.transpose(0, 1)
        self.tokens(self.v)[:, start:end] = v.transpose(0, 1)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor):
    """Ask Linux for 2 MiB pages under a large, untouched tensor (THP in "madvise" mode). Decode
    reads a few 32-64 KiB blocks scattered over GiBs per head and layer; with 4 KiB pages nearly
    every block starts with TLB misses. Best effort: nothing happens where it is not supported."""
    nbytes = t.numel() * t.element_size()
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(MADV_HUGEPAGE))


def pin_in_place(t: torch.Tensor):
    """Page-lock a tensor's own memory for asynchronous copies. torch's pinned allocator rounds
    every allocation up to a power of two, so a layer of 1 GiB + one block would take 2 GiB;
    registering the exact allocation costs exactly its size."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        from ktlong.errors import KtlongError

        raise KtlongError(f"could not page-lock {t.numel() * t.element_size() / 2**30:.1f} GiB of DRAM for the KV "
                          f"cache (CUDA error {int(err)}); lower max_seq_len.")


class PinnedTensors:
    """Tensors page-locked in place (pin_in_place), unlocked when this object goes: the owner
    of host buffers that the GPU copies to and from keeps one."""

    def __init__(self):
        self._tensors: list[torch.Tensor] = []

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            pin_in_place(t)
            self._tensors.append(t)
        return t

    def __del__(self):
        for t in self._tensors:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostKVCache:
    """Every layer's K/V and side tables in DRAM (pinned when a GPU will copy into it).

    k[layer], v[layer]: [KV, blocks, B, D]; block 0 is absolute block first_block[layer]
    (0 for global layers; the start of the kept tail for sliding layers). Side tables are
    per layer, [KV, NB, D] and [KV, NB, B]; empty for sliding layers.
    """

    def __init__(self, layout: KVLayout, pin: bool):
        H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
        self._pinned = PinnedTensors()

        def alloc(shape, dtype):
            t = torch.empty(shape, dtype=dtype)
            advise_huge_pages(t)  # before the first touch, which zero_ is
            t.zero_()
            return self._pinned.pin(t) if pin else t

        self.layout = layout
        blocks = [layout.blocks_in_dram(i) for i in range(layout.num_layers)]
        tables = [0 if layout.is_sliding(i) else layout.num_blocks for i in range(layout.num_layers)]
        self.k = [alloc((H, n, B, D), layout.dtype) for n in blocks]
        self.v = [alloc((H, n, B, D), layout.dtype) for n in blocks]
        self.key_mean = [alloc((H, n, D), torch.float32) for n in tables]
        self.key_max = [alloc((H, n, D), torch.float32) for n in tables]
        self.key_min = [alloc((H, n, D), torch.float32) for n in tables]
        self.importance = [alloc((H, n, B), torch.float32) for n in tables]
        self.first_block = [0] * layout.num_layers
        self.num_tokens = 0

    def place_tails(self, num_tokens: int):
        """Before a prefill of num_tokens: sliding layers keep the blocks that end the prompt."""
        end_block = -(-num_tokens // self.layout.block_size)
        for layer in range(self.layout.num_layers):
            if self.layout.is_sliding(layer):
                self.first_block[layer] = max(0, end_block - self.layout.sliding_blocks)

    def first_token(self, layer: int) -> int:
        return self.first_block[layer] * self.layout.block_size

    def tokens(self, layer: int, which: str, start: int, end: int) -> torch.Tensor:
        """K ("k") or V ("v") of absolute positions start..end: a [KV, end-start, D] view."""
        t = self.k[layer] if which == "k" else self.v[layer]
        base = self.first_token(layer)
        assert base <= start <= end <= base + t.shape[1] * t.shape[2], (layer, start, end, base)
        return t.view(t.shape[0], -1, t.shape[-1])[:, start - base:end - base]
