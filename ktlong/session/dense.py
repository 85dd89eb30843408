"""Normal mode on torch's model (ktlong/models/llama.py): one contiguous KV cache on the model's
device, reused across turns by common prefix (ktlong/session/chunked.py). On the CPU over a
bfloat16 cache, a decode step runs the Numba step (ktlong/models/cpu_decode.py) on the model's
own weights, where `cpu_view` fits the model."""

from __future__ import annotations

import numpy as np
import torch

from ktlong.gguf.stored_matrix import StoredMatrix
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.models.cpu_decode import CpuDecodeStep
from ktlong.models.cpu_llama import CpuLayer, CpuLlama, products
from ktlong.models.llama import LlamaModel, linear
from ktlong.session.chunked import ChunkedSession, resolve_chunk_size


def cpu_view(model: LlamaModel) -> CpuLlama | None:
    """The model's weights, shared, as the Numba decode step reads them; None where it cannot:
    a projection not kept as stored, a part of gemma3's, or a tensor-parallel rank."""
    c, w = model.config, model.weights
    matrices = [m for lw in w.layers for m in (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down)]
    if (model.device.type != "cpu" or model.tp is not None or not all(isinstance(m, StoredMatrix) for m in matrices)
            or c.has_qk_norm or c.has_post_norms or c.mlp_act != "silu" or c.sliding_window):
        return None
    layers = []
    for lw in w.layers:
        biases = [b for b in (lw.bq, lw.bk, lw.bv) if b is not None]
        if len(biases) not in (0, 3):
            return None
        layers.append(CpuLayer(
            attn_norm=lw.attn_norm.float().numpy(),
            qkv=products([lw.wqkv] if lw.wqkv is not None else [lw.wq, lw.wk, lw.wv]),
            bias=torch.cat(biases).float().numpy() if biases else np.zeros(0, np.float32),
            wo=lw.wo, ffn_norm=lw.ffn_norm.float().numpy(),
            gate_up=products([lw.w_gate_up] if lw.w_gate_up is not None else [lw.w_gate, lw.w_up]),
            down=lw.w_down))
    head = w.output if isinstance(w.output, StoredMatrix) else (
        lambda rows: linear(torch.from_numpy(rows), w.output).float().numpy())
    return CpuLlama(c, layers, lambda ids: model.embed(torch.from_numpy(ids)).float().numpy(),
                    w.output_norm.float().numpy(), head, model.inv_freq.numpy(), model.rope_mscale)


class DenseSession(ChunkedSession):
    def __init__(self, model: LlamaModel, max_seq_len: int, chunk_size: int, kv_dtype: torch.dtype | None = None):
        """kv_dtype: what the cache stores (resolve_dense_kv_dtype); None keeps the model's dtype."""
        super().__init__(max_seq_len, chunk_size)
        c = model.config
        self.model = model
        self.cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_seq_len,
                                  model.device, kv_dtype or model.dtype)
        # a token at a time on the CPU: numpy and Numba calls only, where the model allows
        view = cpu_view(model) if self.cache.words is not None else None
        self.cpu_step = CpuDecodeStep(view, self.cache.words) if view is not None else None

    @classmethod
    def from_config(cls, model: LlamaModel, config, max_seq_len: int) -> "DenseSession":
        """Normal mode's session: the config's chunk size and kv_type (resolved in plan.py)."""
        from ktlong.session.plan import resolve_dense_kv_dtype

        return cls(model, max_seq_len, resolve_chunk_size(config.chunk_size, config.block_size, model.device),
                   resolve_dense_kv_dtype(config.kv_type, model.device, model.dtype))

    @property
    def cache_bytes(self) -> int:
        return 2 * self.cache.k.numel() * self.cache.k.element_size()

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        return self.model.forward(torch.tensor(ids), self.cache, start, last_only=True)[-1]

    def step(self, token_id: int) -> torch.Tensor:
        """Append one token; return its logits [vocab]."""
        if self.cpu_step is not None:
            logits = torch.from_numpy(self.cpu_step(token_id, len(self.ids)))
        else:
            logits = self.model.forward(torch.tensor([token_id]), self.cache, len(self.ids), last_only=True,
                                        decoding=True)[-1]
        self.ids.append(token_id)
        return logits
