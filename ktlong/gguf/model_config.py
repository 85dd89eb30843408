"""Model hyperparameters read from GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ktlong.errors import ConfigError, GGUFError
from ktlong.gguf.reader import GGUFFile

# llama.cpp's converter permutes q/k rows of these architectures for its adjacent-pair RoPE;
# the loader undoes that so every model uses the half-split (NeoX) rotation.
PERMUTED_QK_ARCHS = frozenset({"llama"})
SUPPORTED_ARCHS = frozenset({"llama", "qwen2", "gemma3"})


def unpermute_qk(w, num_heads: int):
    """Undo llama.cpp's row permutation (adjacent-pair RoPE -> half-split RoPE).

    w: [num_heads * head_dim, ...], a tensor or an array; rows of a head go from (d/2, 2) order
    to (2, d/2).
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer is global, the others slide (llama.cpp's setting)
GEMMA3_LOCAL_ROPE_BASE = 10000.0


@dataclass(slots=True)
class RopeConfig:
    base: float = 10000.0
    dim: int = 0
    scaling_type: str = "none"  # none, linear, yarn; llama3 comes as a rope_freqs tensor
    factor: float = 1.0
    original_context_length: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attn_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class RopeOptions:
    """The options rope_scaling, rope_scale and yarn_orig_ctx, with llama.cpp's meaning
    (--rope-scaling, --rope-scale, --yarn-orig-ctx): what overrides the GGUF's RoPE scaling."""
    scaling: str = "auto"  # auto (the GGUF's) | none | linear | yarn
    scale: float = 0.0  # context scaling factor; 0: the GGUF's
    orig_ctx: int = 0  # YaRN's original context; 0: the GGUF's

    @classmethod
    def of(cls, config) -> "RopeOptions":
        """From a ktlong Config."""
        return cls(config.rope_scaling, config.rope_scale, config.yarn_orig_ctx)

    def apply(self, c: "ModelConfig") -> "ModelConfig":
        """The model config these options give: its RoPE scaling, and the context it reaches
        (the original context times the factor for linear and yarn; the trained one for none)."""
        gguf = c.rope
        if self == RopeOptions() and gguf.scaling_type == "none":
            return c
        kind = gguf.scaling_type if self.scaling == "auto" else self.scaling
        if kind == "none":
            if self.scale:
                raise ConfigError(f"rope_scale {self.scale:g} needs a scaling method and this model has none; "
                                  "set rope_scaling: yarn or linear.")
            trained = gguf.original_context_length if gguf.scaling_type != "none" else 0
            return dataclasses.replace(c, rope=dataclasses.replace(gguf, scaling_type="none", factor=1.0),
                                       context_length=trained or c.context_length)
        factor = self.scale or (gguf.factor if gguf.scaling_type == kind else 0.0)
        if factor <= 1.0:
            raise ConfigError(f"rope_scaling {kind} needs a factor above 1 and the model gives none; "
                              "set rope_scale (4 extends Qwen2.5's 32,768 to 131,072).")
        original = self.orig_ctx or gguf.original_context_length or c.context_length
        rope = dataclasses.replace(gguf, scaling_type=kind, factor=factor, original_context_length=original)
        return dataclasses.replace(c, rope=rope, context_length=max(int(original * factor),
                                                                    c.context_length if self.scaling == "auto" else 0))


@dataclass(slots=True)
class ModelConfig:
    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    has_qkv_bias: bool = False
    has_output_head: bool = True  # False: the output head is tied to the embedding
    rope: RopeConfig = field(default_factory=RopeConfig)
    # gemma3: q/k norms, post norms, GELU-tanh MLP, scaled embeddings, sliding-window layers
    has_qk_norm: bool = False
    has_post_norms: bool = False
    mlp_act: str = "silu"  # silu | gelu_tanh
    embed_scale: float = 1.0
    sliding_window: int = 0  # 0: no sliding-window layers
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = attends to the last sliding_window tokens
    rope_local_base: float = 0.0  # RoPE base of sliding layers (0: same as global)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    @property
    def num_groups(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def layer_matrix_elements(self) -> int:
        """Elements of one layer's projection matrices: q, k, v, o and the MLP's gate, up, down."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv + 3 * self.intermediate_size)

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "ModelConfig":
        arch = gf.architecture
        if arch not in SUPPORTED_ARCHS:
            raise GGUFError(f"{gf.path}: architecture '{arch}' is not supported; supported: "
                            f"{', '.join(sorted(SUPPORTED_ARCHS))} (convert internlm2 to llama).")

        def key(name, default=None):
            value = gf.get(f"{arch}.{name}", default)
            if value is None:
                raise GGUFError(f"{gf.path} lacks '{arch}.{name}'; convert it with a recent llama.cpp.")
            return value

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        num_kv_heads = int(key("attention.head_count_kv", num_heads))
        head_dim = int(gf.get(f"{arch}.attention.key_length", hidden // num_heads))
        embd = gf.tensors.get("token_embd.weight")
        if embd is None:
            raise GGUFError(f"{gf.path} has no token_embd.weight tensor; the file is incomplete.")
        vocab_size = int(gf.get(f"{arch}.vocab_size", embd.shape[0]))
        if num_heads % num_kv_heads:
            raise GGUFError(f"{gf.path}: {num_heads} query heads do not split over {num_kv_heads} kv heads.")
        rope = RopeConfig(
            base=float(key("rope.freq_base", 10000.0)),
            dim=int(key("rope.dimension_count", head_dim)),
        )
        scaling = gf.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear", "yarn"):
            raise GGUFError(f"{gf.path}: RoPE scaling '{scaling}' is not supported (none, linear, yarn).")
        rope.scaling_type = scaling
        rope.factor = float(gf.get(f"{arch}.rope.scaling.factor", 1.0))
        rope.original_context_length = int(gf.get(f"{arch}.rope.scaling.original_context_length", 0))
        rope.yarn_beta_fast = float(gf.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0))
        rope.yarn_beta_slow = float(gf.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))
        rope.yarn_attn_factor = float(gf.get(f"{arch}.rope.scaling.attn_factor", 1.0))
        num_layers = int(key("block_count"))
        gemma = arch == "gemma3"
        window = int(gf.get(f"{arch}.attention.sliding_window", 0)) if gemma else 0
        return cls(
            has_qk_norm=gemma, has_post_norms=gemma, mlp_act="gelu_tanh" if gemma else "silu",
            embed_scale=float(hidden) ** 0.5 if gemma else 1.0, sliding_window=window,
            sliding_layers=tuple((i + 1) % GEMMA3_SLIDING_PATTERN != 0 for i in range(num_layers)) if window else (),
            rope_local_base=GEMMA3_LOCAL_ROPE_BASE if gemma else 0.0,
            arch=arch,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab_size,
            context_length=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            has_qkv_bias="blk.0.attn_q.bias" in gf.tensors,
            has_output_head="output.weight" in gf.tensors,
            rope=rope,
        )
