"""Input checks of the operators' entry points, as FlashInfer's wrappers check theirs: a wrong
rank, dtype, device or size is a ValueError naming the argument and what it should be, before
any kernel runs (a kernel given a wrong shape reads past its tensors, or fails far from the cause)."""

from __future__ import annotations

import torch


def expect(name: str, t: torch.Tensor, *, ndim: int | None = None, dtype: torch.dtype | tuple | None = None,
           device: torch.device | None = None, shape: tuple | None = None):
    """shape: the expected sizes, None for any size in that place."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        raise ValueError(f"{name} must have shape {tuple('*' if s is None else s for s in shape)}, "
                         f"got {tuple(t.shape)}")
