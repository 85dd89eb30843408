"""Execute per-group page lists in place with FlashInfer's paged prefill (no KV copy).

The head-major pages [KV, NB, B, D] are viewed as NB*KV pages of one head ([KV*NB, B, 1, D],
NHD); each execution group is one request with num_kv_heads=1 whose queries are the chunk's
tokens of the group's heads.
"""

from __future__ import annotations

import functools

import torch

from operators.block_union import PageLists

WORKSPACE_BYTES = 128 << 20


@functools.lru_cache(maxsize=None)
def float_workspace(device: torch.device) -> torch.Tensor:
    """The scratch every executor on a device shares: FlashInfer keeps a plan in each wrapper's
    own int buffers and uses the float workspace only while it runs, and prefill runs one
    attention at a time on one stream."""
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class FlashInferPagedExecutor:
    def __init__(self, device: torch.device, backend: str):
        import flashinfer

        assert backend in ("fa2", "fa3", "auto")
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_workspace(device), "NHD", backend=backend)
        self.staged: torch.cuda.Event | None = None  # the last plan's copy out of the wrapper's host buffer

    def plan(self, num_tokens: int, groups: torch.Tensor, pages: PageLists, head_dim: int,
             block_size: int, scale: float, dtype: torch.dtype):
        num_groups, size = groups.shape
        qo_indptr = torch.arange(num_groups + 1, dtype=torch.int32) * num_tokens
        last = torch.full((num_groups,), pages.last_page_len, dtype=torch.int32)
        # FlashInfer writes a plan into one page-locked host buffer and copies it to the device on
        # the stream; the host runs ahead of the stream, so the last plan's copy must have left
        # that buffer before this plan overwrites it (the host stays at most one plan ahead)
        if self.staged is not None:
            self.staged.synchronize()
        self.wrapper.plan(qo_indptr, pages.indptr, pages.indices, last, num_qo_heads=size, num_kv_heads=1,
                          head_dim_qk=head_dim, page_size=block_size, causal=True, sm_scale=scale,
                          q_data_type=dtype, kv_data_type=dtype)
        self.staged = torch.cuda.Event()
        self.staged.record()

    def reads_indices_from(self, indices: torch.Tensor) -> bool:
        """Whether the plan reads the page indices from this very tensor: FlashInfer keeps a
        device tensor of the right dtype as given (torch's .to returns it), so indices rewritten
        there in place serve the next run on the same plan, as its CUDA-graph buffers do."""
        held = getattr(self.wrapper, "_paged_kv_indices_buf", None)
        return held is not None and held.data_ptr() == indices.data_ptr()

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
            groups: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D] -> [T, H, D]; call plan() first for this chunk's page lists. The groups
        are runs of consecutive heads (block_union.execution_groups), so each group's queries
        are a strided view of q: one copy lays them out as FlashInfer's requests, one copy back."""
        assert q.dtype == k_pages.dtype == v_pages.dtype and k_pages.is_contiguous()
        num_tokens, num_heads, dim = q.shape
        num_groups, size = groups.shape
        num_kv, blocks, block_size, _ = k_pages.shape
        q_grouped = q.view(num_tokens, num_groups, size, dim).transpose(0, 1).reshape(num_groups * num_tokens, size, dim)
        cache = (k_pages.view(num_kv * blocks, block_size, 1, dim), v_pages.view(num_kv * blocks, block_size, 1, dim))
        o = self.wrapper.run(q_grouped, cache)  # [G*T, size, D]
        return o.view(num_groups, num_tokens, size, dim).transpose(0, 1).reshape(num_tokens, num_heads, dim)


@functools.lru_cache(maxsize=None)
def fa3_build_error(device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """None if FlashInfer's fa3 paged prefill builds and runs here for this head shape, else why
    not. The first call compiles the kernel (about 86 s on a fresh machine, then cached on disk)."""
    try:
        executor = FlashInferPagedExecutor(device, "fa3")
        pages = PageLists(indptr=torch.tensor([0, 1], dtype=torch.int32),
                          indices=torch.tensor([0], dtype=torch.int32, device=device), last_page_len=16,
                          num_hist_kept=torch.zeros(1, dtype=torch.int64), num_hist=0)
        groups = torch.zeros((1, 1), dtype=torch.long)
        executor.plan(16, groups, pages, head_dim, 16, head_dim ** -0.5, dtype)
        q = torch.zeros((16, 1, head_dim), dtype=dtype, device=device)
        k = torch.zeros((1, 1, 16, head_dim), dtype=dtype, device=device)
        executor.run(q, k, k, groups)
        torch.cuda.synchronize(device)
    except Exception as e:  # a failed JIT build or a kernel this GPU cannot run: fa2 serves instead
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None
