"""Next-token choice: greedy at temperature 0, else top-k / top-p sampling."""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        # logits: [vocab] float32
        if self.temperature == 0:
            return int(logits.argmax())
        logits = logits.float().cpu() / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > self.top_p
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
