"""What torchrun's environment says of this process, read without importing torch."""

from __future__ import annotations

import os


def quiet_unless_main():
    """Under torchrun, ranks other than 0 print nothing (they run the same program and would say
    the same); a crash still reaches the terminal."""
    import sys
    import traceback

    if launched_rank() == 0:
        return
    sys.stdout = sys.stderr = open(os.devnull, "w")
    sys.excepthook = lambda kind, value, tb: traceback.print_exception(kind, value, tb, file=sys.__stderr__)


def launched_world() -> int:
    """How many processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank among them (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))
