"""RoPE frequencies with scaling equal transformers' implementations; GGUF metadata reaches them."""

import pytest
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


def qwen2_yarn_config():
    """Qwen2.5's documented YaRN setting, on Qwen2.5-Coder-0.5B's shapes (head_dim 64, theta 1e6)."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                       max_position_embeddings=32768,
                       rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})


def qwen2_gguf_config(context_length=32768):
    from ktlong.gguf.model_config import ModelConfig

    return ModelConfig(arch="qwen2", num_layers=24, hidden_size=896, intermediate_size=4864, num_heads=14,
                       num_kv_heads=2, head_dim=64, vocab_size=151936, context_length=context_length,
                       rms_norm_eps=1e-6, rope=RopeConfig(base=1e6, dim=64))


def test_yarn_option_on_a_qwen2_gguf_equals_transformers_qwen2_yarn():
    """rope_scaling: yarn, rope_scale: 4 over a GGUF without scaling: frequencies and attention
    scaling as transformers computes them for Qwen2.5's rope_scaling dict; context 131,072."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ktlong.gguf.model_config import RopeOptions

    ref, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](qwen2_yarn_config(), "cpu")
    c = RopeOptions("yarn", 4.0, 0).apply(qwen2_gguf_config())
    ours, mscale = inv_freq(c.rope)
    assert rel(ours, ref) < 1e-6 and abs(mscale - attention_factor) < 1e-9
    assert c.context_length == 131072 and c.rope.original_context_length == 32768


def test_rope_options_follow_llama_cpp():
    from ktlong.errors import ConfigError
    from ktlong.gguf.model_config import RopeOptions

    plain = qwen2_gguf_config()
    assert RopeOptions().apply(plain) is plain  # auto over a GGUF without scaling: nothing changes
    yarn = RopeOptions("yarn", 4.0, 16384).apply(plain)  # --yarn-orig-ctx overrides the trained context
    assert (yarn.rope.original_context_length, yarn.context_length) == (16384, 65536)
    linear = RopeOptions("linear", 2.0).apply(plain)
    assert (linear.rope.scaling_type, linear.rope.factor, linear.context_length) == ("linear", 2.0, 65536)
    # auto over a GGUF that says yarn keeps it, and reaches its extended context
    assert RopeOptions().apply(yarn).context_length == 65536
    assert RopeOptions(scale=8.0).apply(yarn).context_length == 131072
    back = RopeOptions("none").apply(yarn)  # none drops the GGUF's scaling and its extension
    assert (back.rope.scaling_type, back.context_length) == ("none", 16384)
    with pytest.raises(ConfigError, match="set rope_scale"):
        RopeOptions("yarn").apply(plain)
    with pytest.raises(ConfigError, match="set rope_scaling: yarn or linear"):
        RopeOptions(scale=4.0).apply(plain)


def test_yarn_logits_of_a_tiny_qwen2_equal_transformers(tmp_path):
    """A tiny qwen2 GGUF run 200 tokens past its 64 trained positions with YaRN x4: our dense
    forward against transformers' Qwen2 with the same rope_scaling (and far from it without)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from transformers import AutoModelForCausalLM

    from ktlong.models.loader import load_model
    from ktlong.gguf.model_config import RopeOptions
    from ktlong.kv.dense_cache import DenseKVCache
    from tests.tiny_gguf import TinySpec, write_tiny_gguf

    spec = TinySpec(arch="qwen2", qkv_bias=True, weight_type=T.F16, context=64)
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    config = hf.config
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": config.rope_parameters["rope_theta"],
                              "factor": 4.0, "original_max_position_embeddings": 64}
    hf_yarn = type(hf)(config).eval()
    hf_yarn.load_state_dict(hf.state_dict())
    lm = load_model(str(tmp_path / "m.gguf"), rope=RopeOptions("yarn", 4.0))
    assert lm.config.context_length == 256
    ids = [int(t) for t in np.random.default_rng(2).integers(0, spec.vocab, size=200)]
    c = lm.config
    cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), torch.device("cpu"), torch.float32)
    ours = lm.model.forward(torch.tensor(ids), cache, 0)
    with torch.no_grad():
        expected, unscaled = hf_yarn(torch.tensor([ids])).logits[0], hf(torch.tensor([ids])).logits[0]
    assert rel(ours, expected) < 1e-4 and rel(ours, unscaled) > 0.1
