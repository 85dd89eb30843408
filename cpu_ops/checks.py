"""Input checks of the Numba operators' entry points: a wrong rank, dtype or size is a
ValueError naming the argument, before a kernel indexes past an array."""

from __future__ import annotations

import numpy as np


def expect(name: str, a: np.ndarray, *, ndim: int | None = None, dtype=None, shape: tuple | None = None):
    """shape: the expected sizes, None for any size in that place."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {a.dtype}")
    if shape is not None and (a.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, a.shape))):
        raise ValueError(f"{name} must have shape {tuple('*' if s is None else s for s in shape)}, got {a.shape}")
