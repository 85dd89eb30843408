"""A llama-family model on the CPU in numpy and Numba, without torch.

torch's import alone holds about 200 MB of a CPU process (its operator tables and modules), more
than a small model's weights and 4K cache together. This model needs none of it: its matrices
stay as the GGUF stores them (StoredMatrix), a prefill chunk's products dequantise each matrix
once and multiply with numpy's matmul, its attention is cpu_ops/chunk_attention.py over the
bfloat16 cache, and the small parts of a layer are the Numba row kernels of
cpu_ops/layer_pieces.py. A decode step is ktlong/models/cpu_decode.py, which torch's model
(LlamaModel) also uses on the CPU through `from_model`.

It covers what `unsupported` allows: the llama family (llama, mistral, qwen2, internlm2) with
every matrix and the embedding in a type the kernels read, norms and biases in a float type, a
bfloat16 cache. The engine choice is ktlong/session/startup.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numba as nb
import numpy as np
from gguf import GGMLQuantizationType as T
from threadpoolctl import threadpool_limits

from cpu_ops.chunk_attention import chunk_attention
from cpu_ops.gguf_blocks import KERNEL_TYPES
from cpu_ops.layer_pieces import add_rms_norm_rows, place_qkv_rows, silu_times_rows
from cpu_ops.workers import Workers
from ktlong.gguf.model_config import PERMUTED_QK_ARCHS, ModelConfig
from ktlong.gguf.reader import GGUFFile
from ktlong.gguf.stored_matrix import StoredMatrix, compile_kernels
from ktlong.kv.word_cache import WordCache
from ktlong.models.rope_frequencies import cos_sin, inverse_frequencies

VECTOR_TYPES = (T.F32, T.F16, T.BF16)  # norms and biases, widened to float32 once
PRODUCTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

Products = list[tuple[StoredMatrix, int]]  # products that fill one output row, and each one's first column


@dataclass(frozen=True)
class CpuLayer:
    attn_norm: np.ndarray  # [hidden] float32
    qkv: Products  # -> [(H + 2 KV) * D]: q, k, v side by side
    bias: np.ndarray  # [(H + 2 KV) * D] float32, or empty where the model has no q/k/v biases
    wo: StoredMatrix
    ffn_norm: np.ndarray
    gate_up: Products  # -> [2 intermediate]: gate, then up
    down: StoredMatrix


def products(parts: list[StoredMatrix]) -> Products:
    """One matrix of the parts' rows where they share a type (one kernel call), else the parts
    one after another, each with its first output column (a single part: itself)."""
    if len(parts) == 1:
        return [(parts[0], 0)]
    if len({p.ggml_type for p in parts}) == 1:
        return [(StoredMatrix.stacked(parts)[0], 0)]
    starts = np.cumsum([0] + [p.shape[0] for p in parts[:-1]])
    return list(zip(parts, starts.tolist()))


def unsupported(gf: GGUFFile, config: ModelConfig) -> str | None:
    """Why CpuLlama cannot run this model (None: it can), read from the header alone."""
    if config.has_qk_norm or config.has_post_norms or config.mlp_act != "silu" or config.sliding_window:
        return f"its architecture ({config.arch}) has parts the CPU engine lacks"
    names = [f"blk.{i}.{p}.weight" for i in range(config.num_layers) for p in PRODUCTS]
    names += ["token_embd.weight"] + (["output.weight"] if config.has_output_head else [])
    for name in names:
        if name not in gf.tensors:
            return f"it lacks {name}"
        if gf.tensors[name].ggml_type not in KERNEL_TYPES:
            return f"{name} is {gf.tensors[name].ggml_type.name}, which the CPU kernels do not read"
    for i in range(config.num_layers):
        if len({f"blk.{i}.attn_{x}.bias" in gf.tensors for x in "qkv"}) > 1:
            return f"layer {i} has biases for some of q, k and v only"
    norms = [f"blk.{i}.{p}.weight" for i in range(config.num_layers) for p in ("attn_norm", "ffn_norm")]
    for name in norms + ["output_norm.weight"]:
        if name not in gf.tensors:
            return f"it lacks {name}"
    biases = [f"blk.{i}.attn_{x}.bias" for i in range(config.num_layers) for x in "qkv"]
    for name in norms + biases + ["output_norm.weight", "rope_freqs.weight"]:
        if name in gf.tensors and gf.tensors[name].ggml_type not in VECTOR_TYPES:
            return f"{name} is {gf.tensors[name].ggml_type.name}, not a float type"
    return None


def vector(gf: GGUFFile, name: str, size: int) -> np.ndarray:
    """A float tensor of the file (F32, F16 or BF16) of `size` elements as a float32 array of its own."""
    gf.check_shape(name, (size,))
    raw, kind = gf.raw(name), gf.tensors[name].ggml_type
    if kind == T.F32:
        return np.array(raw.view(np.float32))
    if kind == T.F16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


class CpuLlama:
    def __init__(self, config: ModelConfig, layers: list[CpuLayer], embed_rows: Callable[[np.ndarray], np.ndarray],
                 final_norm: np.ndarray, head: StoredMatrix | Callable[[np.ndarray], np.ndarray],
                 inv_freq: np.ndarray, mscale: float):
        """embed_rows: token ids [n] -> their embeddings [n, hidden] float32. head: the output
        matrix, or a function from normalised rows [n, hidden] to logits [n, vocab]."""
        self.config, self.layers, self.embed_rows = config, layers, embed_rows
        self.final_norm, self.head = final_norm, head
        self.inv_freq, self.mscale = inv_freq, mscale
        self.scale = np.float32(config.head_dim ** -0.5)
        self.eps = np.float32(config.rms_norm_eps)
        self.workers = Workers(1)  # a prefill chunk's threads, as many as Numba's (forward)

    @classmethod
    def from_gguf(cls, gf: GGUFFile, config: ModelConfig) -> "CpuLlama":
        """Copy the weights out of the file (unsupported(gf, config) must be None), a layer at a
        time, dropping the file's pages as it goes."""
        c = config
        permuted = c.arch in PERMUTED_QK_ARCHS
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layers = []
        for i in range(c.num_layers):
            p = f"blk.{i}."

            def matrix(name, shape, heads=0):
                return StoredMatrix.from_gguf(gf, p + name + ".weight", shape, heads if permuted else 0)

            qkv = [matrix("attn_q", (q_dim, c.hidden_size), c.num_heads),
                   matrix("attn_k", (kv_dim, c.hidden_size), c.num_kv_heads),
                   matrix("attn_v", (kv_dim, c.hidden_size))]
            biases = [p + f"attn_{x}.bias" for x in "qkv"]
            bias = (np.concatenate([vector(gf, b, n) for b, n in zip(biases, (q_dim, kv_dim, kv_dim))])
                    if biases[0] in gf.tensors else np.zeros(0, np.float32))
            layers.append(CpuLayer(
                attn_norm=vector(gf, p + "attn_norm.weight", c.hidden_size), qkv=products(qkv), bias=bias,
                wo=matrix("attn_output", (c.hidden_size, q_dim)), ffn_norm=vector(gf, p + "ffn_norm.weight", c.hidden_size),
                gate_up=products([matrix("ffn_gate", (c.intermediate_size, c.hidden_size)),
                                  matrix("ffn_up", (c.intermediate_size, c.hidden_size))]),
                down=matrix("ffn_down", (c.hidden_size, c.intermediate_size))))
            gf.release_pages()
        embed = StoredMatrix.from_gguf(gf, "token_embd.weight", (c.vocab_size, c.hidden_size))
        head = StoredMatrix.from_gguf(gf, "output.weight", (c.vocab_size, c.hidden_size)) if c.has_output_head else embed
        factors = vector(gf, "rope_freqs.weight", c.rope.dim // 2) if "rope_freqs.weight" in gf.tensors else None
        final_norm = vector(gf, "output_norm.weight", c.hidden_size)
        gf.release_pages()
        every = [m for layer in layers for m, _ in (*layer.qkv, *layer.gate_up, (layer.wo, 0), (layer.down, 0))]
        compile_kernels([head, *every])
        return cls(config, layers, lambda ids: embed.rows(ids).float32(), final_norm, head,
                   *inverse_frequencies(config.rope, factors))

    def rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [T, rotated dims] at positions [T]."""
        return cos_sin(self.inv_freq, positions, self.mscale)

    def logits(self, normalised: np.ndarray) -> np.ndarray:
        """Rows after the final norm [n, hidden] -> logits [n, vocab] float32."""
        return self.head.product(normalised) if isinstance(self.head, StoredMatrix) else self.head(normalised)

    def forward(self, ids: list[int], cache: WordCache, start: int) -> np.ndarray:
        """Run tokens at positions start.. through every layer, writing their K/V into cache;
        returns the last one's logits [vocab] float32.

        The chunk's products and attention are shared out by Workers (cpu_ops/workers.py), as
        many as Numba's threads; each BLAS and Numba call meanwhile runs on one thread."""
        threads = nb.get_num_threads()
        if self.workers.count != threads:
            self.workers.close()
            self.workers = Workers(threads)
        nb.set_num_threads(1)
        try:
            with threadpool_limits(1, user_api="blas"):
                return self._forward(ids, cache, start)
        finally:
            nb.set_num_threads(threads)

    def _forward(self, ids: list[int], cache: WordCache, start: int) -> np.ndarray:
        c, workers = self.config, self.workers
        num = len(ids)
        end = start + num
        assert end <= cache.max_len, f"KV cache holds {cache.max_len} tokens, asked for {end}"
        x = self.embed_rows(np.asarray(ids, np.int64))
        cos, sin = self.rope(np.arange(start, end))
        h = np.empty_like(x)
        q = np.empty((num, c.num_heads, c.head_dim), np.float32)
        qkv = np.empty((num, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim), np.float32)
        gate_up = np.empty((num, 2 * c.intermediate_size), np.float32)
        act = np.empty((num, c.intermediate_size), np.float32)
        delta = np.zeros((0, c.hidden_size), np.float32)
        for i, w in enumerate(self.layers):
            add_rms_norm_rows(x, delta, w.attn_norm, self.eps, h)
            for matrix, first in w.qkv:
                matrix.product(h, qkv[:, first:first + matrix.shape[0]], workers)
            place_qkv_rows(qkv, w.bias, cos, sin, q, cache.keys[i], cache.values[i], start)
            o = chunk_attention(q, cache.keys[i], cache.values[i], end, self.scale, workers)
            add_rms_norm_rows(x, w.wo.product(o.reshape(num, -1), workers=workers), w.ffn_norm, self.eps, h)
            for matrix, first in w.gate_up:
                matrix.product(h, gate_up[:, first:first + matrix.shape[0]], workers)
            silu_times_rows(gate_up, act)
            delta = w.down.product(act, workers=workers)
        last = np.empty((1, c.hidden_size), np.float32)
        add_rms_norm_rows(x[-1:], delta[-1:], self.final_norm, self.eps, last)
        return self.logits(last)[0]
