"""Selected context blocks attended by the GPU where they lie in DRAM (`context_attention: gpu`).

The KV cache in DRAM is page-locked, and page-locked memory is mapped into the GPU's address
space (unified addressing), so a kernel can read it over PCIe with no copy and no host thread.
Here the attention over a global layer's selected blocks is one kernel
(operators/selected_blocks_kernel.py) over the layer's DRAM pages: block b of kv head h is row h * num_blocks + b of the head-major [KV, NB, B, R] table. Either the
device selects too (`selection`, ktlong/decode/device_selection.py: the rows come from its top-k,
and a token is device work from end to end), or the host selects and writes the rows into a
pinned index that the replayed part copies in (tensor parallelism, scores on the CPU). Either
way the GPU reads every selected block and the CPU operator none, but for one case: with the host
selecting, a dense layer's every block does not fit the index, and the CPU operator reads them. A
token reads its selected K/V over PCIe once (285 MB at 8B shapes, 128K, q8_0); the CPU operator
reads the same bytes from DRAM at the host's stream rate.

A batch's conversations are one launch per layer (`attend`), and the blocks each layer read from
DRAM for the last tokens stay on the device in slots of their own (`kept`,
operators/selected_blocks_kernel.py): real text keeps most of a token's blocks for the next, and
a block still selected is read from its slot, not over PCIe again.

Where the device keeps a layer's rows between turns (ktlong/kv/resident.py: as many layers as
the memory plan leaves room for, stored as DRAM stores them), the kernel reads that layer's
blocks from the copy instead, up to the rows it holds: the same bytes from HBM, not over PCIe.
At 8B shapes, 128K and q8_0, a 24 GiB GPU holds about two thirds of the layers.
"""

from __future__ import annotations

import numpy as np
import torch

from ktlong.decode.device_selection import DeviceSelection, select_batch
from ktlong.errors import KtlongError
from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.pinned import PinnedTensors
from ktlong.kv.resident import ResidentHistory
from operators import triton_installed
from operators.member_tables import MemberTables


def resolve_context_attention(setting: str, device: torch.device, layout) -> str:
    """`context_attention` for a session: auto is gpu on a GPU with triton and a format the
    kernel reads (under tensor parallelism too: each rank reads its own kv heads' blocks from its
    own DRAM cache); cpu otherwise, and always on the CPU."""
    if device.type != "cuda":
        return "cpu"
    if setting != "auto":
        return setting
    if not triton_installed():
        return "cpu"
    from operators.selected_blocks_kernel import kernel_applies

    return "gpu" if kernel_applies(layout.kv_type, layout.block_size, layout.head_dim) else "cpu"


