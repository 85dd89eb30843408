"""Recently selected DRAM blocks kept in device memory (`device_cache_blocks`), so decode reads
most of a token's selected blocks at device speed and the CPU only the ones that changed.

A token's top-k blocks are mostly the previous tokens' (docs/measurements/2026-11-decode.md, "selection drift": 77-83% of them
were the previous token's, 93-95% among the last 8 tokens', on Qwen at 8K and 32K). Per global
layer and kv head the device holds `slots` blocks as DRAM stores them (bf16, or q8_0 / q4_0 with
their scales, widened when read). Each step, per global layer:

1. the host splits the selection into hits and misses (`split`, cpu_ops/block_cache.py);
2. misses, up to ADMIT_PER_HEAD per kv head on average, take the least recently used slots, and
   their pages are gathered from DRAM into a pinned staging buffer (also `split`): a copy,
   which costs the host a fraction of attending to them;
3. the staged pages cross to the device (`stage_in`: one copy of the admitted ones only, queued
   by the host), then the device (`attend`, replayed from a CUDA graph with graphs on) puts them
   into their slots and attends to the hits and the admitted blocks, giving an (out, lse) state;
4. the CPU attends to the misses left over (none once the selection settles) meanwhile.
The window's state, the device's blocks' and the CPU's merge by log-sum-exp. Selection is unchanged: the
hits and misses are the same blocks the CPU alone would read, so the result is the same up to
the order of a float32 sum.
"""

from __future__ import annotations

import numpy as np
import torch

from cpu_ops.block_cache import admit_misses, gather_pages, split_hits
from cpu_ops.kv_storage import StoredKV
from ktlong.kv.layout import KVLayout
from ktlong.kv.pinned import PinnedTensors
from operators import triton_installed
from operators.kv_quant import dequantize_kv
from operators.window_attention import attention_over_prefix

ADMIT_PER_HEAD = 8  # admissions per kv head and layer per step (the staging buffer's size)


def block_cache_bytes(layout: KVLayout, slots: int, selected: int) -> int:
    """Device memory of the cache: K and V of slots + 1 (a scratch slot) blocks per kv head and
    global layer, stored as DRAM stores them, plus the staging copy and what `attend` gathers for
    one layer: `selected` (second_select_num) blocks per kv head, as stored and widened to float32
    (the torch ops' need; the GPU kernel reads pages in place, so there the figure is an upper bound)."""
    data, scales = layout.stored_row
    page = layout.block_size * (data * layout.stored_dtype.itemsize + 2 * scales)
    held = 2 * len(layout.global_layers) * layout.num_kv_heads * (slots + 1) * page
    staging = 2 * ADMIT_PER_HEAD * layout.num_kv_heads * page
    gathered = 2 * layout.num_kv_heads * selected * (page + layout.block_size * layout.head_dim * 4)
    return held + staging + gathered if slots else 0


