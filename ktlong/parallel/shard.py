"""What one rank holds: its share of the query and kv heads (whole kv groups, so grouped-query
attention stays local) and of the MLP's intermediate columns. Refused before any weight is
read when the model does not split evenly."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ktlong.errors import ConfigError

if TYPE_CHECKING:  # the type only: parallel sits below gguf, whose weights it splits
    from ktlong.gguf.model_config import ModelConfig


def check_shardable(c: ModelConfig, world: int):
    for what, n in (("kv heads", c.num_kv_heads), ("attention heads", c.num_heads),
                    ("MLP columns", c.intermediate_size)):
        if n % world:
            raise ConfigError(f"This model's {n} {what} do not split over {world} ranks; use a "
                              f"--tensor_parallel that divides {n} (1 always works).")


def shard_config(c: ModelConfig, world: int) -> ModelConfig:
    """The model one rank sees: the same layers and width, 1/world of the heads and MLP columns."""
    check_shardable(c, world)
    return dataclasses.replace(c, num_heads=c.num_heads // world, num_kv_heads=c.num_kv_heads // world,
                               intermediate_size=c.intermediate_size // world)


def rank_slice(n: int, rank: int, world: int) -> slice:
    share = n // world
    return slice(rank * share, (rank + 1) * share)


def shard_rows(w: torch.Tensor | None, rank: int, world: int) -> torch.Tensor | None:
    """Output rows (q/k/v heads, gate/up columns, biases) of this rank, as their own tensor."""
    return None if w is None else w[rank_slice(w.shape[0], rank, world)].clone()


def shard_columns(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Input columns (the output projection's heads, down's intermediate) of this rank."""
    return w[:, rank_slice(w.shape[1], rank, world)].contiguous()
