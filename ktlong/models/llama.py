"""The llama family (llama, mistral, qwen2, internlm2-as-llama) and gemma3: the dense forward.

Gemma 3 adds q/k RMS norms, norms after attention and after the MLP, a GELU-tanh MLP,
embeddings scaled by sqrt(hidden), and sliding-window layers with their own RoPE base.

Engines (dense generation, layer-major prefill, sparse decode) call the per-layer pieces
`qkv`, `attention_output` and `mlp` (with the residuals: `residual_block`); `forward` is the plain dense path built from them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ktlong.kv.dense_cache import DenseKVCache
from ktlong.gguf.model_config import ModelConfig
from ktlong.gguf.stored_matrix import MAX_IN_PLACE_ROWS, StoredMatrix
from ktlong.models.rope import apply_rope, inv_freq, rope_at, rope_cos_sin
from ktlong.gguf.weights import ModelWeights
from operators import triton_installed


def linear(x: torch.Tensor, w: torch.Tensor | StoredMatrix, bias: torch.Tensor | None = None,
           eight_bit: bool = False) -> torch.Tensor:
    """x @ w.T + bias: F.linear over a tensor; over a StoredMatrix (on the CPU), in float32 and
    returned in x's dtype: a few rows in place (StoredMatrix.product: their inputs in 8 bits
    where eight_bit, a decode step's, and the machine has AVX2), more by F.linear over the
    matrix dequantised (torch's GEMM shares the OpenMP threads of torch and Numba; numpy's BLAS
    would contend with them)."""
    if not isinstance(w, StoredMatrix):
        return F.linear(x, w, bias)
    rows = x.reshape(-1, x.shape[-1]).float()
    if rows.shape[0] <= MAX_IN_PLACE_ROWS:
        y = torch.from_numpy(w.product(rows.numpy(), eight_bit=eight_bit))  # copied into its Activations
    else:
        y = F.linear(rows, torch.from_numpy(w.dequantized()))
    y = y.to(x.dtype).view(*x.shape[:-1], w.shape[0])
    return y + bias if bias is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and triton_installed():  # one kernel instead of eight
        from operators.rms_norm_kernel import rms_norm_kernel

        return rms_norm_kernel(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(x.dtype) * weight


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the norm after it: (x + y, rms_norm(x + y, weight))."""
    if x.is_cuda and triton_installed():  # one kernel instead of two
        from operators.rms_norm_kernel import add_rms_norm_kernel

        return add_rms_norm_kernel(x, y, weight, eps)
    total = x + y
    return total, rms_norm(total, weight, eps)


