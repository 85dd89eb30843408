"""What memory is free, and normal mode's one check against it: its whole KV cache, before any
weight is read. Imports no torch (the CPU engine's process checks it too)."""

from __future__ import annotations

from ktlong.errors import ConfigError
from ktlong.gguf.model_config import ModelConfig
from ktlong.kv.word_cache import padded_length

GIB = 1 << 30


def available_dram_bytes(field: str = "MemAvailable") -> int:
    """Free DRAM (or, with field MemTotal, all of it) as /proc/meminfo says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_dense_cache(c: ModelConfig, max_seq_len: int, element_bytes: int, free_bytes: int, where: str):
    """Normal mode's KV cache (keys and values of every layer for max_seq_len tokens, in whole
    blocks), refused before any weight is read where it alone is more than the free memory: an
    allocation that large fails with a traceback, or takes what the weights need."""
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * element_bytes
    need = per_token * padded_length(max_seq_len)
    if need > free_bytes:
        fits = free_bytes // per_token // 1024 * 1024
        elsewhere = ", or use --mode long_context (the cache in DRAM)" if where != "DRAM" else ""
        raise ConfigError(f"Normal mode's KV cache for max_seq_len {max_seq_len:,} needs {need / GIB:,.1f} GiB of "
                          f"{where} but {free_bytes / GIB:,.1f} GiB is free; lower max_seq_len to about "
                          f"{fits:,}{elsewhere}.")
