"""What the chat, the server and the evaluation ask of a session (dense or long-context): a
conversation's tokens in a KV cache, reused by common prefix, prefilled and then decoded one
token at a time. Logits are torch tensors from torch's model and numpy arrays from the CPU
engine (ktlong/models/cpu_llama.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch


class Session(Protocol):
    ids: list[int]  # the tokens whose K/V the cache holds, in order
    max_seq_len: int
    last_prefill_tokens: int  # tokens the last prefill computed (the rest came from the cache)

    @property
    def cache_bytes(self) -> int:
        """Bytes its KV cache holds (allocated for max_seq_len tokens)."""

    @property
    def prefill_density(self) -> float | None:
        """The fraction of history blocks CompactAttention kept in the last prefill (1.0 when it
        ran dense); None for a session without CompactAttention."""

    @property
    def saves_cache(self) -> bool:
        """Whether its KV cache can be saved to a file and loaded back (ktlong/session/saved_cache.py)."""

    def reset(self) -> None:
        """Forget the conversation."""

    def reusable(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of prompt_ids the cache holds, leaving at least the last to compute."""

    def prefill(self, prompt_ids: list[int], show_progress: bool = False,
                should_stop: Callable[[], bool] | None = None,
                on_progress: Callable[[int, int], None] | None = None,
                alone: bool = True, answer_room: int | None = None,
                short_launches: bool = False) -> "torch.Tensor | np.ndarray":
        """Make the cache hold prompt_ids; the last token's logits [vocab]. should_stop is asked
        between chunks; when it says so, Cancelled is raised. on_progress(done, total): the
        prompt tokens prefilled so far of those this prefill computes, after every chunk.
        alone: no other conversation decodes beside this one (its decode may get ready for that).
        answer_room: the most tokens the answer adds before the next prefill (None: up to
        max_seq_len), where the decode state is sized by it. short_launches: decode steps wait
        for its device work, so it keeps each launch short where it can."""

    def step(self, token_id: int) -> "torch.Tensor | np.ndarray":
        """Append one token; its logits [vocab]."""
