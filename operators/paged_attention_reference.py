"""Pure-torch execution of per-group page lists: the reference for the FlashInfer call."""

from __future__ import annotations

import torch

from operators.block_union import PageLists
from operators.dense_attention import dense_attention


def paged_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                              groups: torch.Tensor, pages: PageLists, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k_pages, v_pages: [KV, NB, B, D]; groups: [G, size] -> out [T, H, D].

    Each group attends, causally and bottom-right aligned, to the tokens of its pages in
    list order (the last page holding last_page_len tokens).
    """
    num_kv, blocks_per_head, block_size, dim = k_pages.shape
    flat_k = k_pages.reshape(num_kv * blocks_per_head, block_size, dim)
    flat_v = v_pages.reshape(num_kv * blocks_per_head, block_size, dim)
    out = torch.empty_like(q)
    indptr = pages.indptr.tolist()
    for g, heads in enumerate(groups.tolist()):
        ids = pages.indices[indptr[g]:indptr[g + 1]].long()
        length = (len(ids) - 1) * block_size + pages.last_page_len
        k = flat_k[ids].reshape(-1, dim)[:length]
        v = flat_v[ids].reshape(-1, dim)[:length]
        out[:, heads] = dense_attention(q[:, heads], k[None], v[None], scale)
    return out
