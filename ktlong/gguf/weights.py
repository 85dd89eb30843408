"""Read a llama-family model's tensors from GGUF, dequantised on the target device."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ktlong.gguf.dequant import SUPPORTED_TYPES, dequantize
from ktlong.errors import GGUFError
from ktlong.gguf.reader import GGUFFile
from ktlong.gguf.model_config import PERMUTED_QK_ARCHS, ModelConfig
from ktlong.gguf.int4_weights import INT4_TYPES, Int4Weight
from ktlong.gguf.stored_rows import StoredRows
from ktlong.gguf.stored_matrix import StoredMatrix
from cpu_ops.gguf_blocks import KERNEL_TYPES
from ktlong.parallel.shard import shard_columns, shard_rows


@dataclass(frozen=True)
class CpuWeights:
    """How a CPU in one process keeps a GGUF's quantised weights (elsewhere, on a GPU or a
    tensor-parallel rank, every weight is dequantised to the model's dtype)."""
    int4: bool = False  # cpu_int4: the layers' 4- and 5-bit matrices stay compact (int4 planes)
    bf16: bool = False  # cpu_bf16: the embedding, the head and BF16_TYPES matrices in bfloat16
    stored: bool = False  # matrices of KERNEL_TYPES stay as stored, multiplied in place (StoredMatrix)

    @classmethod
    def of(cls, config) -> "CpuWeights":
        return cls(config.cpu_int4, config.cpu_bf16)


