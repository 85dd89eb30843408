"""How much of a new prompt a session's cache already holds."""

from __future__ import annotations

from ktlong.gguf.text_cache import common_prefix


def cached_prefix(cached_ids: list[int], prompt_ids: list[int]) -> int:
    """The length of the common prefix of the cached tokens and the prompt, leaving at least the
    prompt's last token to compute (its logits are the answer's first)."""
    return max(0, min(common_prefix(cached_ids, prompt_ids), len(prompt_ids) - 1))
