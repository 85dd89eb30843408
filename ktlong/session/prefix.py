"""How much of a new prompt a session's cache already holds."""

from __future__ import annotations


def cached_prefix(cached_ids: list[int], prompt_ids: list[int]) -> int:
    """The length of the common prefix of the cached tokens and the prompt, leaving at least the
    prompt's last token to compute (its logits are the answer's first). A follow-up extends the
    conversation: one list comparison tells, where a token-by-token loop took 9 ms at 128K."""
    common = min(len(cached_ids), len(prompt_ids))
    if cached_ids[:common] != prompt_ids[:common]:
        common = next(i for i, (a, b) in enumerate(zip(cached_ids, prompt_ids)) if a != b)
    return max(0, min(common, len(prompt_ids) - 1))
