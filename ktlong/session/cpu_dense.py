"""Normal mode on the CPU engine (ktlong/models/cpu_llama.py): a bfloat16 cache of numpy words,
prefill chunks through CpuLlama.forward, decode steps through CpuDecodeStep; logits are numpy
arrays."""

from __future__ import annotations

import numpy as np

from ktlong.kv.word_cache import WordCache
from ktlong.models.cpu_decode import CpuDecodeStep
from ktlong.models.cpu_llama import CpuLlama
from ktlong.session.chunked import ChunkedSession


class CpuDenseSession(ChunkedSession):
    def __init__(self, model: CpuLlama, max_seq_len: int, chunk_size: int):
        super().__init__(max_seq_len, chunk_size)
        c = model.config
        self.model = model
        self.cache = WordCache.zeros(c.num_layers, c.num_kv_heads, c.head_dim, max_seq_len)
        self.decode = CpuDecodeStep(model, self.cache)

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def forward(self, ids: list[int], start: int) -> np.ndarray:
        return self.model.forward(ids, self.cache, start)

    def step(self, token_id: int) -> np.ndarray:
        """Append one token; return its logits [vocab]."""
        logits = self.decode(token_id, len(self.ids))
        self.ids.append(token_id)
        return logits
