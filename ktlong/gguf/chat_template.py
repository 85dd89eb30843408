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
            raise KtlongError(f"The model's chat template failed ({e}); pass --set use_chat_template=false to "
                              "send the raw prompt, or --chat_template_file FILE.") from None


MAX_TEMPLATE_BYTES = 1 << 20  # templates are kilobytes; a larger file is not one


def read_chat_template(path: str) -> str:
    """A chat template file's text, refused in one sentence when it cannot be one: missing, too
    large, not UTF-8, or not Jinja that compiles."""
    from ktlong.regular_file import user_path

    file = user_path(path)
    try:
        if file.stat().st_size > MAX_TEMPLATE_BYTES:
            raise KtlongError(f"Chat template {file} is larger than 1 MiB; name a Jinja chat template file.")
        source = file.read_text(encoding="utf-8")
        ChatTemplate(source)  # compiles it
    except OSError as e:
        raise KtlongError(f"Cannot read chat template {file} ({e.strerror or e}); check --chat_template_file.") from None
    except UnicodeDecodeError:
        raise KtlongError(f"Chat template {file} is not UTF-8 text; name a Jinja chat template file.") from None
    except TemplateError as e:
        raise KtlongError(f"Chat template {file} is not valid Jinja ({e}); fix it or drop --chat_template_file.") from None
    return source


def configured_template(path: str) -> str | None:
    """The chat_template_file option's template source (read_chat_template), or None where the
    option is empty: the GGUF's template."""
    return read_chat_template(path) if path else None


def template_for(tokenizer, source: str | None) -> ChatTemplate:
    """The template with the tokenizer's bos and eos tokens, as transformers passes them."""
    text = tokenizer.token_text
    return ChatTemplate(source, bos_token=text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
                        eos_token=text(tokenizer.eos_id) if tokenizer.eos_id is not None else "")
