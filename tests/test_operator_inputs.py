"""The operators' entry points refuse inputs of a wrong rank, dtype, device or size with a
ValueError naming the argument, before any kernel runs (Triton's kernels run in its interpreter
on the CPU, tests/conftest.py)."""

import numpy as np
import pytest
import torch

from cpu_ops.kv_storage import StoredKV
from cpu_ops.sparse_attention import sparse_attention
from operators.chunk_attention import chunk_attention
from operators.kv_quant import dequantize_kv, quantize_kv
from operators.merge_state import merge_states

f32 = torch.float32


def kernels():
    from operators.block_scores_kernel import masked_block_scores
    from operators.rope_kernel import rope_kernel
    from operators.selected_blocks_kernel import selected_blocks_attention
    from operators.topk_selection_kernel import group_margins

    return masked_block_scores, rope_kernel, selected_blocks_attention, group_margins


@pytest.mark.parametrize("call, message", [
    (lambda: chunk_attention(torch.zeros(4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), 1.0, "torch"),
     r"q must have 3 dimensions, got shape \(4, 8\)"),
    (lambda: chunk_attention(torch.zeros(4, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8, dtype=torch.bfloat16),
                             1.0, "torch"), "v must be torch.float32, got torch.bfloat16"),
    (lambda: chunk_attention(torch.zeros(8, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), 1.0, "torch"),
     "must be the last of the keys"),
    (lambda: merge_states(torch.zeros(4, 8), torch.zeros(4), torch.zeros(4, 8), torch.zeros(3)),
     r"lse_b must have shape \(4,\), got \(3,\)"),
    (lambda: quantize_kv(torch.zeros(2, 40), "q8_0"), "a multiple of 32 values"),
    (lambda: dequantize_kv(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 2, dtype=torch.int16), "q8_0", f32),
     r"scales must have shape \(2, 1\), got \(2, 2\)"),
])
def test_torch_entry_points_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_kernel_entry_points_name_the_argument():
    masked_block_scores, rope_kernel, selected_blocks_attention, group_margins = kernels()
    anchors = torch.zeros(2, 10, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"anchors \(2, 10, 16\) do not fit q \(1, 2, 8\)"):
        masked_block_scores(torch.zeros(1, 2, 8), [anchors], [torch.zeros(1, 10)], [torch.zeros(3, dtype=torch.int64)],
                            4, True, False)
    with pytest.raises(ValueError, match="cos must be torch.float32"):
        rope_kernel(torch.zeros(3, 2, 16), torch.zeros(3, 8, dtype=torch.float64), torch.zeros(3, 8))
    from operators.selected_blocks_kernel import LayerPages

    pages = torch.zeros(6, 16, 32)
    with pytest.raises(ValueError, match="hit_index must be torch.int64, got torch.int32"):
        selected_blocks_attention(torch.zeros(1, 4, 32), [LayerPages(pages, pages, None, None, torch.zeros(
            2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))], 1.0)
    with pytest.raises(ValueError, match="pooled_keys must be torch.float32"):
        group_margins(torch.zeros(32, 4, 32), torch.zeros(2, 8, 32, dtype=torch.bfloat16), 8, 16, 1.0, 2, 1, 1)


def test_cpu_operator_names_the_argument():
    kv = StoredKV("fp32", np.zeros((2, 4, 16, 8), np.float32), np.zeros((0,), np.uint16))
    blocks, counts = np.zeros((2, 3), np.int32), np.array([1, 1], np.int32)
    with pytest.raises(ValueError, match="q must be float32, got float64"):
        sparse_attention(np.zeros((4, 8)), kv, kv, blocks, counts, 64, 16, 1.0)
    with pytest.raises(ValueError, match=r"counts \[4, 1\] must lie in 0..3"):
        sparse_attention(np.zeros((4, 8), np.float32), kv, kv, blocks, np.array([4, 1], np.int32), 64, 16, 1.0)
