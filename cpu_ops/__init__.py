"""Numba CPU operators for sparse decode attention over the DRAM KV cache: KV storage types,
block anchors, block scoring and top-k, sparse attention with log-sum-exp. In: numpy arrays;
out: numpy arrays. Never imports ktlong.

The kernels are compiled once and kept in Numba's on-disk cache. Numba checks only the file of
the kernel it loads, not the helpers inlined into it from other files, so a change to
`kv_storage.py` would leave `sparse_attention`'s cached kernel stale. The cache therefore lives
in a folder named after a digest of every source file here (unless NUMBA_CACHE_DIR is set).
Kernels made per storage or weight type (closures) are named apart (`named_for`).
"""

import hashlib
import os
from pathlib import Path

import numba


def _kernel_cache_dir() -> Path:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for source in sorted(here.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ktlong" / "numba"
    return base / digest.hexdigest()[:16]


if not os.environ.get("NUMBA_CACHE_DIR"):
    numba.config.CACHE_DIR = str(_kernel_cache_dir())


def named_for(kind: str):
    """A decorator, under Numba's: the kernel's name gets its type's, so Numba's cache gives each
    type an index file of its own. Closures made per type share one name, hence one index, and
    Numba updates an index without a lock (it reads it, takes the first free data file number,
    writes it back): two processes compiling two types at once lose an entry, or give both the
    same data file, so a later process would run one type's code for the other's."""

    def rename(fn):
        fn.__name__, fn.__qualname__ = f"{fn.__name__}_{kind}", f"{fn.__qualname__}_{kind}"
        return fn

    return rename
