"""The evaluation's "transformers" arm: the same GGUF run by Hugging Face transformers (SDPA,
the model's own dtype, the same RoPE scaling), on the same prompt ids, through the same greedy
generation loop as ktlong's arms. It is the independent reference for the dense arm; transformers
is a test dependency, imported only when this arm is asked for.
"""

from __future__ import annotations

import torch

from ktlong.errors import KtlongError
from ktlong.models.loader import LoadedModel


def hf_rope_parameters(lm: LoadedModel, theta: float) -> dict:
    """transformers' rope_parameters for the RoPE scaling this model runs with."""
    rope = lm.config.rope
    if rope.scaling_type == "yarn":
        return {"rope_type": "yarn", "rope_theta": theta, "factor": rope.factor,
                "original_max_position_embeddings": rope.original_context_length,
                "beta_fast": rope.yarn_beta_fast, "beta_slow": rope.yarn_beta_slow}
    if rope.scaling_type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": rope.factor}
    return {"rope_type": "default", "rope_theta": theta}


class TransformersSession:
    """prefill / step / reset like ktlong's sessions, over a transformers model."""

    def __init__(self, lm: LoadedModel, max_seq_len: int):
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise KtlongError("--attention transformers needs the transformers package; "
                              "install the test extras (pip install -e '.[test]').") from None
        folder, name = str(lm.path.parent), lm.path.name
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        config.rope_parameters = hf_rope_parameters(lm, config.rope_parameters["rope_theta"])
        config.max_position_embeddings = max(config.max_position_embeddings, max_seq_len)
        self.device, dtype = lm.model.device, lm.model.dtype
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=dtype,
                                                          attn_implementation="sdpa").to(self.device).eval()
        self.max_seq_len = max_seq_len
        self.last_stats = None
        self.past = None

    def reset(self):
        self.past = None

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        out = self.model(torch.tensor([ids], device=self.device), past_key_values=self.past, use_cache=True,
                         logits_to_keep=1)
        self.past = out.past_key_values
        logits = out.logits[0, -1].float()
        if self.device.type == "cuda":  # the arms' prefill times count finished work
            torch.cuda.synchronize(self.device)
        return logits

    def prefill(self, ids: list[int], show_progress: bool = False, should_stop=None) -> torch.Tensor:
        self.past = None  # one forward: nothing to stop between
        return self._forward(ids)

    def step(self, token: int) -> torch.Tensor:
        return self._forward([token])
