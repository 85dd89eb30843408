"""What a model's weights hold in memory once loaded, known before any weight is read: the
memory plan's weights (ktlong/kv/memory_plan.py). Torch-free, as the CPU engine's loader is."""

from __future__ import annotations

import math

from cpu_ops.gguf_blocks import KERNEL_TYPES
from ktlong.gguf.model_config import ModelConfig
from ktlong.gguf.reader import GGUFFile

# the matrices a CPU keeps as stored where a kernel reads their type (ktlong/gguf/weights.TensorSource.matrix)
_MATRICES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
             "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "output.weight")


def held_bytes(gf: GGUFFile, config: ModelConfig, dtype_bytes: int, world: int = 1,
               compact: bool = False, stored: bool = False) -> int:
    """Bytes of load_weights' tensors: every tensor dequantised to dtype_bytes an element (a
    rank's share of the matrices where world > 1), except on a CPU in one process (compact) the
    embedding where it is read a row at a time and, where stored (cpu_stored_weights), the
    matrices of KERNEL_TYPES: the file's bytes."""
    if world > 1:
        return rank_elements(config, gf.num_weight_elements, world) * dtype_bytes
    stored = stored and compact

    def as_stored(name: str, ggml_type) -> bool:
        if name == "token_embd.weight":  # as load_weights decides
            return compact and (config.has_output_head or (stored and ggml_type in KERNEL_TYPES))
        return stored and ggml_type in KERNEL_TYPES and name.endswith(_MATRICES)

    return sum(t.num_bytes if as_stored(name, t.ggml_type) else math.prod(t.shape) * dtype_bytes
               for name, t in gf.tensors.items())


def rank_elements(c: ModelConfig, total_elements: int, world: int) -> int:
    """The weight elements one rank of the whole model c holds: the sharded matrices split, the
    rest (embedding, head, norms) whole on every rank."""
    sharded = c.num_layers * c.layer_matrix_elements
    return total_elements - sharded + sharded // world
