"""Model definitions: they wire layers together (RoPE, attention projections, MLP) and own no
engine logic. In: weights and a ModelConfig; out: q/k/v, attention output, MLP, logits."""
