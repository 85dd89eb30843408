"""One decode token through a llama-family model on the CPU, with numpy buffers and Numba calls only.

LlamaModel.forward runs a token through torch operations: about forty calls a layer, most on
vectors of a few hundred floats, where the call, not the arithmetic, is the cost (about half of
a 4K decode step of SmolLM2-135M, measured). Here a layer is a dozen calls: the products read
the GGUF's stored bytes in place (StoredMatrix.product_into) and take their inputs rounded to
8 bits (Activations.quantize, once per input, as llama.cpp does), the small parts are fused
(cpu_ops/layer_pieces.py), and attention reads the bfloat16 cache
(cpu_ops/sparse_attention.attend_into over every block). The output head is one more product
of the same kind. Buffers are allocated once.

It covers what most GGUF models are: the llama family (llama, mistral, qwen2, internlm2) with
every projection stored, one process, a bfloat16 cache, no sliding window. `supports` says when;
otherwise the session steps with forward.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch

from cpu_ops.gguf_matmul import Activations
from cpu_ops.layer_pieces import add_rms_norm, place_qkv, silu_times
from cpu_ops.sparse_attention import KIND, NO_SCALES, attend_into
from ktlong.gguf.stored_matrix import StoredMatrix
from ktlong.kv.dense_cache import BLOCK, DenseKVCache
from ktlong.models.llama import LlamaModel

_EMPTY = np.zeros(0, np.float32)


def supports(model: LlamaModel, cache: DenseKVCache) -> bool:
    c = model.config
    layers = model.weights.layers
    stored = all(isinstance(m, StoredMatrix) for w in layers for m in (w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down))
    return (cache.words is not None and model.tp is None and stored and not c.has_qk_norm and c.mlp_act == "silu"
            and not c.sliding_window and all(w.post_attn_norm is None and w.post_ffn_norm is None for w in layers))


def _products(whole, parts) -> list:
    """[(matrix, first output column)]: the fused matrix, or its parts one after another."""
    if whole is not None:
        return [(whole, 0)]
    starts = np.cumsum([0] + [p.shape[0] for p in parts[:-1]])
    return list(zip(parts, starts.tolist()))


class CpuDecodeStep:
    def __init__(self, model: LlamaModel, cache: DenseKVCache):
        assert supports(model, cache)
        c, self.model, self.cache = model.config, model, cache
        self.eps = np.float32(c.rms_norm_eps)
        self.scale = np.float32(model.scale)
        self.layers = []
        for w in model.weights.layers:
            biases = [b for b in (w.bq, w.bk, w.bv) if b is not None]
            bias = torch.cat(biases).float().numpy() if len(biases) == 3 else _EMPTY
            self.layers.append((w.attn_norm.float().numpy(), _products(w.wqkv, [w.wq, w.wk, w.wv]), bias,
                                w.wo, w.ffn_norm.float().numpy(), _products(w.w_gate_up, [w.w_gate, w.w_up]), w.w_down))
        heads, kv, dim = c.num_heads, c.num_kv_heads, c.head_dim
        inter = model.weights.layers[0].w_down.shape[1]
        self.x = np.empty(c.hidden_size, np.float32)
        self.h = Activations(1, c.hidden_size)
        self.qkv = np.empty((1, (heads + 2 * kv) * dim), np.float32)
        self.q = np.empty((heads, dim), np.float32)
        self.attended = Activations(1, heads * dim)
        self.lse = np.empty(heads, np.float32)
        self.o = np.empty((1, c.hidden_size), np.float32)
        self.gate_up = np.empty((1, 2 * inter), np.float32)
        self.act = Activations(1, inter)
        head = model.weights.output
        self.head = head if isinstance(head, StoredMatrix) else None
        self.logits = np.empty((1, c.vocab_size), np.float32)
        self.final_norm = model.weights.output_norm.float().numpy()
        self.down = np.empty((1, c.hidden_size), np.float32)
        items = nb.get_num_threads()  # the attention's shares of the blocks, one a thread
        self.parts = (np.empty((kv, items, heads // kv), np.float32), np.empty((kv, items, heads // kv), np.float32),
                      np.empty((kv, items, heads // kv, dim), np.float32))

    @torch.inference_mode()
    def __call__(self, token_id: int, position: int) -> torch.Tensor:
        """The token at `position` (the cache holds the tokens before it): its K/V go into the
        cache; returns its logits [vocab] float32."""
        model, cache = self.model, self.cache
        assert position < cache.max_len, f"KV cache holds {cache.max_len} tokens, asked for {position + 1}"
        self.x[:] = model.embed(torch.tensor([token_id]))[0].float().numpy()
        cos, sin = (t[0].float().numpy() for t in model.rope_tables(torch.tensor([position]))[False])
        end, delta = position + 1, _EMPTY
        counts = cache.block_counts(end)
        block, row = divmod(position, BLOCK)
        x, h, attended, act = self.x, self.h, self.attended, self.act
        for i, (attn_norm, qkv, bias, wo, ffn_norm, gate_up, down) in enumerate(self.layers):
            add_rms_norm(x, delta, attn_norm, self.eps, h.x[0])
            h.quantize()
            for matrix, first in qkv:
                matrix.product_into(h, self.qkv[:, first:first + matrix.shape[0]])
            keys, values = cache.words[0][i], cache.words[1][i]
            place_qkv(self.qkv[0], bias, cos, sin, self.q, keys[:, block, row], values[:, block, row])
            attend_into(KIND["bf16"], keys, NO_SCALES, values, NO_SCALES, self.q, cache.every_block, counts, end,
                        BLOCK, self.scale, *self.parts, attended.x.reshape(self.q.shape), self.lse)
            attended.quantize()
            wo.product_into(attended, self.o)
            add_rms_norm(x, self.o[0], ffn_norm, self.eps, h.x[0])
            h.quantize()
            for matrix, first in gate_up:
                matrix.product_into(h, self.gate_up[:, first:first + matrix.shape[0]])
            silu_times(self.gate_up[0], act.x[0])
            act.quantize()
            down.product_into(act, self.down)
            delta = self.down[0]
        if self.head is None:
            x += delta
            return model.logits(torch.from_numpy(x)[None])[0]
        add_rms_norm(x, delta, self.final_norm, self.eps, h.x[0])
        h.quantize()
        self.head.product_into(h, self.logits)
        return torch.from_numpy(self.logits[0].copy())