class DramBlocks:
    def __init__(self, host: HostKVCache, global_layers: list[int], max_selected: int, scale: float,
                 device: torch.device, selection: DeviceSelection | None = None):
        """global_layers: the layers indexed 0..n-1 here; max_selected: the most blocks a step
        selects per kv head (second_select_num); selection: the device's own (it picks the rows),
        or None (the host writes them: split)."""
        layout = host.layout
        if not triton_installed():
            raise KtlongError("context_attention: gpu needs triton; install the GPU extra (pip install -e "
                              "\".[gpu]\") or set context_attention=cpu.")
        from operators.selected_blocks_kernel import KeptBlocks, LayerPages, NearPages, kernel_applies

        if not kernel_applies(layout.kv_type, layout.block_size, layout.head_dim):
            raise KtlongError(f"context_attention: gpu reads bf16, fp16, fp32 or q8_0 blocks with a power-of-two "
                              f"block_size and head_dim of at least 16 (here {layout.kv_type}, block "
                              f"{layout.block_size}, head_dim {layout.head_dim}); set context_attention=cpu.")
        self.scale, self.block_size, self.host = scale, layout.block_size, host
        self.near_pages, self.layer_pages, self.layers = NearPages, LayerPages, global_layers
        KV, NB = layout.num_kv_heads, layout.num_blocks
        self.num_blocks, self.num_rows = NB, KV * NB
        rows = self.num_rows
        # each global layer's DRAM pages as [KV * NB, B, R] views (no copy), and their scales
        self.pages = [(host.k[g].view(rows, *host.k[g].shape[2:]), host.v[g].view(rows, *host.v[g].shape[2:]))
                      for g in global_layers]
        self.scales = ([(host.k_scales[g].view(rows, *host.k_scales[g].shape[2:]),
                         host.v_scales[g].view(rows, *host.v_scales[g].shape[2:])) for g in global_layers]
                       if layout.is_quantized else [(None, None)] * len(global_layers))
        self._pinned = PinnedTensors(device.type == "cuda")
        self.hits = HitIndex(len(global_layers), KV, max_selected, self._pinned, device)
        self.head_rows = (np.arange(KV, dtype=np.int64) * NB)[:, None]
        self.selection = selection
        # the device's copies (None: none kept): per global layer, the blocks per kv head read
        # from the copy; the copies themselves are looked up when a part is run or captured
        self.resident: ResidentHistory | None = None
        self.near_blocks = torch.zeros(len(global_layers), dtype=torch.int64, device=device)
        self.near_counts = [0] * len(global_layers)
        self.near_addresses: tuple = ()  # the copies' memory as use_resident last saw it
        # the blocks each global layer read from DRAM for the last tokens, in second_select_num
        # slots per kv head (a layer that reads every block keeps none): a block still selected
        # is read from its slot, not over PCIe again
        slots = selection.places if selection is not None else max_selected  # the index's width
        sparse = [j for j in range(len(global_layers)) if selection is None or selection.role[j] != "dense"]
        self.kept: list = [None] * len(global_layers)
        self.kept_rows = self.plans = None  # every sparse layer's slots' rows and plans, when there are any
        if sparse:
            def slot_tables(t):
                return None if t is None else torch.zeros((len(sparse), KV * slots, *t.shape[1:]), dtype=t.dtype,
                                                          device=device)
            (k, v), (ks, vs) = self.pages[0], self.scales[0]
            tables = [slot_tables(t) for t in (k, v, ks, vs)]
            self.kept_rows = torch.full((len(sparse), KV, slots), -1, dtype=torch.int64, device=device)
            # (-1: a layer whose step does not run the plan, its copy on the device holding it, reports no reads)
            self.plans = torch.full((len(sparse), 2, KV, slots), -1, dtype=torch.int32, device=device)
            for i, j in enumerate(sparse):
                self.kept[j] = KeptBlocks(*(None if t is None else t[i] for t in tables), self.kept_rows[i],
                                          self.plans[i])

    def use_resident(self, resident: ResidentHistory | None):
        """Read each global layer's leading blocks from the device's copy of its rows, as far as
        the copy holds whole blocks (before each step whose copies changed: the decoder tracks
        resident.version). near_addresses: the copies' memory, which captured parts hold, so
        that a body captures them again when it moved (DecodeStep.ready)."""
        self.resident = resident
        if self.plans is not None:
            self.plans.fill_(-1)
        counts = [0] * len(self.layers)
        if resident is not None:
            for j, layer in enumerate(self.layers):
                if layer in resident.rows:
                    counts[j] = resident.valid[layer] // self.block_size
        self.near_counts = counts
        self.near_blocks.copy_(torch.tensor(counts, dtype=torch.int64))
        self.near_addresses = () if resident is None else tuple(
            tuple(t.data_ptr() for t in resident.rows[layer].values()) if layer in resident.rows else ()
            for layer in self.layers)

    def forget_kept(self):
        """The DRAM blocks changed under the kept slots (a follow-up's prefill rewrote them): none
        is held any more."""
        if self.plans is not None:
            self.kept_rows.fill_(-1)

    def _near(self, j: int):
        """Layer j's device copy as the kernel reads it ([KV * NB, B, R] as the DRAM pages); where
        the device holds none, the DRAM pages with a count of 0 (every conversation of a batch
        names one). Its count is read at launch: a copy that grows keeps the captured parts valid."""
        if self.resident is None or self.layers[j] not in self.resident.rows:
            (k, v), (ks, vs) = self.pages[j], self.scales[j]
            return self.near_pages(self.near_blocks[j], self.num_blocks, k, v, ks, vs)
        rows, (_, block, _) = self.resident.rows[self.layers[j]], self.pages[j][0].shape

        def view(name):
            return rows[name].view(self.num_rows, block, -1) if name in rows else None
        return self.near_pages(self.near_blocks[j], self.num_blocks, view("k"), view("v"), view("k_scales"),
                               view("v_scales"))

    def token_rows(self, j: int) -> tuple:
        """Layer j's DRAM tables by token, [KV, tokens, R] views (q8_0: and the scales'), where
        the decode step's append kernel writes each new token's row."""
        (k, v), (ks, vs) = self.pages[j], self.scales[j]
        by_token = lambda t: None if t is None else t.view(self.num_rows // self.num_blocks, -1, t.shape[-1])
        return by_token(k), by_token(v), by_token(ks), by_token(vs)

    def covers(self, j: int, last: int) -> bool:
        """Whether layer j's device copy holds every context block before `last` (then none of
        its selected blocks crossed PCIe)."""
        return self.near_counts[j] >= last

    def fits(self, blocks: np.ndarray) -> bool:
        return self.hits.fits(blocks)

    def split(self, j: int, blocks: np.ndarray, counts: np.ndarray):
        """Layer j's selection -> the rows the GPU reads (all of it: nothing is left for the CPU)."""
        S = blocks.shape[1]
        self.hits.index_np[j, :, :S] = self.head_rows + blocks
        self.hits.valid_np[j] = counts.astype(np.int64) * self.block_size

    def no_hits(self, j: int):
        """Layer j reads no blocks on the device this step (nothing selected, or a dense layer's
        every block, which the CPU operator reads)."""
        self.hits.valid_np[j] = 0

    def holds(self, j: int) -> bool:
        """Whether the device keeps a copy of layer j's rows (then the kept slots add nothing)."""
        return self.resident is not None and self.layers[j] in self.resident.rows

    def pages_of(self, j: int, rows: tuple[torch.Tensor, torch.Tensor]):
        """Layer j as the kernel reads it this step (LayerPages): its pages, the rows of the
        selected blocks and their valid tokens (the device's selection's, or as the host wrote
        them: `hits`), its device copy and kept slots, and the document it holds in one copy with
        other conversations' caches, if any (a block that several of them select is read once)."""
        (k, v), (ks, vs) = self.pages[j], self.scales[j]
        shared = self.host.shared
        return self.layer_pages(k, v, ks, vs, *rows, near=self._near(j), kept=self.kept[j],
                                share_group=-1 if shared is None else id(shared), shared_blocks=self.host.shared_blocks)


def attend(drams: list[DramBlocks], j: int, q: torch.Tensor, tables: MemberTables | None, base=None,
           out: torch.Tensor | None = None, lanes: list = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's global layer j: q [B, H, D], conversation b's over its selected blocks in DRAM
    (or the device's copies), one kernel for all -> (out [B, H, D], lse [B, H]) float32, into
    `out` when given; base: a state (out, lse) over other keys merged in by the same kernel, or a
    function that returns one once the reads are queued; tables: the batch's store of the
    kernels' tables (the selection's and the reads': operators/member_tables.py). lanes: CUDA
    streams for selections made one conversation at a time (device_selection.select_batch)."""
    from operators.selected_blocks_kernel import selected_blocks_attention

    if drams[0].selection is not None:
        rows = select_batch([dram.selection for dram in drams], j, q, tables, lanes)
    else:
        rows = [dram.hits.load(j) for dram in drams]
    layers = [dram.pages_of(j, r) for dram, r in zip(drams, rows)]
    return selected_blocks_attention(q, _keeping(drams, j, layers), drams[0].scale, base, out, tables)


def _keeping(drams: list[DramBlocks], j: int, layers: list) -> list:
    """Layer j's pages as the kernel gets them: without kept slots where every conversation's
    device copy holds the layer (its blocks are read there, and planning slots would only cost
    a kernel a layer). A graph keeps the choice, and is captured again when the copies change
    (DecodeStep.ready)."""
    if all(dram.holds(j) for dram in drams):
        return [layer._replace(kept=None) for layer in layers]
    return layers


class HitIndex:
    """Per global layer, the page rows a step attends to on the device, per kv head, and how many
    tokens of them count (whole blocks, first rows first): written by the host into pinned
    buffers (index_np, valid_np), copied to the device by the replayed part (`load`)."""

    def __init__(self, num_layers: int, num_kv: int, max_selected: int, pinned: PinnedTensors,
                 device: torch.device):
        """max_selected: the most rows a layer's step names per kv head (unused entries name row 0)."""
        self.max_selected = max_selected
        self.host_index = pinned.pin(torch.zeros((num_layers, num_kv, max_selected), dtype=torch.int64))
        self.host_valid = pinned.pin(torch.zeros((num_layers, num_kv), dtype=torch.int64))
        self.index_np, self.valid_np = self.host_index.numpy(), self.host_valid.numpy()
        # on the device, one layer at a time (the replayed parts run in stream order)
        self.index = torch.zeros((num_kv, max_selected), dtype=torch.int64, device=device)
        self.valid = torch.zeros(num_kv, dtype=torch.int64, device=device)

    def fits(self, blocks: np.ndarray) -> bool:
        """Whether a selection fits (dense layers read every block: CPU only)."""
        return blocks.shape[1] <= self.max_selected

    def load(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer j's rows and token counts on the device (queued copies; fixed shapes)."""
        self.index.copy_(self.host_index[j], non_blocking=True)
        self.valid.copy_(self.host_valid[j], non_blocking=True)
        return self.index, self.valid
