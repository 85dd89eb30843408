"""What both dense sessions share (torch's, ktlong/session/dense.py, and the torch-free CPU
engine's, ktlong/session/cpu_dense.py): one KV cache holding a conversation's tokens, reused by
common prefix, a prompt prefilled in chunks, then a token at a time."""

from __future__ import annotations

import sys
import time
from typing import Callable

from ktlong.errors import Cancelled
from ktlong.session.prefix import cached_prefix
from ktlong.session.progress import prefill_progress

CHUNK_GPU, CHUNK_CPU = 8192, 512  # chunk_size 0's prompt tokens per prefill chunk


def resolve_chunk_size(chunk_size: int, block_size: int, device) -> int:
    """0: 8192 on a GPU; 512 on a CPU, llama.cpp's batch, where a chunk's activations sit in host
    memory beside the weights and the cache and a larger chunk gains little speed
    (docs/decisions.md). At least one block. device: a torch.device or its type's name."""
    if chunk_size:
        return chunk_size
    on_gpu = getattr(device, "type", device) == "cuda"
    return max(CHUNK_GPU if on_gpu else CHUNK_CPU, block_size)


class ChunkedSession:
    """Subclasses compute: `forward(ids, start)` runs a chunk at positions start.. into the cache
    and returns its last token's logits; `step(token)` appends one token."""
    max_seq_len: int
    chunk_size: int
    saves_cache = False  # a file of the dense cache is not offered: long-context mode saves its DRAM cache
    prefill_density = None  # no CompactAttention

    def __init__(self, max_seq_len: int, chunk_size: int):
        self.max_seq_len, self.chunk_size = max_seq_len, chunk_size
        self.ids: list[int] = []  # tokens whose K/V are in the cache, in order
        self.last_prefill_tokens = 0  # tokens the last prefill computed (the rest came from the cache)

    def forward(self, ids: list[int], start: int):
        raise NotImplementedError

    def reset(self):
        self.ids = []

    def warm_up(self, log=None):
        """Run a short prompt and one decode step, then forget them, behind one notice: on a CPU
        Numba compiles the attention and decode kernels on their first call (half a minute on a
        fresh install, loaded from its cache later), which would otherwise stop the first answer
        after its first word and count in its speed; a GPU's first products set up its
        libraries."""
        log = sys.stderr if log is None else log  # the stream of the moment, not the one at import
        print("[kernels that compile on first use:", end="", file=log, flush=True)
        start = time.perf_counter()
        self.prefill([0] * min(16, self.max_seq_len - 1))
        self.step(0)
        self.reset()
        print(f" ready in {time.perf_counter() - start:.1f} s, before anything is timed]", file=log, flush=True)

    def reusable(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of prompt_ids the cache holds, leaving the last to compute."""
        return cached_prefix(self.ids, prompt_ids)

    def prefill(self, prompt_ids: list[int], show_progress: bool = False,
                should_stop: Callable[[], bool] | None = None,
                on_progress: Callable[[int, int], None] | None = None, alone: bool = True,
                answer_room: int | None = None, short_launches: bool = False):
        """Make the cache hold exactly prompt_ids; return the last token's logits [vocab].
        should_stop is asked between chunks; when it says so, Cancelled is raised and the cache
        holds the chunks done so far. alone: always, here (a dense session decodes one
        conversation); answer_room, short_launches: nothing here depends on them."""
        assert len(prompt_ids) <= self.max_seq_len
        reuse = self.reusable(prompt_ids)
        todo = prompt_ids[reuse:]
        self.ids = list(prompt_ids[:reuse])
        self.last_prefill_tokens = len(todo)
        bar = prefill_progress(len(todo), show_progress and len(todo) > self.chunk_size)
        logits = None
        for start in range(0, len(todo), self.chunk_size):
            if should_stop is not None and should_stop():
                bar.close()
                raise Cancelled
            chunk = todo[start:start + self.chunk_size]
            logits = self.forward(chunk, len(self.ids))
            self.ids.extend(chunk)
            bar.update(len(chunk))
            if on_progress is not None:
                on_progress(len(self.ids) - reuse, len(todo))
        bar.close()
        return logits


def dense_session(model, config, max_seq_len: int) -> ChunkedSession:
    """Normal mode's session for a model, warmed up: the CPU engine's for a CpuLlama, else
    torch's (both with the config's chunk size and kv_type)."""
    from ktlong.models.cpu_llama import CpuLlama

    if isinstance(model, CpuLlama):
        from ktlong.session.cpu_dense import CpuDenseSession

        session = CpuDenseSession(model, max_seq_len, resolve_chunk_size(config.chunk_size, config.block_size, "cpu"))
    else:
        from ktlong.session.dense import DenseSession

        session = DenseSession.from_config(model, config, max_seq_len)
    session.warm_up()
    return session
