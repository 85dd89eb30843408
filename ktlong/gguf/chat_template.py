"""Render a conversation with the model's own chat template (tokenizer.chat_template)."""

from __future__ import annotations

import json
from datetime import datetime

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


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """JSON as templates written for transformers expect it: not HTML-escaped (jinja's own
    tojson escapes <, > and &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self.source = source  # None: the model has no template (FALLBACK_TEMPLATE renders)
        self.template = env.from_string(source or FALLBACK_TEMPLATE)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        except TemplateError as e:
            raise KtlongError(f"The model's chat template failed ({e}); pass --no_chat_template "
                              "to send the raw prompt.") from None
