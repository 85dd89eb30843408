"""The head-major KV layout: per layer, K and V are [num_kv_heads, num_blocks, block_size,
head_dim] on the device and in DRAM, so a (kv head, block) pair is one contiguous page and a
chunk of one head is one contiguous range.

Sliding-window layers (gemma3) never read past their window, so DRAM keeps only the tail
that the decoder's device window loads after prefill: `sliding_blocks` blocks, placed at the
end of the prompt, and no side tables.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from dataclasses import dataclass

import torch

from operators.kv_quant import QBLOCK, QUANTIZED, stored_row_shapes


KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KV_TYPES = (*KV_DTYPES, *QUANTIZED)  # what DRAM may store; q8_0 and q4_0 as GGML's blocks
SINK_BLOCKS = 1  # blocks at the start of the context decode's device window always attends to
KEY_ANCHORS = ("DYNAMIC", "FIX")  # anchor types whose anchors are keys picked from the block


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    kv_type: str  # how DRAM stores K/V: one of KV_TYPES
    page_type: str  # how the device pages and window hold them: a key of KV_DTYPES
    sliding: tuple[bool, ...] = ()  # per layer: a sliding-window layer (DRAM keeps a tail only)
    sliding_blocks: int = 0  # DRAM blocks of a sliding layer
    # how decode represents a block (cpu_ops/anchors.py): DYNAMIC and FIX keep anchor_num of the
    # block's own keys, which prefill picks from the unquantised keys into a side table
    anchor_type: str = "MAX"
    anchor_num: int = 1

    @property
    def dtype(self) -> torch.dtype:
        """Of the device pages and the decode window (unquantised)."""
        return KV_DTYPES[self.page_type]

    @property
    def is_quantized(self) -> bool:
        return self.kv_type in QUANTIZED

    @property
    def stored_dtype(self) -> torch.dtype:
        return {"q8_0": torch.int8, "q4_0": torch.uint8}.get(self.kv_type) or KV_DTYPES[self.kv_type]

    @property
    def stored_row(self) -> tuple[int, int]:
        """(data elements, float16 scale words) of one token of one kv head in DRAM."""
        return stored_row_shapes(self.kv_type, self.head_dim) if self.is_quantized else (self.head_dim, 0)

    @property
    def stored_row_bytes(self) -> int:
        data, scales = self.stored_row
        return data * self.stored_dtype.itemsize + 2 * scales

    @property
    def anchor_keys(self) -> int:
        """Keys per block in the anchor side table (0 unless anchor_type is DYNAMIC or FIX)."""
        return self.anchor_num if self.anchor_type in KEY_ANCHORS else 0

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
        """K and V of one layer of `blocks` blocks in DRAM (default: the whole capacity)."""
        blocks = self.num_blocks if blocks is None else blocks
        return 2 * self.num_kv_heads * blocks * self.block_size * self.stored_row_bytes

    def page_bytes(self) -> int:
        """One layer's K and V pages on the device, the whole capacity."""
        return 2 * self.num_kv_heads * self.capacity * self.head_dim * self.dtype.itemsize

    def table_block_bytes(self) -> list[int]:
        """Bytes of one block of one kv head in each table a global layer has in DRAM, in the
        order of HostKVCache.shared_tables (K, V, their scales, the mean, max and min keys, the
        anchor keys), empty tables left out."""
        B, D = self.block_size, self.head_dim
        row, groups = self.stored_row
        kv, scales = B * row * self.stored_dtype.itemsize, B * groups * 2
        sizes = [kv, kv, scales, scales, D * 4, D * 4, D * 4, self.anchor_keys * D * 4]
        return [s for s in sizes if s]

    def page_blocks(self) -> int:
        """The fewest blocks whose bytes fill whole memory pages in every table: a kv head's
        range of a table starts on a page when the capacity is a multiple of them."""
        return math.lcm(*(mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, s) for s in self.table_block_bytes()))

    def side_table_bytes(self) -> int:
        """Side tables of one global layer: mean, max, min keys and the anchor keys (float32)."""
        per_block = (3 + self.anchor_keys) * self.head_dim * 4
        return self.num_kv_heads * self.num_blocks * per_block

    def dram_kv_bytes(self, sliding: bool) -> int:
        """K/V bytes in DRAM of the sliding (True) or the global (False) layers."""
        return sum(self.layer_bytes(self.blocks_in_dram(i)) for i in range(self.num_layers)
                   if self.is_sliding(i) == sliding)

    def dram_side_table_bytes(self) -> int:
        return len(self.global_layers) * self.side_table_bytes()

    def dram_cache_bytes(self) -> int:
        """One conversation's cache in DRAM: every layer's K/V and the global layers' side tables."""
        return self.dram_kv_bytes(sliding=False) + self.dram_kv_bytes(sliding=True) + self.dram_side_table_bytes()


def kv_layout(num_layers, num_kv_heads, head_dim, block_size, max_seq_len, kv_type,
              sliding: tuple[bool, ...] = (), local_windows_len: int = 0, page_type: str | None = None,
              anchor_type: str = "MAX", anchor_num: int = 1) -> KVLayout:
    """sliding, local_windows_len: the model's sliding-window layers keep in DRAM only what a device
    window of local_windows_len loads after prefill. page_type: the device's unquantised type,
    by default kv_type itself, or bf16 when DRAM holds q8_0 / q4_0. anchor_type, anchor_num: the
    decode anchors (the side table of DYNAMIC and FIX)."""
    from ktlong.errors import ConfigError

    if kv_type not in KV_TYPES:
        raise ConfigError(f"kv_type '{kv_type}' is not a storage type; use one of {', '.join(KV_TYPES)}.")
    if kv_type in QUANTIZED and head_dim % QBLOCK:
        raise ConfigError(f"kv_type '{kv_type}' stores blocks of {QBLOCK} values, and this model's head_dim "
                          f"is {head_dim}; use kv_type bf16 or fp16.")
    page_type = page_type or ("bf16" if kv_type in QUANTIZED else kv_type)
    num_blocks = -(-max_seq_len // block_size)
    # the window starts block-aligned at most local_windows_len + block_size back; one more block
    # because the prompt's end need not be block-aligned
    sliding_blocks = min(num_blocks, -(-local_windows_len // block_size) + 2) if any(sliding) else 0
    layout = KVLayout(num_layers, num_kv_heads, head_dim, block_size, num_blocks, kv_type, page_type,
                      tuple(sliding) if any(sliding) else (), sliding_blocks, anchor_type, anchor_num)
    if any(sliding):
        return layout
    # every kv head's range of every table starts on a page, so that caches can share their
    # leading blocks (ktlong/kv/shared_prefix.py): a few blocks more at most (8 at 8B shapes, q8_0)
    step = layout.page_blocks()
    return dataclasses.replace(layout, num_blocks=-(-num_blocks // step) * step)


def model_kv_layout(c, block_size: int, max_seq_len: int, kv_type: str, local_windows_len: int,
                    page_type: str | None = None, anchor_type: str = "MAX", anchor_num: int = 1) -> KVLayout:
    """The layout for a model config: its sliding layers keep only the device window's tail."""
    return kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, max_seq_len, kv_type,
                     c.sliding_layers, local_windows_len, page_type, anchor_type, anchor_num)
