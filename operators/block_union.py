"""Q-block union and intra-group union of selected blocks into per-group page lists.

An execution group is the query heads of one kv head, or a subgroup of `subgroup_size` of
them when the kv group is larger. Each group becomes one FlashInfer request with one kv
head: its page list is every history block selected by any of its heads for any query block
of the chunk (and nothing else), followed by the chunk's own blocks, in position order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def execution_groups(num_heads: int, num_kv_heads: int, subgroup_size: int) -> torch.Tensor:
    """[G, group_size] query-head ids; group g reads kv head g // (groups per kv head)."""
    group = num_heads // num_kv_heads
    size = subgroup_size if subgroup_size < group and group % subgroup_size == 0 else group
    return torch.arange(num_heads).view(-1, size)


@dataclass
class PageLists:
    indptr: torch.Tensor  # [G + 1] int32 on the CPU (FlashInfer copies it at plan time)
    indices: torch.Tensor  # [nnz] int32 on the compute device: page = kv_head * blocks_per_head + block
    last_page_len: int  # valid tokens in each group's last page (the chunk's last block)
    num_hist_kept: torch.Tensor  # [G] int64 on the CPU: selected history blocks per group
    num_hist: int

    @property
    def density(self) -> float:
        """Kept fraction of history blocks, averaged over groups (1.0 with no history)."""
        if self.num_hist == 0:
            return 1.0
        return float(self.num_hist_kept.float().mean()) / self.num_hist


def union_query_blocks(keep: torch.Tensor) -> torch.Tensor:
    """keep: [H, num_query_blocks, num_hist] -> [H, num_hist]."""
    return keep.any(dim=1)


def union_groups(head_keep: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """head_keep: [H, num_hist]; groups: [G, size] -> [G, num_hist]."""
    return head_keep[groups.to(head_keep.device)].any(dim=1)


def build_page_lists(group_keep: torch.Tensor, groups: torch.Tensor, num_heads: int, num_kv_heads: int,
                     blocks_per_head: int, chunk_first_block: int, chunk_tokens: int,
                     block_size: int, hist_counts: torch.Tensor | None = None) -> PageLists:
    """Page lists without a sort: nonzero() of [G, history + chunk blocks] is already ordered.
    hist_counts: group_keep.sum(1) on the CPU, when the caller has it already (it saves a sync).

    (A scatter-based variant with a single sync measured slower on an H100: more launches.)
    """
    device = group_keep.device
    num_groups, num_hist = group_keep.shape
    assert num_hist == chunk_first_block
    chunk_blocks = -(-chunk_tokens // block_size)
    full = torch.ones((num_groups, num_hist + chunk_blocks), dtype=torch.bool, device=device)
    full[:, :num_hist] = group_keep
    g, j = full.nonzero(as_tuple=True)
    kv_of_group = torch.arange(num_groups, device=device) // (num_groups // num_kv_heads)
    indices = (kv_of_group[g] * blocks_per_head + j).to(torch.int32)
    if hist_counts is None:
        hist_counts = group_keep.sum(1).cpu()  # a host sync: FlashInfer plans on host-side lengths
    counts = hist_counts + chunk_blocks
    indptr = torch.zeros(num_groups + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    last = chunk_tokens - (chunk_blocks - 1) * block_size
    return PageLists(indptr, indices, last, hist_counts, num_hist)


def every_page_lists(num_groups: int, num_kv_heads: int, blocks_per_head: int, chunk_first_block: int,
                     chunk_tokens: int, block_size: int, device: torch.device) -> PageLists:
    """The page lists of every history block kept (dense through the paged path): what
    build_page_lists gives for an all-true group_keep, with no host sync (the lengths are known)."""
    chunk_blocks = -(-chunk_tokens // block_size)
    per_group = chunk_first_block + chunk_blocks
    kv_of_group = torch.arange(num_groups, device=device) // (num_groups // num_kv_heads)
    indices = (kv_of_group[:, None] * blocks_per_head + torch.arange(per_group, device=device)).to(torch.int32)
    indptr = torch.arange(num_groups + 1, dtype=torch.int32) * per_group
    last = chunk_tokens - (chunk_blocks - 1) * block_size
    return PageLists(indptr, indices.reshape(-1), last, torch.full((num_groups,), chunk_first_block),
                     chunk_first_block)


def fixed_page_indices(block_ids: torch.Tensor, num_kv_heads: int, blocks_per_head: int, chunk_first_block: int,
                       chunk_tokens: int, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The int32 indices of page lists of the same length for every group: block_ids [G, K]
    (history blocks in any order; attention over them does not depend on it) followed by the
    chunk's blocks -> [G * (K + chunk blocks)]. out: an int32 tensor of that size to write them
    into (an executor planned for these lengths reads it)."""
    device = block_ids.device
    num_groups = block_ids.shape[0]
    chunk_blocks = -(-chunk_tokens // block_size)
    kv_of_group = torch.arange(num_groups, device=device) // (num_groups // num_kv_heads)
    chunk = torch.arange(chunk_first_block, chunk_first_block + chunk_blocks, device=device)
    blocks = torch.cat([block_ids, chunk.expand(num_groups, -1)], dim=1)  # [G, K + chunk blocks]
    indices = (kv_of_group[:, None] * blocks_per_head + blocks).view(-1)
    if out is None:
        out = torch.empty(indices.shape, dtype=torch.int32, device=device)
    return out.copy_(indices)


def fixed_page_lists(indices: torch.Tensor, num_groups: int, num_keep: int, chunk_first_block: int,
                     chunk_tokens: int, block_size: int) -> PageLists:
    """Page lists of num_keep history blocks then the chunk's blocks for every group, over
    fixed_page_indices' indices. The lengths are known on the host, so nothing waits for the device."""
    chunk_blocks = -(-chunk_tokens // block_size)
    per_group = num_keep + chunk_blocks
    assert indices.numel() == num_groups * per_group
    indptr = torch.arange(num_groups + 1, dtype=torch.int32) * per_group
    last = chunk_tokens - (chunk_blocks - 1) * block_size
    return PageLists(indptr, indices, last, torch.full((num_groups,), num_keep), chunk_first_block)
