"""Turn the `device` and `dtype` options into torch objects, and tell a CPU-only machine without
importing torch (the CPU engine's process never holds it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ktlong.errors import ConfigError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def no_gpu_driver() -> bool:
    """True where this Linux machine has no NVIDIA driver's device files, so no CUDA GPU; False
    wherever only torch can tell."""
    if not sys.platform.startswith("linux"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return not (Path("/dev/nvidiactl").exists() or (gpus.is_dir() and any(gpus.iterdir())))


def device_type(name: str) -> str:
    """'cpu' or 'cuda' for the device option, importing torch only where a GPU may be present."""
    if name == "cpu" or (name == "auto" and no_gpu_driver()):
        return "cpu"
    return resolve_device(name).type


def resolve_device(name: str) -> "torch.device":
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device is '{name}' but this machine has no CUDA GPU; use --device cpu.")
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.index is not None and device.index >= count:
        have = "one GPU, cuda:0" if count == 1 else f"GPUs cuda:0 to cuda:{count - 1}"
        raise ConfigError(f"device is '{name}' but this machine has {have}; name one of them.")
    return device


def resolve_dtype(name: str, device: "torch.device") -> "torch.dtype":
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
