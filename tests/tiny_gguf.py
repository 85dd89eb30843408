"""Write small random GGUF models with gguf.GGUFWriter, as llama.cpp's converter lays them out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.quants import quantize

# byte-level BPE vocabulary over the 256 byte symbols, enough for tokenizer metadata
_BYTE_SYMBOLS = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + \
    [chr(c) for c in range(174, 256)]
_BYTE_SYMBOLS += [chr(256 + i) for i in range(256 - len(_BYTE_SYMBOLS))]


@dataclass
class TinySpec:
    arch: str = "llama"
    num_layers: int = 2
    hidden: int = 64
    intermediate: int = 96
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 300
    context: int = 512
    rope_base: float = 10000.0
    eps: float = 1e-5
    qkv_bias: bool = False
    tied: bool = False
    weight_type: T = T.Q8_0
    sliding_window: int = 0  # gemma3 only


def write_tiny_gguf(path: Path, spec: TinySpec, seed: int = 0,
                    tensor_types: dict[str, T] | None = None, metadata=None) -> dict[str, np.ndarray]:
    """Write the model; return the float32 arrays as stored (after quantisation round trip).
    metadata: optional callable that adds more keys to the GGUFWriter."""
    rng = np.random.default_rng(seed)
    s = spec
    w = GGUFWriter(str(path), s.arch)
    w.add_block_count(s.num_layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_rope_freq_base(s.rope_base)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(s.eps)
    if s.arch == "gemma3":
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_sliding_window(s.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = _BYTE_SYMBOLS + [f"<t{i}>" for i in range(s.vocab - 258)] + ["<|im_start|>", "<|im_end|>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * (s.vocab - 2) + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(s.vocab - 2)
    w.add_eos_token_id(s.vocab - 1)
    if metadata is not None:
        metadata(w)

    stored: dict[str, np.ndarray] = {}

    def add(name, shape, scale=0.2, kind=None):
        kind = (tensor_types or {}).get(name, kind or s.weight_type)
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("norm.weight"):
            data = 1.0 + 0.1 * data
        if kind == T.F32 or len(shape) == 1:
            w.add_tensor(name, data)
            stored[name] = data
        elif kind == T.F16:
            w.add_tensor(name, data.astype(np.float16))
            stored[name] = data.astype(np.float16).astype(np.float32)
        else:
            from gguf.quants import dequantize
            q = quantize(data, kind)
            w.add_tensor(name, q, raw_dtype=kind)
            stored[name] = dequantize(q, kind).reshape(shape)

    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    add("token_embd.weight", (s.vocab, s.hidden), 1.0)
    for i in range(s.num_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (s.hidden,))
        add(p + "attn_q.weight", (q_dim, s.hidden))
        add(p + "attn_k.weight", (kv_dim, s.hidden))
        add(p + "attn_v.weight", (kv_dim, s.hidden))
        if s.qkv_bias:
            add(p + "attn_q.bias", (q_dim,))
            add(p + "attn_k.bias", (kv_dim,))
            add(p + "attn_v.bias", (kv_dim,))
        add(p + "attn_output.weight", (s.hidden, q_dim))
        if s.arch == "gemma3":
            add(p + "attn_q_norm.weight", (s.head_dim,))
            add(p + "attn_k_norm.weight", (s.head_dim,))
            add(p + "post_attention_norm.weight", (s.hidden,))
            add(p + "post_ffw_norm.weight", (s.hidden,))
        add(p + "ffn_norm.weight", (s.hidden,))
        add(p + "ffn_gate.weight", (s.intermediate, s.hidden))
        add(p + "ffn_up.weight", (s.intermediate, s.hidden))
        add(p + "ffn_down.weight", (s.hidden, s.intermediate))
    add("output_norm.weight", (s.hidden,))
    if not s.tied:
        add("output.weight", (s.vocab, s.hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def tiny_model(folder: Path, spec: TinySpec, seed: int = 0):
    """Write the tiny model into folder and load it (float32, CPU)."""
    from ktlong.models.loader import load_model

    path = Path(folder) / "tiny.gguf"
    write_tiny_gguf(path, spec, seed=seed)
    return load_model(str(path))
