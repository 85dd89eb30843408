"""Dense generation state: one contiguous KV cache, reused across turns by common prefix."""

from __future__ import annotations

from typing import Callable

import torch
from tqdm import tqdm

from ktlong.errors import Cancelled
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.models.cpu_decode import CpuDecodeStep, supports as cpu_decode_supports
from ktlong.models.llama import LlamaModel
from ktlong.session.prefix import cached_prefix


class DenseSession:
    def __init__(self, model: LlamaModel, max_seq_len: int, chunk_size: int, kv_dtype: torch.dtype | None = None):
        """kv_dtype: what the cache stores (resolve_dense_kv_dtype); None keeps the model's dtype."""
        c = model.config
        self.model, self.max_seq_len, self.chunk_size = model, max_seq_len, chunk_size
        self.cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_seq_len,
                                  model.device, kv_dtype or model.dtype)
        # a token at a time on the CPU: numpy and Numba calls only, where the model allows (cpu_decode.py)
        self.cpu_step = CpuDecodeStep(model, self.cache) if cpu_decode_supports(model, self.cache) else None
        self.ids: list[int] = []  # tokens whose K/V are in the cache, in order
        self.last_prefill_tokens = 0  # tokens the last prefill computed (the rest came from the cache)

    @classmethod
    def from_config(cls, model: LlamaModel, config, max_seq_len: int) -> "DenseSession":
        """Normal mode's session: the config's chunk size and kv_type (resolved in plan.py)."""
        from ktlong.session.plan import resolve_chunk_size, resolve_dense_kv_dtype

        return cls(model, max_seq_len, resolve_chunk_size(config.chunk_size, config.block_size, model.device),
                   resolve_dense_kv_dtype(config.kv_type, model.device, model.dtype))

    saves_cache = False  # a file of the dense cache is not offered: long-context mode saves its DRAM cache
    prefill_density = None  # no CompactAttention

    @property
    def cache_bytes(self) -> int:
        return 2 * self.cache.k.numel() * self.cache.k.element_size()

    def reset(self):
        self.ids = []

    def reusable(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of prompt_ids the cache holds, leaving the last to compute."""
        return cached_prefix(self.ids, prompt_ids)

    def prefill(self, prompt_ids: list[int], show_progress: bool = False,
                should_stop: Callable[[], bool] | None = None,
                on_progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Make the cache hold exactly prompt_ids; return the last token's logits [vocab].
        should_stop is asked between chunks; when it says so, Cancelled is raised and the cache
        holds the chunks done so far."""
        assert len(prompt_ids) <= self.max_seq_len
        reuse = self.reusable(prompt_ids)
        todo = prompt_ids[reuse:]
        self.ids = list(prompt_ids[:reuse])
        self.last_prefill_tokens = len(todo)
        bar = tqdm(total=len(todo), unit="tok", desc="prefill", leave=False,
                   disable=not show_progress or len(todo) <= self.chunk_size)
        logits = None
        for start in range(0, len(todo), self.chunk_size):
            if should_stop is not None and should_stop():
                bar.close()
                raise Cancelled
            chunk = todo[start:start + self.chunk_size]
            logits = self.model.forward(torch.tensor(chunk), self.cache, len(self.ids), last_only=True)
            self.ids.extend(chunk)
            bar.update(len(chunk))
            if on_progress is not None:
                on_progress(len(self.ids) - reuse, len(todo))
        bar.close()
        return logits[-1]

    def step(self, token_id: int) -> torch.Tensor:
        """Append one token; return its logits [vocab]."""
        if self.cpu_step is not None:
            logits = self.cpu_step(token_id, len(self.ids))
        else:
            logits = self.model.forward(torch.tensor([token_id]), self.cache, len(self.ids), last_only=True)[-1]
        self.ids.append(token_id)
        return logits
