"""Where each conversation of a batch keeps its tensors, as the kernels that take a whole batch in
one launch read it: each member's tensor of a kind by its offset from a base address (one address
space: device memory and host memory registered with CUDA), in a small int64 table on the
device. An offset counted in units of 16 elements keeps a moved pointer's alignment, and its
loads their vector width (operators/window_attention_kernel.py: counted in single elements, the
window parts of a batch of 8 at 128K read K and V two bytes a load, 273 tok/s against 367).

Called alone, a kernel's base is its first member's tensor. A batch's step (ktlong/decode/step.py)
counts from bases of its own (`Bases`: a small tensor of each dtype, on the device or in page-locked
host memory, as the members' tensors lie), which live as long as it does, whoever its members
are. It keeps its tables in a `MemberTables`: a site for each kernel call of the step, in call
order. A CUDA graph captured over those bases and tables serves other members too: their offsets
from the same bases are written into the same tables (`rebind`), and the graph reads them at
replay."""

from __future__ import annotations

import torch


class Bases:
    """A batch step's own tensors that its kernels' offsets count from: one of each dtype and
    place (the device, or host memory, page-locked where CUDA is), made when first asked for."""

    ELEMENTS = 64  # each base's size: 512-byte aligned on a GPU, 64 on the CPU

    def __init__(self):
        self._made: dict = {}

    def like(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.device)
        if key not in self._made:
            base = torch.empty(self.ELEMENTS, dtype=t.dtype, device=t.device)
            if t.device.type == "cpu" and torch.cuda.is_available():
                base = base.pin_memory()  # host memory the GPU reads: counted from host memory it can read
            self._made[key] = base
        return self._made[key]


def gaps(tensors: list, unit: int = 1, name: str = "each tensor", base: int | None = None) -> list[int]:
    """Each tensor's first element, in units of `unit` elements from `base` (an address; the first
    tensor's when None); 0 for a None, and for all where the first is None. A gap that is not a
    whole number of units is refused in one sentence naming `name`."""
    first = tensors[0]
    if first is None:
        return [0] * len(tensors)
    size = first.element_size() * unit
    base = first.data_ptr() if base is None else base
    found = []
    for t in tensors:
        gap = 0 if t is None else t.data_ptr() - base
        if gap % size:
            raise ValueError(f"{name} of each conversation must lie a whole multiple of {size} bytes from the "
                             f"first conversation's (or the batch's base)")
        found.append(gap // size)
    return found


def device_table(columns: list[list[int]], device: torch.device) -> torch.Tensor:
    """Columns of numbers, one row per member -> [B, len(columns)] int64 on the device."""
    return torch.tensor(list(zip(*columns)), dtype=torch.int64).to(device)


def member_table(tables: "MemberTables | None", kind: str, columns: list[tuple[list, int, str]],
                 numbers: list[list[int]], device: torch.device, signature: tuple = ()
                 ) -> tuple[list, torch.Tensor]:
    """A kernel call's members -> (each column's base for the launch, [B, columns + numbers] int64
    table: each member's tensor of a column in units from its base, then its numbers). columns:
    (each member's tensor or None, unit, name for an error). tables: the batch's store (its site
    for this call, `MemberTables.site`), or None: the first member's tensors are the bases.
    signature: what else the launch bakes in (shapes, flags), compared when the site is rebound."""
    if tables is None:
        bases = [col[0] for col, _, _ in columns]
        return bases, device_table(_offsets(columns, bases, numbers), device)
    return tables.site(kind, columns, numbers, signature, device)


def _offsets(columns: list[tuple[list, int, str]], bases: list, numbers: list[list[int]]) -> list[list[int]]:
    """A table's columns: each member's tensor of a column in units from the column's base, then the numbers."""
    return [gaps(col, unit, name, None if base is None else base.data_ptr())
            for (col, unit, name), base in zip(columns, bases)] + numbers


class MemberTables:
    """A batch step's tables, one site per kernel call in the step's call order (`start` before
    each run of the step). A site keeps its columns' bases (the step's `Bases`) and its table;
    later runs with the same members return them unchanged (a graph's capture may not copy to
    the device), and a run after `rebind` writes the new members' offsets from the same bases
    into the same tables, outside any capture. `matches` says whether every site of that run
    found the launch it was made for (kind and signature): if not, graphs captured before do
    not fit the new members."""

    def __init__(self, bases: Bases):
        self.bases = bases
        self.sites: list[list] = []  # [kind, bases, table, values, signature, the members' addresses]
        self.cursor = 0
        self.rebinding = False
        self.matches = True

    def start(self, rebinding: bool = False):
        self.cursor, self.rebinding = 0, rebinding
        if rebinding:
            self.matches = True

    def site(self, kind: str, columns: list[tuple[list, int, str]], numbers: list[list[int]],
             signature: tuple, device: torch.device) -> tuple[list, torch.Tensor]:
        at, self.cursor = self.cursor, self.cursor + 1
        named = _named(columns, numbers)
        if at < len(self.sites) and self.sites[at][0] == kind:
            _, bases, table, values, made_for, seen = self.sites[at]
            if named == seen:
                return bases, table
            # other members: rebound, or (run eagerly, no graph) a step whose calls went another way
            assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
                "a captured call found other members than its table's"
            if signature != made_for:
                self.matches = False
                return self._made(at, kind, columns, numbers, signature, device, keep=not self.rebinding)
            found = _offsets(columns, bases, numbers)
            if found != values:
                table.copy_(torch.tensor(list(zip(*found)), dtype=torch.int64))
            self.sites[at][3:] = [found, made_for, named]
            return bases, table
        if self.rebinding or at < len(self.sites):
            self.matches = False
        return self._made(at, kind, columns, numbers, signature, device, keep=not self.rebinding)

    def _made(self, at: int, kind: str, columns, numbers, signature, device: torch.device, keep: bool):
        """A new table of these members, counted from the step's bases, kept as site `at` (and
        the sites after it dropped: the step's calls went another way) when `keep`."""
        bases = [None if col[0] is None else self.bases.like(col[0]) for col, _, _ in columns]
        found = _offsets(columns, bases, numbers)
        table = device_table(found, device)
        if keep:
            del self.sites[at:]
            self.sites.append([kind, bases, table, found, signature, _named(columns, numbers)])
        return bases, table


def _named(columns: list[tuple[list, int, str]], numbers: list[list[int]]) -> tuple:
    """The addresses a call's columns name, every member's, and its numbers: what its table was
    written for."""
    return (tuple(tuple(0 if t is None else t.data_ptr() for t in col) for col, _, _ in columns),
            tuple(tuple(n) for n in numbers))
