"""RoPE frequencies with scaling equal transformers' implementations; GGUF metadata reaches them."""

import torch

from ktlong.gguf.model_config import RopeConfig
from ktlong.models.rope import apply_rope, inv_freq, rope_cos_sin


def hf_config(**rope):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=32768,
                       rope_parameters=rope)


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_yarn_equals_transformers():
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    ref, attention_factor = _compute_yarn_parameters(hf_config(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=8192,
        beta_fast=32.0, beta_slow=1.0), "cpu")
    ours, mscale = inv_freq(RopeConfig(base=1e6, dim=128, scaling_type="yarn", factor=4.0,
                                       original_context_length=8192))
    assert rel(ours, ref) < 1e-6 and abs(mscale - attention_factor) < 1e-9


def test_linear_equals_transformers():
    from transformers.modeling_rope_utils import _compute_linear_scaling_rope_parameters

    ref, _ = _compute_linear_scaling_rope_parameters(hf_config(rope_type="linear", rope_theta=1e4, factor=2.0), "cpu")
    ours, mscale = inv_freq(RopeConfig(base=1e4, dim=128, scaling_type="linear", factor=2.0))
    assert rel(ours, ref) < 1e-6 and mscale == 1.0


def test_llama3_rope_freqs_tensor_equals_transformers():
    # llama.cpp stores Llama 3.1's scaling as per-frequency divisors in the rope_freqs tensor
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    ref, _ = _compute_llama3_parameters(hf_config(
        rope_type="llama3", rope_theta=5e5, factor=8.0, original_max_position_embeddings=8192,
        low_freq_factor=1.0, high_freq_factor=4.0), "cpu")
    plain, _ = inv_freq(RopeConfig(base=5e5, dim=128))
    ours, _ = inv_freq(RopeConfig(base=5e5, dim=128), (plain.double() / ref.double()).float())
    assert rel(ours, ref) < 1e-6


def test_rotation_preserves_norm_and_relative_position():
    inv, _ = inv_freq(RopeConfig(base=1e4, dim=64))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 64, generator=g), torch.randn(1, 2, 64, generator=g)
    dots = []
    for shift in (0, 37):
        cq, sq = rope_cos_sin(inv, torch.tensor([5 + shift]))
        ck, sk = rope_cos_sin(inv, torch.tensor([2 + shift]))
        qr, kr = apply_rope(q, cq, sq), apply_rope(k, ck, sk)
        assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
        dots.append((qr * kr).sum(-1))
    assert torch.allclose(dots[0], dots[1], atol=1e-4)  # depends on 5 - 2 only


def test_gguf_rope_scaling_metadata_is_read(tmp_path):
    from gguf import RopeScalingType

    from ktlong.gguf.reader import GGUFFile
    from ktlong.gguf.model_config import ModelConfig
    from tests.tiny_gguf import TinySpec, write_tiny_gguf

    def yarn(w):
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(128)

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TinySpec(), metadata=yarn)
    rope = ModelConfig.from_gguf(GGUFFile(path)).rope
    assert (rope.scaling_type, rope.factor, rope.original_context_length) == ("yarn", 4.0, 128)
