"""Where each conversation of a batch keeps its tensors, as the kernels that take a whole batch in
one launch read it: each member's tensor of a kind by its offset from the first member's (one
address space: device memory and host memory registered with CUDA), in a small int64 table on
the device. An offset counted in units of 16 elements keeps a moved pointer's alignment, and its
loads their vector width (operators/window_attention_kernel.py: counted in single elements, the
window parts of a batch of 8 at 128K read K and V two bytes a load, 273 tok/s against 367)."""

from __future__ import annotations

import torch


def gaps(tensors: list, unit: int = 1, name: str = "each tensor") -> list[int]:
    """Each tensor's first element, in units of `unit` elements from the first tensor's (0 for a
    None, and for all where the first is None); a gap that is not a whole number of units is
    refused in one sentence naming `name`."""
    first = tensors[0]
    if first is None:
        return [0] * len(tensors)
    size = first.element_size() * unit
    found = []
    for t in tensors:
        gap = 0 if t is None else t.data_ptr() - first.data_ptr()
        if gap % size:
            raise ValueError(f"{name} of each conversation must lie a whole multiple of {size} bytes from the "
                             f"first conversation's")
        found.append(gap // size)
    return found


def device_table(columns: list[list[int]], device: torch.device, known: dict | None = None,
                 key: tuple | None = None) -> torch.Tensor:
    """Columns of numbers, one row per member -> [B, len(columns)] int64 on the device; kept in
    `known` by `key` when given (a CUDA graph's capture cannot copy to the device: its warm-up run
    makes the table, the graph reads it, and the caller keeps it while its graphs live)."""
    if known is not None and key in known:
        return known[key]
    table = torch.tensor(list(zip(*columns)), dtype=torch.int64).to(device)
    if known is not None:
        known[key] = table
    return table
