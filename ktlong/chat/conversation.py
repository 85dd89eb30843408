"""A chat conversation rendered with the model's template and kept within max_seq_len."""

from __future__ import annotations

from ktlong.gguf.chat_template import ChatTemplate
from ktlong.errors import KtlongError
from ktlong.gguf.tokenizer import GGUFTokenizer


class PromptTooLongError(KtlongError):
    pass


class Conversation:
    def __init__(self, tokenizer: GGUFTokenizer, template: ChatTemplate | None, system_prompt: str = ""):
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.turns: list[tuple[str, str]] = []  # finished (user, assistant) pairs

    def reset(self):
        self.turns = []

    def _messages(self, turns, user_text):
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for user, assistant in turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return messages + [{"role": "user", "content": user_text}]

    def render_ids(self, turns, user_text: str) -> list[int]:
        if self.template is None:
            return self.tokenizer.encode(user_text, parse_special=False)
        return self.tokenizer.encode(self.template.render(self._messages(turns, user_text)))

    def prompt_ids(self, user_text: str, max_seq_len: int, reserve: int) -> tuple[list[int], int]:
        """Ids for the next turn and how many old turns were dropped to leave `reserve` tokens."""
        dropped = 0
        ids = self.render_ids(self.turns, user_text)
        while len(ids) + reserve > max_seq_len and dropped < len(self.turns):
            dropped += 1
            ids = self.render_ids(self.turns[dropped:], user_text)
        if len(ids) >= max_seq_len:
            raise PromptTooLongError(
                f"The prompt is {len(ids):,} tokens but max_seq_len is {max_seq_len:,}; raise it with "
                f"--max_seq_len (up to what the model and memory allow) or shorten the prompt.")
        self.turns = self.turns[dropped:]
        return ids, dropped

    def add_turn(self, user_text: str, answer: str):
        self.turns.append((user_text, answer))
