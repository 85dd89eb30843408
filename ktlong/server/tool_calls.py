"""OpenAI tool calls over a model's own formats.

The chat template receives `tools` and renders them as the model was trained to read them; the
model answers with calls in its own format, which are parsed into OpenAI `tool_calls`:
- Qwen2.5 (and Hermes-style templates): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, or (as small Qwen models answer) the bare JSON object of one call;
- Llama 3.1: the answer is one JSON object `{"name": ..., "parameters": {...}}`, after an optional
  `<|python_tag|>`.
`tool_choice` "required" or a named function is enforced by opening the call in the prompt,
which the model continues; "none" renders no tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str

    def body(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(name, arguments, names) -> ToolCall | None:
    if name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), "call_" + uuid.uuid4().hex[:24])


class ToolFormat:
    """How one model family writes its calls: what opens one (the text a stream holds back from),
    how a forced call starts, and how the answer's calls are read."""
    opening = ""

    def forced(self, function: str | None) -> str:
        raise NotImplementedError

    def parse(self, text: str, names) -> tuple[str, list[ToolCall]]:
        """(the answer's text outside the calls, the calls of the functions named); text that
        does not parse as such a call stays text."""
        raise NotImplementedError


class HermesFormat(ToolFormat):
    opening, closing = "<tool_call>", "</tool_call>"

    def forced(self, function: str | None) -> str:
        head = self.opening + '\n{"name": '
        return head + json.dumps(function) + ', "arguments": ' if function else head + '"'

    def parse(self, text: str, names) -> tuple[str, list[ToolCall]]:
        bare = _json_call(text, "arguments", names)
        if bare is not None:
            return "", [bare]
        content, calls, rest = [], [], text
        while (start := rest.find(self.opening)) >= 0:
            end = rest.find(self.closing, start)
            body = rest[start + len(self.opening):end if end >= 0 else len(rest)]
            call = _json_call(body, "arguments", names)
            if call is None:  # not a call after all: the text stays the answer's
                content.append(rest[:end + len(self.closing)] if end >= 0 else rest)
                rest = rest[end + len(self.closing):] if end >= 0 else ""
                continue
            content.append(rest[:start])
            calls.append(call)
            rest = rest[end + len(self.closing):] if end >= 0 else ""
        content.append(rest)
        return "".join(content).strip() if calls else "".join(content), calls


class Llama31Format(ToolFormat):
    opening = "<|python_tag|>"

    def forced(self, function: str | None) -> str:
        return '{"name": ' + (json.dumps(function) + ', "parameters": ' if function else '"')

    def parse(self, text: str, names) -> tuple[str, list[ToolCall]]:
        call = _json_call(text.strip().removeprefix(self.opening), "parameters", names)
        return ("", [call]) if call is not None else (text, [])


def _json_call(text: str, arguments_key: str, names) -> ToolCall | None:
    """The call that text is, whole: a JSON object naming one of the functions, with its
    arguments (under arguments_key, or "arguments") as an object."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    return _call(obj.get("name"), obj.get(arguments_key, obj.get("arguments")), names)


def tool_format(template_source: str | None) -> ToolFormat | None:
    """The format a chat template's model calls tools in, or None for a template without tools."""
    source = template_source or ""
    if "tools" not in source:
        return None
    if "<tool_call>" in source:
        return HermesFormat()
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama31Format()
    return None


class ToolCallStream:
    """Streamed text with tool calls held back: text is passed on until what may open a call
    (the format's opening, or an answer that starts as a JSON object); from there on it is kept,
    and `finish` reads the calls out of it."""

    def __init__(self, fmt: ToolFormat, names, forced: str = ""):
        self.fmt, self.names, self.forced = fmt, tuple(names), forced
        self.text, self.sent = forced, 0
        self.holding = bool(forced)

    def push(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        at = self.text.find(self.fmt.opening, self.sent)
        if at >= 0 or self.text.lstrip().startswith("{"):  # an answer that opens as JSON may be a bare call
            self.holding = True
            at = at if at >= 0 else self.sent
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = _partial_suffix(self.text, self.fmt.opening)  # a piece may end inside the opening
        out, self.sent = self.text[self.sent:len(self.text) - keep], len(self.text) - keep
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the held-back text that is not a call, the calls)."""
        return self.fmt.parse(self.text[self.sent:], self.names)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
