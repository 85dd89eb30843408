"""One decode token through a llama-family model on the CPU, with numpy buffers and Numba calls only.

A token's layer in torch operations is about forty calls, most on vectors of a few hundred
floats, where the call, not the arithmetic, is the cost (about half of a 4K decode step of
SmolLM2-135M, measured). Here a layer is a dozen calls: the products read the GGUF's stored
bytes in place (StoredMatrix.product_into) and take their inputs rounded to 8 bits
(Activations.quantize, once per input, as llama.cpp does), the small parts are fused
(cpu_ops/layer_pieces.py), and attention reads the bfloat16 cache
(cpu_ops/sparse_attention.attend_into over every block). The output head is one more product
of the same kind. Buffers are allocated once.

The model is a CpuLlama (ktlong/models/cpu_llama.py): the torch-free engine's own, or torch's
LlamaModel seen through `CpuLlama.from_model` where `supports` says it fits.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.gguf_matmul import Activations
from cpu_ops.layer_pieces import add_rms_norm, place_qkv, silu_times
from cpu_ops.sparse_attention import NO_SCALES, attend_into
from ktlong.gguf.stored_matrix import StoredMatrix
from ktlong.kv.word_cache import BLOCK, WordCache
from ktlong.models.cpu_llama import CpuLlama


class CpuDecodeStep:
    def __init__(self, model: CpuLlama, cache: WordCache):
        c, self.model, self.cache = model.config, model, cache
        heads, kv, dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.x = np.empty(c.hidden_size, np.float32)
        self.h = Activations(1, c.hidden_size)
        self.qkv = np.empty((1, (heads + 2 * kv) * dim), np.float32)
        self.q = np.empty((heads, dim), np.float32)
        self.attended = Activations(1, heads * dim)
        self.lse = np.empty(heads, np.float32)
        self.o = np.empty((1, c.hidden_size), np.float32)
        self.gate_up = np.empty((1, 2 * c.intermediate_size), np.float32)
        self.act = Activations(1, c.intermediate_size)
        self.logits = np.empty((1, c.vocab_size), np.float32)
        self.down = np.empty((1, c.hidden_size), np.float32)
        items = nb.get_num_threads()  # the attention's shares of the blocks, one a thread
        self.parts = (np.empty((kv, items, heads // kv), np.float32), np.empty((kv, items, heads // kv), np.float32),
                      np.empty((kv, items, heads // kv, dim), np.float32))

    def __call__(self, token_id: int, position: int) -> np.ndarray:
        """The token at `position` (the cache holds the tokens before it): its K/V go into the
        cache; returns its logits [vocab] float32 (an array of its own)."""
        model, cache = self.model, self.cache
        assert position < cache.max_len, f"KV cache holds {cache.max_len} tokens, asked for {position + 1}"
        self.x[:] = model.embed_rows(np.array([token_id]))[0]
        cos, sin = (t[0] for t in model.rope(np.array([position])))
        end, delta = position + 1, np.zeros(0, np.float32)
        counts = cache.block_counts(end)
        block, row = divmod(position, BLOCK)
        x, h, attended, act = self.x, self.h, self.attended, self.act
        for i, w in enumerate(model.layers):
            add_rms_norm(x, delta, w.attn_norm, model.eps, h.x[0])
            h.quantize()
            for matrix, first in w.qkv:
                matrix.product_into(h, self.qkv[:, first:first + matrix.shape[0]])
            keys, values = cache.words[0][i], cache.words[1][i]
            place_qkv(self.qkv[0], w.bias, cos, sin, self.q, keys[:, block, row], values[:, block, row])
            attend_into("bf16", keys, NO_SCALES, values, NO_SCALES, self.q, cache.every_block, counts, end,
                        BLOCK, model.scale, *self.parts, attended.x.reshape(self.q.shape), self.lse)
            attended.quantize()
            w.wo.product_into(attended, self.o)
            add_rms_norm(x, self.o[0], w.ffn_norm, model.eps, h.x[0])
            h.quantize()
            for matrix, first in w.gate_up:
                matrix.product_into(h, self.gate_up[:, first:first + matrix.shape[0]])
            silu_times(self.gate_up[0], act.x[0])
            act.quantize()
            w.down.product_into(act, self.down)
            delta = self.down[0]
        add_rms_norm(x, delta, model.final_norm, model.eps, h.x[0])
        if not isinstance(model.head, StoredMatrix):
            return model.head(h.x)[0]
        h.quantize()
        model.head.product_into(h, self.logits)
        return self.logits[0].copy()
