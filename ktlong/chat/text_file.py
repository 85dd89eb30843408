"""Reading a text file a user names (a prompt, a text to score): its text, or one sentence
that says what to change."""

from __future__ import annotations

from pathlib import Path

from ktlong.errors import KtlongError


def read_text_file(path: str, flag: str) -> str:
    """The file's UTF-8 text without its trailing whitespace (an editor's final newline would
    otherwise end a user turn and change the answer; llama.cpp drops it too). flag: how the user
    named the file, e.g. "--prompt_file"."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise KtlongError(f"{flag} {path} is a folder; give a text file.")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise KtlongError(f"cannot read {flag} {path} ({e.strerror}); check the path.") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:  # a NUL byte: a binary file that happens to decode
        raise KtlongError(f"{flag} {path} is not UTF-8 text; give a text file.")
    text = text.rstrip()
    if not text:
        raise KtlongError(f"{flag} {path} is empty; give a file with the text in it.")
    return text
