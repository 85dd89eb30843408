"""Errors a user can cause and fix; their message is one sentence that says what to change."""


class KtlongError(Exception):
    """Base of every user-facing error; local_chat and the CLIs print it without a traceback."""


class GGUFError(KtlongError):
    """The GGUF file is missing, corrupt, truncated or of a kind we do not support."""


class ConfigError(KtlongError):
    """A configuration key or value is wrong."""


class ModelNotFoundError(KtlongError):
    """A named model is not installed."""


class Cancelled(Exception):
    """The caller asked a prefill to stop (a client went away); not an error of the user's."""


def first_line(e: BaseException, limit: int = 160) -> str:
    """An exception's first line of text (its type's name where it has none), at most `limit`
    characters: the reason in a one-line notice of something that fell back."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__
