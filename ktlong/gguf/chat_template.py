"""Render a conversation with the model's own chat template (tokenizer.chat_template)."""

from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ktlong.errors import KtlongError

# Used when a GGUF carries no template: plain "role: text" turns.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source or FALLBACK_TEMPLATE)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise KtlongError(f"The model's chat template failed ({e}); pass --no_chat_template "
                              "to send the raw prompt.") from None
