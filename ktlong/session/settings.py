"""The long-context settings of a Config: CompactAttention for prefill, block selection for decode.

One place builds them, so local_chat, the evaluation and the benchmarks all honour the same
options. "dense" asks for exact attention through the same path.
"""

from __future__ import annotations

import dataclasses

from ktlong.config import Config
from ktlong.decode.selection import SelectionSettings
from operators.compact_attention import CompactParams


# evaluation arms: (prefill, decode) attention; the mixed ones tell which stage loses an answer
ARMS = {"dense": ("dense", "dense"), "sparse": ("sparse", "sparse"),
        "sparse-prefill": ("sparse", "dense"), "sparse-decode": ("dense", "sparse")}


def split_arm(attention: str | None) -> tuple[str | None, str]:
    """An arm's prefill and decode attention; None follows the config (prefill_attention, and
    decode's own selection options)."""
    return ARMS[attention] if attention is not None else (None, "sparse")


def options_of(settings_class, config: Config) -> dict:
    """The config's values of a settings dataclass whose fields are named after the options."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(settings_class)}


def compact_params(config: Config, attention: str | None = None) -> CompactParams | None:
    """CompactAttention settings, or None for dense prefill. attention: "dense" or "sparse"
    forces the choice (the evaluation compares the two); None follows prefill_attention."""
    if attention == "dense" or (attention is None and config.prefill_attention != "compact"):
        return None
    return CompactParams(**options_of(CompactParams, config))


def selection_settings(config: Config, num_layers: int, attention: str = "sparse") -> SelectionSettings:
    options = options_of(SelectionSettings, config)
    if attention == "dense":  # every block, every layer, read where context_attention reads them (a GPU's: the device)
        options.update(second_select_num=1 << 30, dense_layer_num=num_layers, preselect_block=False)
    return SelectionSettings(**options)