def _trim_heap():
    """Give freed heap memory back to the OS. glibc keeps what large frees leave on its heap, so
    the transient float32 and int32 copies of a load (one matrix at a time) would otherwise stay
    resident as if they were all alive at once; a no-op without glibc's malloc_trim."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
HEAD_ROWS = 8192  # rows of the embedding / head dequantised at a time into bfloat16 (no float32 copy of it all)
# matrices of these types become bfloat16 under cpu_bf16: rounding moves a value by 2^-8 of it at
# most, under half a step where codes reach 127 steps (Q8_0), an eighth at 32 (Q6_K), less for Q3_K;
# float types keep dtype (no step to hide the rounding in), and Q2_K's offsets can outgrow its steps
BF16_TYPES = frozenset({T.Q8_0, T.Q6_K, T.Q3_K})


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    # the projections: float tensors, or Int4Weight where 4-bit weights stay 4-bit
    wq: torch.Tensor | Int4Weight  # [num_heads * head_dim, hidden]
    wk: torch.Tensor | Int4Weight  # [num_kv_heads * head_dim, hidden]
    wv: torch.Tensor | Int4Weight  # [num_kv_heads * head_dim, hidden]
    wo: torch.Tensor | Int4Weight  # [hidden, num_heads * head_dim]
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    ffn_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor | Int4Weight  # [intermediate, hidden]
    w_up: torch.Tensor | Int4Weight  # [intermediate, hidden]
    w_down: torch.Tensor | Int4Weight  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (gemma3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    post_attn_norm: torch.Tensor | None = None  # [hidden]
    post_ffn_norm: torch.Tensor | None = None  # [hidden]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor | StoredRows  # [vocab, hidden]; as stored on a CPU when the model has its own head
    layers: list[LayerWeights]
    output_norm: torch.Tensor  # [hidden]
    output: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    rope_freq_factors: torch.Tensor | None  # [rope_dim / 2], llama3-style scaling


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation (adjacent-pair RoPE -> half-split RoPE).

    w: [num_heads * head_dim, ...]; rows of a head go from (d/2, 2) order to (2, d/2).
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


class TensorSource:
    """Dequantises named tensors from a GGUF file onto one device, checking types first."""

    def __init__(self, gf: GGUFFile, device: torch.device, dtype: torch.dtype, int4: bool = False,
                 bf16: bool = False, stored: bool = False):
        """int4: matrices of a 4- or 5-bit type stay compact (ktlong/gguf/int4_weights.py); bf16:
        matrices of BF16_TYPES become bfloat16 (both the CPU only)."""
        self.gf, self.device, self.dtype, self.int4, self.bf16 = gf, device, dtype, int4, bf16
        self.stored = stored
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
        if shape is not None and info.shape != shape:
            raise GGUFError(f"{self.gf.path}: tensor {name} has shape {info.shape}, the metadata "
                            f"implies {shape}; the file is corrupt.")
        return info

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        info, raw = self._raw(name, shape)
        return dequantize(raw, info.ggml_type, info.shape, self.dtype)

    def matrix(self, name: str, shape: tuple[int, int], permuted_heads: int = 0) -> torch.Tensor | Int4Weight:
        """A projection's weight [out, in]: 4-bit where this source keeps 4-bit types so (int4),
        else dequantised. permuted_heads: undo llama.cpp's q/k row permutation over that many heads."""
        rows = (lambda t: unpermute_qk(t, permuted_heads)) if permuted_heads else (lambda t: t)
        info, raw = self._raw(name, shape)
        if self.stored and info.ggml_type in KERNEL_TYPES:
            return StoredMatrix(rows(raw.view(shape[0], -1)).contiguous(), info.ggml_type, shape)
        if self.int4 and info.ggml_type in INT4_TYPES:
            return Int4Weight.from_blocks(raw, info.ggml_type, shape, rows)
        dtype = torch.bfloat16 if self.bf16 and info.ggml_type in BF16_TYPES else self.dtype
        return rows(dequantize(raw, info.ggml_type, info.shape, self.dtype).to(dtype))

    def get_optional(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        return self.get(name, shape) if self.has(name) else None

    def stored_rows(self, name: str, shape: tuple[int, int]) -> StoredRows:
        """A [rows, hidden] table in its stored type, each row dequantised to dtype when read."""
        info, raw = self._raw(name, shape)
        self.gf.release_pages()  # copied: the file's pages need not stay beside the copy
        return StoredRows(raw, info.ggml_type, shape, self.dtype)

    def table(self, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A [rows, hidden] table (embedding, output head) in `dtype`, dequantised HEAD_ROWS rows
        at a time, so that a narrower dtype never holds the whole table in the wider one."""
        if self.stored and self.gf.tensors[name].ggml_type in KERNEL_TYPES:
            return self.matrix(name, shape)
        if dtype == self.dtype:
            return self.get(name, shape)
        info = self._info(name, shape)
        mapped = self.gf.raw(name)  # read a slice at a time: no copy of the whole table's bytes either
        out = torch.empty(shape, dtype=dtype, device=self.device)
        row_bytes = mapped.shape[0] // shape[0]
        for r0 in range(0, shape[0], HEAD_ROWS):
            r1 = min(r0 + HEAD_ROWS, shape[0])
            raw = torch.from_numpy(np.array(mapped[r0 * row_bytes:r1 * row_bytes])).to(self.device)
            out[r0:r1] = dequantize(raw, info.ggml_type, (r1 - r0, shape[1]), self.dtype)
            self.gf.release_pages()  # the slice's pages of the file, read
            _trim_heap()  # the slice's float32 garbage
        return out


def load_weights(gf: GGUFFile, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, shard: tuple[int, int] | None = None, cpu: CpuWeights = CpuWeights()) -> ModelWeights:
    """shard: (rank, world) keeps this rank's heads and MLP columns (ktlong/parallel/shard.py);
    config is the whole model's either way. cpu: what a CPU in one process keeps compact;
    elsewhere (a GPU, a rank's share) every weight is dequantised to dtype."""
    rank, world = shard or (0, 1)
    compact = device.type == "cpu" and world == 1
    bf16 = cpu.bf16 and compact and dtype == torch.float32
    src = TensorSource(gf, device, dtype, cpu.int4 and compact, bf16, cpu.stored and compact)
    head_dtype = torch.bfloat16 if bf16 else dtype

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
        gf.release_pages()  # the layer's bytes are copied: neither the file nor the copies' garbage stays resident
        _trim_heap()
    embed_type = gf.tensors["token_embd.weight"].ggml_type if "token_embd.weight" in gf.tensors else None
    tied_in_place = not c.has_output_head and src.stored and embed_type in KERNEL_TYPES
    if compact and (c.has_output_head or tied_in_place):  # read a row per token: kept as stored (ktlong/gguf/stored_rows.py)
        embed = src.stored_rows("token_embd.weight", (c.vocab_size, c.hidden_size))
    else:
        embed = src.table("token_embd.weight", (c.vocab_size, c.hidden_size), head_dtype)
    if c.has_output_head:
        output = src.table("output.weight", (c.vocab_size, c.hidden_size), head_dtype)
    elif tied_in_place:
        output = StoredMatrix(embed.rows, embed.ggml_type, embed.shape)
    else:
        output = embed
    gf.release_pages()
    _trim_heap()
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
