"""Numba CPU operators for sparse decode attention over the DRAM KV cache: KV storage types,
block anchors, block scoring and top-k, sparse attention with log-sum-exp. In: numpy arrays;
out: numpy arrays. Never imports ktlong.

The kernels are compiled once and kept in Numba's on-disk cache. Numba checks only the file of
the kernel it loads, not the helpers inlined into it from other files, so a change to
`kv_storage.py` would leave `sparse_attention`'s cached kernel stale. The cache therefore lives
in a folder named after a digest of every source file here (unless NUMBA_CACHE_DIR is set).
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
