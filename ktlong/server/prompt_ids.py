"""A request's text as token ids: messages rendered by the chat template, every text the client
wrote (message contents, tools, calls' names and arguments) encoded as text so that a special
token's name in it cannot forge a turn; and long texts counted a piece at a time, only until
they pass what the context holds."""

from __future__ import annotations

from ktlong.gguf.chat_template import ChatTemplate
from ktlong.gguf.text_cache import TextCache
from ktlong.gguf.tokenizer import GGUFTokenizer


def encode_messages(tokenizer: GGUFTokenizer, template: ChatTemplate, messages: list[dict],
                    tools: list | None = None, texts: TextCache | None = None) -> list[int]:
    """The rendered conversation's ids, each message's text encoded as plain text: a special
    token written in a message (`<|im_end|>`, say) stays text and cannot forge a turn, while the
    template's own markers are tokens. The template renders placeholders in place of the texts,
    and the pieces between them are encoded as the template's. Where that cannot give the ids of
    the whole (a tokenizer that starts every encoding with a space, a template that changes a
    text and so loses its placeholder), the whole is encoded with the texts' special tokens
    broken up (defused). texts: where the messages' texts are encoded, reusing the ids of long
    texts that earlier requests shared a prefix with."""
    plain = texts.encode if texts is not None else lambda t: tokenizer.encode(t, add_bos=False, parse_special=False)
    # what the template writes besides the texts (tools, calls' names and arguments, call ids)
    # is encoded as the template's own text: special tokens' names in it are broken up first
    tools = defused_strings(tokenizer, tools)
    messages = [{k: v if k in ("role", "content") else defused_strings(tokenizer, v) for k, v in m.items()}
                for m in messages]
    if not tokenizer.space_prefix:
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use code points
        rendered = template.render([{**m, "content": mark} for m, mark in zip(messages, marks)], tools=tools)
        ids, start = [], 0
        for mark, message in zip(marks, messages):
            at = rendered.find(mark, start)
            if at < 0:
                break
            ids += tokenizer.encode(rendered[start:at], add_bos=None if start == 0 else False)
            ids += plain(message["content"])
            start = at + len(mark)
        else:
            ids += tokenizer.encode(rendered[start:], add_bos=None if start == 0 else False)
            return ids
    return tokenizer.encode(template.render([{**m, "content": defused(tokenizer, m["content"])} for m in messages],
                                            tools=tools))


def defused(tokenizer: GGUFTokenizer, text: str) -> str:
    """text with every special token's name broken by a zero-width space after its first
    character, so that the tokenizer reads it as text."""
    for name in tokenizer.special_names:
        if len(name) > 1 and name in text:
            text = text.replace(name, name[0] + "\u200b" + name[1:])
    return text


def defused_strings(tokenizer: GGUFTokenizer, value):
    """value (JSON: objects, lists, strings, numbers) with every string and key defused."""
    if isinstance(value, str):
        return defused(tokenizer, value)
    if isinstance(value, list):
        return [defused_strings(tokenizer, v) for v in value]
    if isinstance(value, dict):
        return {defused(tokenizer, k): defused_strings(tokenizer, v) for k, v in value.items()}
    return value


# texts longer than max_seq_len tokens of this many characters are counted before they are encoded
# (real text averages 3 to 5 characters a token)
CHARS_PER_TOKEN_CHECKED = 8
PIECE_CHARS = 1 << 16


def count_tokens(tokenizer: GGUFTokenizer, texts: list[str], limit: int) -> int:
    """The tokens of texts, counted a piece of about PIECE_CHARS characters at a time (cut at a
    space, where the pre-tokenizers cut too), and only until the count passes limit."""
    count = 0
    for text in texts:
        start = 0
        while start < len(text) and count <= limit:
            end = start + PIECE_CHARS
            if end < len(text):
                space = text.rfind(" ", start + 1, end)
                end = space if space > start else end
            count += len(tokenizer.encode(text[start:end], add_bos=False, parse_special=False))
            start = end
    return count
