"""A token embedding kept as the GGUF stores it: each looked-up row equals the same row of the
whole table dequantised, and a CPU model with its own output head keeps its embedding so."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from ktlong.gguf.dequant import dequantize
from ktlong.gguf.stored_rows import StoredRows


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q5_0, T.Q4_0, T.F16])
def test_looked_up_rows_equal_the_whole_table_dequantised(ggml_type):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((300, 96)).astype(np.float32)
    raw = torch.from_numpy(quantize(table, ggml_type).reshape(-1).view(np.uint8).copy())
    whole = dequantize(raw, ggml_type, (300, 96))
    rows = StoredRows(raw, ggml_type, (300, 96), torch.float32)
    ids = torch.tensor([[0, 299, 17], [17, 5, 150]])
    assert torch.equal(rows[ids], whole[ids])
    assert torch.equal(rows[torch.tensor([42])], whole[42:43])


def test_a_cpu_model_with_its_own_head_keeps_its_embedding_as_stored(real_model):
    """Qwen2.5-Coder-0.5B's Q5_0 embedding beside its Q8_0 head: its rows are the float32
    table's, and SmolLM2's tied embedding, which is its head too, stays a tensor."""
    from gguf.quants import dequantize as gguf_dequantize

    from ktlong.models.loader import open_model

    qwen = real_model("qwen2.5-coder-0.5b")
    embed = qwen.model.weights.embed
    assert isinstance(embed, StoredRows) and embed.ggml_type == T.Q5_0
    gf, _ = open_model("qwen2.5-coder-0.5b")
    stored = np.array(gf.raw("token_embd.weight")).reshape(embed.shape[0], -1)
    ids = [0, 1, 151642, 77, 4096]
    expected = gguf_dequantize(stored[ids], T.Q5_0)  # the gguf package's own numpy dequantisation
    assert torch.equal(qwen.model.embed(torch.tensor(ids)), torch.from_numpy(expected))
    assert isinstance(real_model("smollm2-135m").model.weights.embed, torch.Tensor)
