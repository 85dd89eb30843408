"""Read a llama-family model's tensors from GGUF: dequantised on the target device, or on a CPU
in one process kept as the file stores them where a Numba kernel multiplies them in place."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, fields

import numpy as np
import torch

from ktlong.gguf.dequant import SUPPORTED_TYPES, dequantize
from ktlong.errors import GGUFError
from ktlong.gguf.reader import GGUFFile
from ktlong.gguf.model_config import PERMUTED_QK_ARCHS, ModelConfig, unpermute_qk
from ktlong.gguf.stored_rows import StoredRows
from ktlong.gguf.stored_matrix import StoredMatrix, compile_kernels
from cpu_ops.gguf_blocks import KERNEL_TYPES
from ktlong.parallel.shard import shard_columns, shard_rows


@dataclass(frozen=True)
class CpuWeights:
    """How a CPU in one process keeps a GGUF's quantised weights (elsewhere, on a GPU or a
    tensor-parallel rank, every weight is dequantised to the model's dtype)."""
    stored: bool = False  # cpu_stored_weights: matrices of KERNEL_TYPES stay as stored (StoredMatrix)

    @classmethod
    def of(cls, config) -> "CpuWeights":
        return cls(config.cpu_stored_weights)


def _trim_heap():
    """Give freed heap memory back to the OS. glibc keeps what large frees leave on its heap, so
    the transient float32 and int32 copies of a load (one matrix at a time) would otherwise stay
    resident as if they were all alive at once; a no-op without glibc's malloc_trim."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    # the projections: float tensors, or StoredMatrix where a CPU keeps them as stored
    wq: torch.Tensor | StoredMatrix  # [num_heads * head_dim, hidden]
    wk: torch.Tensor | StoredMatrix  # [num_kv_heads * head_dim, hidden]
    wv: torch.Tensor | StoredMatrix  # [num_kv_heads * head_dim, hidden]
    wo: torch.Tensor | StoredMatrix  # [hidden, num_heads * head_dim]
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    ffn_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor | StoredMatrix  # [intermediate, hidden]
    w_up: torch.Tensor | StoredMatrix  # [intermediate, hidden]
    w_down: torch.Tensor | StoredMatrix  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (gemma3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    post_attn_norm: torch.Tensor | None = None  # [hidden]
    post_ffn_norm: torch.Tensor | None = None  # [hidden]
    # where q, k and v (gate and up) are of one kind: their rows in one matrix, multiplied in one
    # call (wq, wk, wv are views of it; fuse_projections)
    wqkv: torch.Tensor | StoredMatrix | None = None  # [(num_heads + 2 num_kv_heads) * head_dim, hidden]
    w_gate_up: torch.Tensor | StoredMatrix | None = None  # [2 intermediate, hidden]
    bqkv: torch.Tensor | None = None  # with wqkv, where q, k and v all have biases: bq, bk, bv are views of it


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor | StoredRows  # [vocab, hidden]; as stored on a CPU with its own head, or a head read in place
    layers: list[LayerWeights]
    output_norm: torch.Tensor  # [hidden]
    output: torch.Tensor | StoredMatrix  # [vocab, hidden]; the embedding itself (or its bytes) when tied
    rope_freq_factors: torch.Tensor | None  # [rope_dim / 2], llama3-style scaling


class TensorSource:
    """Dequantises named tensors from a GGUF file onto one device, checking types first."""

    def __init__(self, gf: GGUFFile, device: torch.device, dtype: torch.dtype, stored: bool = False):
        """stored: matrices of KERNEL_TYPES stay as the file stores them (a CPU only)."""
        self.gf, self.device, self.dtype, self.stored = gf, device, dtype, stored
        for info in gf.tensors.values():
            if info.ggml_type not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{gf.path}: tensor {info.name} has type {info.ggml_type.name}, which ktlong "
                    f"does not dequantise; supported: {', '.join(t.name for t in sorted(SUPPORTED_TYPES))} "
                    "(requantise the model with llama-quantize).")

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def _raw(self, name: str, shape: tuple[int, ...] | None):
        info = self._info(name, shape)
        return info, torch.from_numpy(np.array(self.gf.raw(name))).to(self.device)

    def _info(self, name: str, shape: tuple[int, ...] | None):
        info = self.gf.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.gf.path} lacks tensor {name}; the file is incomplete or not a "
                            f"{self.gf.architecture} model.")
        if shape is not None:
            self.gf.check_shape(name, shape)
        return info

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        info, raw = self._raw(name, shape)
        return dequantize(raw, info.ggml_type, info.shape, self.dtype)

    def matrix(self, name: str, shape: tuple[int, int], permuted_heads: int = 0) -> torch.Tensor | StoredMatrix:
        """A weight [out, in]: as stored where this source keeps its type so, else dequantised.
        permuted_heads: undo llama.cpp's q/k row permutation over that many heads (a row is whole
        blocks, so stored bytes reorder as rows too)."""
        rows = (lambda t: unpermute_qk(t, permuted_heads)) if permuted_heads else (lambda t: t)
        info = self._info(name, shape)
        if self.stored and info.ggml_type in KERNEL_TYPES:
            return StoredMatrix.from_gguf(self.gf, name, shape, permuted_heads)
        _, raw = self._raw(name, shape)
        return rows(dequantize(raw, info.ggml_type, info.shape, self.dtype))

    def get_optional(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        return self.get(name, shape) if self.has(name) else None

    def stored_rows(self, name: str, shape: tuple[int, int]) -> StoredRows:
        """A [rows, hidden] table in its stored type, each row dequantised to dtype when read."""
        info, raw = self._raw(name, shape)
        self.gf.release_pages()  # copied: the file's pages need not stay beside the copy
        return StoredRows(raw, info.ggml_type, shape, self.dtype)


def fuse_projections(layer: LayerWeights):
    """Give q, k, v and gate, up one matrix each where the parts are of one kind (float tensors
    of one dtype and device, or stored matrices of one type): their rows in one matrix,
    multiplied in one call, each part a view of its rows, so the bytes are held once
    (LayerWeights)."""
    layer.wqkv, (layer.wq, layer.wk, layer.wv) = _stacked([layer.wq, layer.wk, layer.wv])
    layer.w_gate_up, (layer.w_gate, layer.w_up) = _stacked([layer.w_gate, layer.w_up])
    biases = [layer.bq, layer.bk, layer.bv]
    if layer.wqkv is not None and all(b is not None for b in biases) and len({(b.dtype, b.device) for b in biases}) == 1:
        layer.bqkv = torch.cat(biases)
        layer.bq, layer.bk, layer.bv = layer.bqkv.split([b.shape[0] for b in biases])


def _stacked(parts: list) -> tuple:
    """(the parts' rows in one matrix, the parts as views of it), or (None, parts)."""
    if all(isinstance(p, StoredMatrix) for p in parts) and len({p.ggml_type for p in parts}) == 1:
        return StoredMatrix.stacked(parts)
    if all(isinstance(p, torch.Tensor) for p in parts) and len({(p.dtype, p.device, p.shape[1]) for p in parts}) == 1:
        whole = torch.cat(parts)
        return whole, list(whole.split([p.shape[0] for p in parts]))
    return None, parts


def load_weights(gf: GGUFFile, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, shard: tuple[int, int] | None = None, cpu: CpuWeights = CpuWeights()) -> ModelWeights:
    """shard: (rank, world) keeps this rank's heads and MLP columns (ktlong/parallel/shard.py);
    config is the whole model's either way. cpu: what a CPU in one process keeps compact;
    elsewhere (a GPU, a rank's share) every weight is dequantised to dtype."""
    rank, world = shard or (0, 1)
    compact = device.type == "cpu" and world == 1
    src = TensorSource(gf, device, dtype, cpu.stored and compact)

    def rows(w):
        return shard_rows(w, rank, world) if world > 1 else w

    def columns(w):
        return shard_columns(w, rank, world) if world > 1 else w

    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    permuted = c.arch in PERMUTED_QK_ARCHS
    layers = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        wq = src.matrix(p + "attn_q.weight", (q_dim, c.hidden_size), c.num_heads if permuted else 0)
        wk = src.matrix(p + "attn_k.weight", (kv_dim, c.hidden_size), c.num_kv_heads if permuted else 0)
        bq = src.get_optional(p + "attn_q.bias", (q_dim,))
        bk = src.get_optional(p + "attn_k.bias", (kv_dim,))
        if permuted:
            bq = unpermute_qk(bq, c.num_heads) if bq is not None else None
            bk = unpermute_qk(bk, c.num_kv_heads) if bk is not None else None
        layers.append(LayerWeights(
            attn_norm=src.get(p + "attn_norm.weight", (c.hidden_size,)),
            wq=rows(wq), wk=rows(wk),
            wv=rows(src.matrix(p + "attn_v.weight", (kv_dim, c.hidden_size))),
            wo=columns(src.matrix(p + "attn_output.weight", (c.hidden_size, q_dim))),
            bq=rows(bq), bk=rows(bk),
            bv=rows(src.get_optional(p + "attn_v.bias", (kv_dim,))),
            ffn_norm=src.get(p + "ffn_norm.weight", (c.hidden_size,)),
            w_gate=rows(src.matrix(p + "ffn_gate.weight", (c.intermediate_size, c.hidden_size))),
            w_up=rows(src.matrix(p + "ffn_up.weight", (c.intermediate_size, c.hidden_size))),
            w_down=columns(src.matrix(p + "ffn_down.weight", (c.hidden_size, c.intermediate_size))),
            q_norm=src.get(p + "attn_q_norm.weight", (c.head_dim,)) if c.has_qk_norm else None,
            k_norm=src.get(p + "attn_k_norm.weight", (c.head_dim,)) if c.has_qk_norm else None,
            post_attn_norm=src.get(p + "post_attention_norm.weight", (c.hidden_size,)) if c.has_post_norms else None,
            post_ffn_norm=src.get(p + "post_ffw_norm.weight", (c.hidden_size,)) if c.has_post_norms else None,
        ))
        fuse_projections(layers[-1])
        gf.release_pages()  # the layer's bytes are copied: neither the file nor the copies' garbage stays resident
        _trim_heap()
    embed_type = gf.tensors["token_embd.weight"].ggml_type if src.has("token_embd.weight") else None
    tied_in_place = not c.has_output_head and src.stored and embed_type in KERNEL_TYPES
    if compact and (c.has_output_head or tied_in_place):  # read a row per token: kept as stored (ktlong/gguf/stored_rows.py)
        embed = src.stored_rows("token_embd.weight", (c.vocab_size, c.hidden_size))
    else:
        embed = src.get("token_embd.weight", (c.vocab_size, c.hidden_size))
    if c.has_output_head:
        output = src.matrix("output.weight", (c.vocab_size, c.hidden_size))
    elif tied_in_place:  # the head multiplies the embedding's own bytes
        output = StoredMatrix(embed.rows.numpy(), embed.ggml_type, embed.shape)
    else:
        output = embed
    gf.release_pages()
    _trim_heap()
    if src.stored:
        every = (getattr(layer, f.name) for layer in layers for f in fields(layer))
        compile_kernels(m for m in (output, *every) if isinstance(m, StoredMatrix))
    freq_factors = src.get_optional("rope_freqs.weight")
    if freq_factors is not None:
        freq_factors = freq_factors.float()
    return ModelWeights(
        embed=embed,
        layers=layers,
        output_norm=src.get("output_norm.weight", (c.hidden_size,)),
        output=output,
        rope_freq_factors=freq_factors,
    )
