"""Reading a text file a user names (a prompt, a text to score): its text, or one sentence
that says what to change."""

from __future__ import annotations

from ktlong.errors import KtlongError
from ktlong.regular_file import NotRegularFile, TooLarge, read_regular

# bytes of text a prompt of max_seq_len tokens may take: real text runs 3 to 5 bytes a token,
# so four times that leaves room for any document that can fit
BYTES_PER_TOKEN = 16
MAX_TEXT_BYTES = 256 << 20  # when no max_seq_len is known yet
HINTS = {"is a folder": "give a text file",
         "is not a regular file (a pipe or a device)": "save the text to a file and give that"}


def max_text_bytes(max_seq_len: int) -> int:
    """The largest file read as a prompt for max_seq_len tokens (0: not known yet)."""
    return max_seq_len * BYTES_PER_TOKEN if max_seq_len > 0 else MAX_TEXT_BYTES


def read_text_file(path: str, flag: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The file's UTF-8 text without its trailing whitespace (an editor's final newline would
    otherwise end a user turn and change the answer; llama.cpp drops it too). flag: how the user
    named the file, e.g. "--prompt_file". Only a regular file of at most max_bytes is read (a
    pipe, a device or a folder is refused before anything is read)."""
    try:
        data = read_regular(path, max_bytes)
    except NotRegularFile as e:
        raise KtlongError(f"{flag} {path} {e}; {HINTS.get(str(e), 'check the path')}.") from None
    except TooLarge as e:
        if e.size is None:  # it grew while it was read
            raise KtlongError(f"{flag} {path} is more than {max_bytes / 2**20:,.1f} MiB of text, more than this "
                              "session's max_seq_len can hold; give a shorter file.") from None
        raise KtlongError(f"{flag} {path} is {e.size / 2**20:,.1f} MiB, more than this session's max_seq_len can "
                          f"hold ({max_bytes / 2**20:,.1f} MiB of text); give a shorter file.") from None
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
