"""What the commands (chat, server, evaluation, benches) share: how a refusal is printed,
how counts and lengths are checked and read, how a table is printed."""

from __future__ import annotations

import sys

from ktlong.errors import KtlongError


def print_error(error: Exception) -> None:
    """A refusal, from every rank: a quiet rank's own sentence still reaches the terminal, since
    torchrun may stop rank 0 before it prints when another rank fails first."""
    from ktlong.parallel.launch import launched_rank

    rank = launched_rank()
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        print(f"error (rank {rank}): {error}", file=sys.__stderr__, flush=True)


def in_range(flag: str, value: int, low: int, high: int, what: str) -> int:
    """value, or one sentence that refuses it: `flag` is `what`, from low to high."""
    if not low <= value <= high:
        raise KtlongError(f"{flag} is {what}, from {low:,} to {high:,} (got {value:,}).")
    return value


def interrupted(kept: str = "") -> int:
    """Ctrl-C before a command's work ended (loading, a prefill, a bench's runs): one line, not
    Python's traceback, with what was kept if anything, and status 130 as a shell gives a
    command its SIGINT ended."""
    print(f"\n[interrupted{': ' + kept if kept else ''}]", file=sys.stderr, flush=True)
    return 130


def parse_lengths(text: str) -> list[int]:
    """'32k,128k,1m' -> [32768, 131072, 1048576]."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            scale = {"k": 1 << 10, "m": 1 << 20}.get(item[-1:], 1)
            value = int(float(item.rstrip("km")) * scale)
        except ValueError:
            value = 0
        if value <= 0:
            raise KtlongError(f"length {item!r} in {text!r} is not a token count; write lengths like 4096,32k,1m.")
        out.append(value)
    return out


def print_table(headers: list[str], rows: list[list]):
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
