"""A path a user names, taken as one: ~ expanded, and a ~user of no user here or a name longer
than a file system allows refused in one sentence (pathlib's checks raise on such a path, where
they answer False on a missing one). Opening a file a user names, which must be a regular file:
a pipe would block the open or the read, a device (/dev/zero) would never end, a folder cannot be
read as one. Writing one whole: beside it (as .NAME.PID.XXXX.tmp), then renamed over it."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from ktlong.errors import KtlongError

NAME_MAX = 255  # bytes of one name in a path (Linux's file systems, macOS's)
PATH_MAX = 4096  # bytes of a whole path (Linux)


def user_path(text: str | os.PathLike) -> Path:
    """The path a user typed, ~ and ~user expanded; KtlongError where it begins with the ~user of
    no user here (kept as typed, it would name a folder "~user" to read or make), a name in it, or
    the whole, is longer than a file system takes, or it holds a NUL character."""
    typed = os.fspath(text)
    path = Path(os.path.expanduser(typed))
    full = str(path)
    shown = full if len(full) <= 80 else f"{full[:60]}...({len(full):,} characters)"
    if typed.startswith("~") and full.startswith("~"):
        user = typed[1:].split(os.sep, 1)[0]
        raise KtlongError(f"The path {shown} begins with ~{user}, but this machine has no user {user!r}; write "
                          "the path in full.")
    if "\0" in full:
        raise KtlongError(f"The path {shown!r} holds a NUL character; check the path.")
    longest = max((len(part.encode("utf-8", "surrogateescape")) for part in path.parts), default=0)
    if longest > NAME_MAX or len(full.encode("utf-8", "surrogateescape")) >= PATH_MAX:
        raise KtlongError(f"The path {shown} is longer than a file system takes ({NAME_MAX} bytes a name, "
                          f"{PATH_MAX:,} in all); check the path.")
    return path


class NotRegularFile(Exception):
    """What the path is instead, as the end of a sentence that begins with the path: "is a
    folder", "is not a regular file (a pipe or a device)", "does not exist (...)", "cannot be read (...)"."""


def open_regular(path: str | os.PathLike) -> tuple[BinaryIO, int]:
    """(the file opened for reading, its size in bytes), without waiting for a pipe's writer;
    NotRegularFile otherwise."""
    try:
        fd = os.open(user_path(path), os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise NotRegularFile(f"does not exist ({e.strerror})") from None
    except OSError as e:
        raise NotRegularFile(f"cannot be read ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile("is a folder" if stat.S_ISDIR(st.st_mode) else "is not a regular file (a pipe or a device)")
    return os.fdopen(fd, "rb"), st.st_size


class TooLarge(Exception):
    """The file holds more than the bytes allowed: size, its size when opened, or None where it
    grew past them while it was read."""

    def __init__(self, size: int | None):
        super().__init__(size)
        self.size = size


def read_regular(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of the regular file at path, refused before they are read where it is not one
    (NotRegularFile) or holds more than max_bytes (TooLarge: also a file that grows past them while
    it is read); OSError where the read fails."""
    f, size = open_regular(path)
    with f:
        if size > max_bytes:
            raise TooLarge(size)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(None)
    return data


def write_replacing(path: Path, write: Callable[[BinaryIO], None], durable: bool = False) -> None:
    """write(f) to a temporary file beside path, renamed over it: a reader never sees half a file,
    and a failed write leaves what was there. durable: the file and then its folder are synced, so
    the new file is on disk, under its name, when this returns (a power cut keeps one or the other)."""
    folder = path.resolve().parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
