"""Block masses from the prompt's last queries in one Triton kernel, for GPUs.

The plain torch version (observation_scores.py) writes the logits of every (query row, key)
pair to memory and passes over them five times: at 128K and 8B shapes that is about 3 ms and
120 launches a layer, paid again by every follow-up. Here one program takes one kv group's query
rows and one key block, computes their logits in registers and leaves only, per row, the
block's max and its sum of exp(logit - that max); a few torch ops weigh the blocks to the
overall max. The keys are read once.

This module needs triton; the dispatch in observation_scores.py imports it only on a GPU where
triton is installed. The CPU's tests run the same kernel in Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported when there is no GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from operators.observation_scores import query_rows

MAX_ROW_TILE = 64  # query rows per program: [rows, head_dim] and [rows, keys] stay in registers
MAX_KEY_TILE = 64  # keys per step inside a block


@triton.jit(do_not_specialize=["num_rows", "num_q", "num_blocks", "num_tokens"])  # one build for every prompt length
def _block_max_and_sum(q_ptr, k_ptr, max_ptr, sum_ptr, num_rows, num_q, num_blocks, num_tokens, scale,
                       stride_q_kv, stride_q_row, stride_k_kv, stride_k_block, stride_k_token,
                       BLOCK: tl.constexpr, DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr):
    """One kv group's query rows (a tile of ROWS) against one key block: per row, the block's
    max logit and sum of exp(logit - max), causal and cut at num_tokens."""
    kv, block, row_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = row_tile * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    row_ok = rows < num_rows
    q = tl.load(q_ptr + kv * stride_q_kv + rows[:, None] * stride_q_row + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [ROWS, DIM]
    q_pos = num_tokens - num_q + rows % num_q  # rows are (head in group, query)
    run_max = tl.full((ROWS,), float("-inf"), tl.float32)
    run_sum = tl.zeros((ROWS,), tl.float32)
    for start in range(0, BLOCK, KEYS):
        offs = start + tl.arange(0, KEYS)
        k_pos = block * BLOCK + offs
        keys = tl.load(k_ptr + kv * stride_k_kv + block * stride_k_block + offs[:, None] * stride_k_token
                       + dims[None, :], mask=(k_pos < num_tokens)[:, None], other=0.0)  # [KEYS, DIM]
        logits = tl.dot(q, tl.trans(keys)) * scale  # [ROWS, KEYS] float32
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < num_tokens)
        logits = tl.where(visible, logits, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(logits, 1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that see nothing yet
        run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), 1)
        run_max = new_max
    out = (kv * num_blocks + block) * num_rows + rows
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_ptr + out, run_sum, mask=row_ok)


def kernel_applies(k_pages: torch.Tensor) -> bool:
    """Shapes the kernel takes: power-of-two head_dim and block_size of at least 16 (tl.dot's
    smallest tile), float16 / bfloat16 keys."""
    dim, block = k_pages.shape[-1], k_pages.shape[2]
    return (dim & (dim - 1) == 0 and dim >= 16 and block & (block - 1) == 0 and block >= 16
            and k_pages.dtype in (torch.float16, torch.bfloat16) and k_pages.stride(-1) == 1)


def observation_block_mass_kernel(q: torch.Tensor, k_pages: torch.Tensor, num_tokens: int,
                                  scale: float) -> torch.Tensor:
    """observation_scores.observation_block_mass through the kernel: q [Tq, H, D], the queries
    of positions num_tokens-Tq..num_tokens-1; k_pages [KV, NB, B, D] holding at least num_tokens
    keys -> [KV, ceil(num_tokens / B)] float32."""
    num_q, num_heads, dim = q.shape
    num_kv, _, block, _ = k_pages.shape
    assert num_heads % num_kv == 0 and k_pages.shape[3] == dim and num_q <= num_tokens
    assert kernel_applies(k_pages), (tuple(k_pages.shape), k_pages.dtype)
    group = num_heads // num_kv
    num_rows, num_blocks = group * num_q, -(-num_tokens // block)
    assert num_blocks <= k_pages.shape[1]
    qg = query_rows(q, num_kv, k_pages.dtype)  # [KV, G*Tq, D]
    row_tile = min(MAX_ROW_TILE, max(16, triton.next_power_of_2(num_rows)))
    block_max = torch.empty((num_kv, num_blocks, num_rows), dtype=torch.float32, device=q.device)
    block_sum = torch.empty_like(block_max)
    grid = (num_kv, num_blocks, -(-num_rows // row_tile))
    _block_max_and_sum[grid](
        qg, k_pages, block_max, block_sum, num_rows, num_q, num_blocks, num_tokens, float(scale),
        qg.stride(0), qg.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        BLOCK=block, DIM=dim, ROWS=row_tile, KEYS=min(block, MAX_KEY_TILE))
    # every row sees its own position, so its overall max is finite
    weights = block_sum * torch.exp(block_max - block_max.amax(1, keepdim=True))  # [KV, NB, rows]
    return (weights / weights.sum(1, keepdim=True)).sum(2)
