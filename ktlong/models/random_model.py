"""Random-weight models of real shapes, built on the target device, for speed and memory runs."""

from __future__ import annotations

import torch

from ktlong.gguf.model_config import ModelConfig, RopeConfig
from ktlong.models.llama import LlamaModel
from ktlong.gguf.weights import LayerWeights, ModelWeights, fuse_projections
from ktlong.parallel.shard import shard_config

SHAPES = {
    "llama-3.1-8b": dict(num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                         num_kv_heads=8, head_dim=128, vocab_size=128256, context_length=131072,
                         rope=RopeConfig(base=500000.0, dim=128)),
    # Qwen2.5-0.5B's attention (14 q / 2 kv heads of 64): the packaged long-context model's shape
    "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, intermediate_size=4864, num_heads=14,
                         num_kv_heads=2, head_dim=64, vocab_size=151936, context_length=131072,
                         rope=RopeConfig(base=1000000.0, dim=64)),
    "tiny": dict(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                 num_kv_heads=2, head_dim=64, vocab_size=1000, context_length=1 << 20,
                 rope=RopeConfig(base=10000.0, dim=64)),
}


def random_config(name: str) -> ModelConfig:
    return ModelConfig(arch="llama", rms_norm_eps=1e-5, **SHAPES[name])


def num_weight_elements(c: ModelConfig) -> int:
    per_layer = 2 * c.hidden_size + c.layer_matrix_elements  # with the two norms
    head = c.vocab_size * c.hidden_size * (2 if c.has_output_head else 1)
    return c.num_layers * per_layer + head + c.hidden_size


def random_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, tp=None) -> LlamaModel:
    """tp: one rank's share of the heads and MLP columns (its own random values: for speed and
    memory, not for comparing logits across rank counts)."""
    c = random_config(name)
    if tp is not None:
        c = shard_config(c, tp.world)
        seed += 1000 * tp.rank
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * shape[-1] ** -0.5)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = [LayerWeights(attn_norm=ones(c.hidden_size), wq=w(q, c.hidden_size), wk=w(kv, c.hidden_size),
                           wv=w(kv, c.hidden_size), wo=w(c.hidden_size, q), bq=None, bk=None, bv=None,
                           ffn_norm=ones(c.hidden_size), w_gate=w(c.intermediate_size, c.hidden_size),
                           w_up=w(c.intermediate_size, c.hidden_size),
                           w_down=w(c.hidden_size, c.intermediate_size))
              for _ in range(c.num_layers)]
    for layer in layers:
        fuse_projections(layer)
    weights = ModelWeights(embed=w(c.vocab_size, c.hidden_size), layers=layers,
                           output_norm=ones(c.hidden_size), output=w(c.vocab_size, c.hidden_size),
                           rope_freq_factors=None)
    return LlamaModel(c, weights, tp)