class DeviceBlockCache:
    def __init__(self, layout: KVLayout, num_layers: int, slots: int, max_selected: int, scale: float,
                 device: torch.device):
        """num_layers: the global layers (indexed 0..num_layers-1 here); max_selected: the most
        blocks a step selects per kv head (second_select_num): the device's hit buffer holds that."""
        self.layout, self.slots, self.scale = layout, slots, scale
        KV, B = layout.num_kv_heads, layout.block_size
        self.num_kv, self.block_size = KV, B
        self.stride = slots + 1  # rows per kv head; row h * stride + slots is scratch
        self.scratch = slots  # what unused entries point at (head 0's scratch row)
        self.max_admit = min(ADMIT_PER_HEAD * KV, slots * KV)
        row, groups = layout.stored_row
        dtype, quantized = layout.stored_dtype, layout.is_quantized
        rows = KV * self.stride
        # the held pages, [layer, K/V, kv head x slot, B, R]
        self.data = torch.zeros((num_layers, 2, rows, B, row), dtype=dtype, device=device)
        self.scales = torch.zeros((num_layers, 2, rows, B, groups), dtype=torch.int16, device=device) if quantized else None
        # the host's side: which block each slot holds and the reverse, and when each was last read
        self.slot_of = np.full((num_layers, KV, layout.num_blocks), -1, np.int32)
        self.block_in = np.full((num_layers, KV, slots), -1, np.int32)
        self.last_used = np.full((num_layers, KV, slots), -1, np.int64)
        # exchange with the device, per layer: the hits' rows and token counts, the staged pages
        self._pinned = PinnedTensors(device.type == "cuda")
        self.hits = HitIndex(num_layers, KV, max_selected, self.scratch, self._pinned, device)
        A = self.max_admit
        self.stage_host = self._pinned.pin(torch.zeros((num_layers, A, 2, B, row), dtype=dtype))
        self.stage_scales_host = self._pinned.pin(torch.zeros((num_layers, A, 2, B, groups), dtype=torch.int16))
        self.stage_dest_host = self._pinned.pin(torch.full((num_layers, A), self.scratch, dtype=torch.int64))
        # the same on the device, one layer at a time (the graph segments run in stream order)
        self.stage = torch.zeros((A, 2, B, row), dtype=dtype, device=device)
        self.stage_scales = torch.zeros((A, 2, B, groups), dtype=torch.int16, device=device)
        self.staged = [0] * num_layers  # admissions staged per layer this step
        self.stage_dest = torch.full((A,), self.scratch, dtype=torch.int64, device=device)
        # numpy views for the host's per-step writes
        self.stage_np, self.stage_scales_np = host_words(self.stage_host), host_words(self.stage_scales_host)
        self.stage_dest_np = self.stage_dest_host.numpy()
        self.kernel = _attention_kernel(layout, device)
        self.miss_blocks = np.zeros((KV, max(max_selected, 1)), np.int32)
        self.miss_counts = np.zeros(KV, np.int32)
        self.admitted = (np.zeros(A, np.int64), np.zeros(A, np.int32), np.zeros(A, np.int32))

    def fits(self, blocks: np.ndarray) -> bool:
        return self.hits.fits(blocks)

    # ---- the host's part ---------------------------------------------------------------
    def split(self, j: int, blocks: np.ndarray, counts: np.ndarray, step: int, k: StoredKV,
              v: StoredKV) -> tuple[np.ndarray, np.ndarray]:
        """Layer j's selection -> the misses (blocks [KV, S], counts) left for the CPU. The hits,
        and the misses admitted now (their pages staged from k, v: layer j's DRAM), go to the
        pinned buffers `attend` reads."""
        hit_index, hit_valid = self.hits.index_np[j], self.hits.valid_np[j]
        split_hits(blocks, counts, self.slot_of[j], self.last_used[j], step, self.stride, self.block_size,
                   hit_index, hit_valid, self.miss_blocks, self.miss_counts)
        heads, blocks_in, slots = self.admitted
        n = admit_misses(self.miss_blocks, self.miss_counts, self.slot_of[j], self.block_in[j], self.last_used[j],
                         step, self.max_admit, self.stride, self.block_size, hit_index, hit_valid,
                         heads, blocks_in, slots)
        dest = self.stage_dest_np[j]
        dest[:] = self.scratch
        dest[:n] = heads[:n] * self.stride + slots[:n]
        self.staged[j] = n
        if n:
            gather_pages(k.data, v.data, heads, blocks_in, n, self.stage_np[j])
            if self.scales is not None:
                gather_pages(k.scales, v.scales, heads, blocks_in, n, self.stage_scales_np[j])
        return self.miss_blocks, self.miss_counts

    def no_hits(self, j: int):
        """Layer j reads nothing from the cache this step."""
        self.hits.valid_np[j] = 0
        self.stage_dest_np[j] = self.scratch
        self.staged[j] = 0

    def stage_in(self, j: int):
        """Queue the copy of layer j's admitted pages (only those) to the device, before `attend`
        puts them in place. Outside the captured part, as its size changes from step to step."""
        n = self.staged[j]
        if n:
            self.stage[:n].copy_(self.stage_host[j, :n], non_blocking=True)
            if self.scales is not None:
                self.stage_scales[:n].copy_(self.stage_scales_host[j, :n], non_blocking=True)

    def clear(self):
        """Hold nothing, as a new cache (a follow-up's prefill rewrote blocks, and a decoder kept
        across it goes on exactly as a new one would)."""
        self.slot_of[:] = -1
        self.block_in[:] = -1
        self.last_used[:] = -1
        self.stage_dest_np[:] = self.scratch
        self.staged = [0] * len(self.staged)

    # ---- the device's part (captured in a CUDA graph with graphs on) -------------------
    def attend(self, j: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put layer j's staged pages (copied in by `stage_in`) into their slots, then attend q
        [H, D] to the selected blocks it holds -> (out [H, D], lse [H]), in float32 as the CPU
        attends to the rest (bf16 probabilities put the two parts far enough apart to flip a
        later selection). Staging rows past this step's admissions go to the scratch slot."""
        self.stage_dest.copy_(self.stage_dest_host[j], non_blocking=True)
        for plane in range(2):
            self.data[j, plane].index_copy_(0, self.stage_dest, self.stage[:, plane])
            if self.scales is not None:
                self.scales[j, plane].index_copy_(0, self.stage_dest, self.stage_scales[:, plane])
        index, valid = self.hits.load(j)
        if self.kernel is not None:  # the pages read where they are held (operators/cached_blocks_kernel.py)
            scales = self.scales[j] if self.scales is not None else (None, None)
            return self.kernel(q.float(), self.data[j, 0], self.data[j, 1], scales[0], scales[1], index, valid,
                               self.scale)
        k, v = self._pages(j, 0, index), self._pages(j, 1, index)
        return attention_over_prefix(q.float(), k, v, valid, self.scale)

    def _pages(self, j: int, plane: int, index: torch.Tensor) -> torch.Tensor:
        """The pages of layer j at rows index [KV, S] as float32 token rows [KV, S * B, D]."""
        layout = self.layout
        pages = self.data[j, plane][index]  # [KV, S, B, R]
        if self.scales is not None:
            pages = dequantize_kv(pages, self.scales[j, plane][index], layout.kv_type, torch.float32)
        return pages.float().view(self.num_kv, -1, layout.head_dim)


class HitIndex:
    """Per global layer, the page rows a step attends to on the device, per kv head, and how many
    tokens of them count (whole blocks, first rows first): written by the host into pinned
    buffers (index_np, valid_np), copied to the device by the replayed part (`load`)."""

    def __init__(self, num_layers: int, num_kv: int, max_selected: int, fill: int, pinned: PinnedTensors,
                 device: torch.device):
        """max_selected: the most rows a layer's step names per kv head; fill: the row unused
        entries name."""
        self.max_selected = max_selected
        self.host_index = pinned.pin(torch.full((num_layers, num_kv, max_selected), fill, dtype=torch.int64))
        self.host_valid = pinned.pin(torch.zeros((num_layers, num_kv), dtype=torch.int64))
        self.index_np, self.valid_np = self.host_index.numpy(), self.host_valid.numpy()
        # on the device, one layer at a time (the replayed parts run in stream order)
        self.index = torch.full((num_kv, max_selected), fill, dtype=torch.int64, device=device)
        self.valid = torch.zeros(num_kv, dtype=torch.int64, device=device)

    def fits(self, blocks: np.ndarray) -> bool:
        """Whether a selection fits (dense layers read every block: CPU only)."""
        return blocks.shape[1] <= self.max_selected

    def load(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer j's rows and token counts on the device (queued copies; fixed shapes)."""
        self.index.copy_(self.host_index[j], non_blocking=True)
        self.valid.copy_(self.host_valid[j], non_blocking=True)
        return self.index, self.valid


def _attention_kernel(layout: KVLayout, device: torch.device):
    """The Triton kernel for `attend` on a GPU where triton is installed and the format suits it;
    None: the torch ops (gather, widen, masked attention)."""
    if device.type != "cuda" or not triton_installed():
        return None
    from operators.cached_blocks_kernel import cached_blocks_attention, kernel_applies

    return cached_blocks_attention if kernel_applies(layout.kv_type, layout.block_size, layout.head_dim) else None


def host_words(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor, 16-bit values as uint16 words (as stored_view gives DRAM)."""
    sixteen = t.dtype in (torch.bfloat16, torch.float16, torch.int16)
    return t.view(torch.int16).numpy().view(np.uint16) if sixteen else t.numpy()