def activation(gate: torch.Tensor, act: str) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """The MLP's act(gate) * up from the gate/up product's output [T, 2 I]."""
    if act != "gelu_tanh" and gate_up.is_cuda and triton_installed():  # one kernel instead of two
        from operators.gated_activation_kernel import silu_mul

        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, -1)
    return activation(gate, act) * up


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, tp=None):
        """tp: a TensorParallel (ktlong/parallel/group.py) when config and weights are one rank's
        share; the output projection's and the MLP's partial sums are then all-reduced."""
        self.config = config
        self.weights = weights
        self.tp = tp
        self.device = weights.embed.device
        self.dtype = weights.output_norm.dtype  # the embedding and head may be kept as stored (CpuWeights)
        self.inv_freq, self.rope_mscale = inv_freq(config.rope, weights.rope_freq_factors)
        self.inv_freq = self.inv_freq.to(self.device)
        self.inv_freq_local = self.inv_freq
        if config.rope_local_base:
            local = dataclasses.replace(config.rope, base=config.rope_local_base, scaling_type="none")
            self.inv_freq_local = inv_freq(local)[0].to(self.device)
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [T] -> [T, hidden]
        x = self.weights.embed[token_ids].to(self.dtype)
        if self.config.embed_scale != 1.0:  # gemma rounds the scale to the model dtype first
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def rope_tables(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin at positions, for global layers (False) and sliding ones (True): what qkv
        computes each layer, once for all of them (a decode step's layers share a position)."""
        tables = {False: rope_cos_sin(self.inv_freq, positions, self.rope_mscale)}
        if self.config.sliding_window:
            tables[True] = rope_cos_sin(self.inv_freq_local, positions, 1.0)
        return tables

    def qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor, rope: dict | None = None,
            decoding: bool = False):
        """x: [T, hidden] -> q [T, H, D], k [T, KV, D], v [T, KV, D], RoPE applied (from
        rope_tables(positions) when given). decoding: a decode step's rows, whose products over
        stored matrices take 8-bit inputs (linear); a prompt's stay float32 however few."""
        c, w = self.config, self.weights.layers[i]
        h = rms_norm(x, w.attn_norm, c.rms_norm_eps)
        qkv = None
        if w.wqkv is not None:  # one product: [T, (H + 2 KV) * D], its biases in one add
            qkv = linear(h, w.wqkv, eight_bit=decoding)
            qkv = qkv if w.bqkv is None else qkv + w.bqkv
            q, k, v = qkv.split([w.wq.shape[0], w.wk.shape[0], w.wv.shape[0]], -1)
            if w.bqkv is None and any(b is not None for b in (w.bq, w.bk, w.bv)):  # some parts' biases only
                q, k, v = (t if b is None else t + b for t, b in ((q, w.bq), (k, w.bk), (v, w.bv)))
                qkv = None
        else:
            q, k, v = (linear(h, m, b, decoding) for m, b in ((w.wq, w.bq), (w.wk, w.bk), (w.wv, w.bv)))
        q = q.reshape(-1, c.num_heads, c.head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        if c.has_qk_norm:
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        sliding = c.is_sliding(i)
        if rope is None:
            freqs = self.inv_freq_local if sliding else self.inv_freq
            return *rope_at(q, k, freqs, positions, 1.0 if sliding else self.rope_mscale), v
        cos, sin = rope[sliding]
        if qkv is not None and not c.has_qk_norm:  # q and k side by side in the product: one rotation
            heads = c.num_heads + c.num_kv_heads
            qk = apply_rope(qkv[:, :heads * c.head_dim].view(-1, heads, c.head_dim), cos, sin)
            return qk[:, :c.num_heads], qk[:, c.num_heads:], v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attention_output(self, i: int, o: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        # o: [T, H, D] -> [T, hidden]
        w = self.weights.layers[i]
        out = linear(o.reshape(o.shape[0], -1), w.wo, eight_bit=decoding)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return rms_norm(out, w.post_attn_norm, self.config.rms_norm_eps) if w.post_attn_norm is not None else out

    def mlp(self, i: int, h: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        """h: the layer's input after its ffn_norm, [T, hidden] -> [T, hidden]."""
        w = self.weights.layers[i]
        if w.w_gate_up is not None:  # one product: [T, 2 intermediate]
            product = gated(linear(h, w.w_gate_up, eight_bit=decoding), self.config.mlp_act)
        else:
            product = (activation(linear(h, w.w_gate, eight_bit=decoding), self.config.mlp_act)
                       * linear(h, w.w_up, eight_bit=decoding))
        out = linear(product, w.w_down, eight_bit=decoding)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return rms_norm(out, w.post_ffn_norm, self.config.rms_norm_eps) if w.post_ffn_norm is not None else out

    def residual_block(self, i: int, x: torch.Tensor, o: torch.Tensor, out: torch.Tensor | None = None,
                       decoding: bool = False) -> torch.Tensor:
        """The rest of layer i once attention is done: x [T, hidden], o [T, H, D] -> x [T, hidden]
        (into `out` when given; it may be x). decoding: as qkv's."""
        x, h = add_rms_norm(x, self.attention_output(i, o.to(x.dtype), decoding), self.weights.layers[i].ffn_norm,
                            self.config.rms_norm_eps)
        return torch.add(x, self.mlp(i, h, decoding), out=out)

    def logits(self, x: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        """x: [T, hidden] -> [T, vocab] float32. A stored head (on a CPU) takes a prompt's rows in
        float32 and a decode step's in 8 bits (decoding), as the CPU engine's (stored_matrix.py)."""
        h = rms_norm(x, self.weights.output_norm, self.config.rms_norm_eps)
        return linear(h, self.weights.output, eight_bit=decoding).float()

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, cache: DenseKVCache, start: int,
                last_only: bool = False, decoding: bool = False) -> torch.Tensor:
        """Run tokens at positions start.. through every layer, appending their K/V to cache.

        token_ids: [T] -> logits [T, vocab] (or [1, vocab] with last_only). decoding: a decode
        step's token (8-bit inputs to the stored matrices' products, the head's too).
        """
        end = start + token_ids.shape[0]
        positions = torch.arange(start, end, device=self.device)
        x = self.embed(token_ids.to(self.device))
        for i in range(self.config.num_layers):
            q, k, v = self.qkv(i, x, positions, decoding=decoding)
            cache.append(i, start, k, v)
            window = self.config.sliding_window if self.config.is_sliding(i) else 0
            x = self.residual_block(i, x, cache.attention(i, q, end, self.scale, window), decoding=decoding)
        if last_only:
            x = x[-1:]
        return self.logits(x, decoding)
