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
