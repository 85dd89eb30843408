"""Load a GGUF model: config, tokenizer and weights from one file, into torch's model
(`load_model`) or the torch-free CPU engine's (`load_cpu_model`). torch is imported only by the
first, so a process that runs the CPU engine never holds it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ktlong.gguf.chat_template import ChatTemplate, template_for
from ktlong.gguf.reader import GGUFFile
from ktlong.gguf.model_config import ModelConfig, RopeOptions
from ktlong.gguf.registry import resolve_model_path
from ktlong.gguf.tokenizer import GGUFTokenizer

if TYPE_CHECKING:
    import torch

    from ktlong.gguf.weights import CpuWeights
    from ktlong.models.cpu_llama import CpuLlama
    from ktlong.models.llama import LlamaModel
    from ktlong.parallel.group import TensorParallel


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: GGUFTokenizer
    chat_template: ChatTemplate
    model: "LlamaModel | CpuLlama"
    weight_bytes: int  # what its weights hold (ktlong/gguf/held_bytes.py)


def default_dtype(device: "torch.device") -> "torch.dtype":
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def open_model(name_or_path: str | None, rope: RopeOptions = RopeOptions()) -> tuple[GGUFFile, ModelConfig]:
    """Open and check the file and its config without reading any weights. rope: the
    rope_scaling options over the GGUF's (they also set the context the model reaches)."""
    gf = GGUFFile(resolve_model_path(name_or_path))
    return gf, rope.apply(ModelConfig.from_gguf(gf))


def _tokenizer(gf: GGUFFile, chat_template: str | None) -> tuple[GGUFTokenizer, ChatTemplate]:
    """The tokenizer and chat template, then the parsed metadata dropped (the vocabulary's arrays
    need not sit beside the weights)."""
    tokenizer = GGUFTokenizer(gf)
    template = template_for(tokenizer, chat_template if chat_template is not None else tokenizer.chat_template)
    gf.forget_metadata()
    return tokenizer, template


def load_model(name_or_path: str | None, device: "str | torch.device" = "cpu",
               dtype: "torch.dtype | None" = None, rope: RopeOptions = RopeOptions(),
               tp: "TensorParallel | None" = None, chat_template: str | None = None,
               cpu: "CpuWeights | None" = None) -> LoadedModel:
    """torch's model. With tp, this rank's share of the heads and MLP columns; config and model
    are the rank's (ktlong/parallel/shard.py). chat_template: a template's source used instead of
    the GGUF's. cpu: what a CPU in one process keeps as stored (the cpu_stored_weights option)."""
    import torch

    from ktlong.gguf.held_bytes import held_bytes
    from ktlong.gguf.weights import CpuWeights, load_weights
    from ktlong.models.llama import LlamaModel
    from ktlong.parallel.shard import shard_config

    device = torch.device(device)
    dtype, cpu = dtype or default_dtype(device), cpu or CpuWeights()
    gf, config = open_model(name_or_path, rope)
    # refused here, before any weight is read, if it does not split
    rank_config = shard_config(config, tp.world) if tp is not None else config
    world = tp.world if tp is not None else 1
    size = held_bytes(gf, config, dtype.itemsize, world, device.type == "cpu", cpu.stored)
    tokenizer, template = _tokenizer(gf, chat_template)
    weights = load_weights(gf, config, device, dtype, (tp.rank, tp.world) if tp is not None else None, cpu)
    return LoadedModel(gf.path, rank_config, tokenizer, template, LlamaModel(rank_config, weights, tp), size)


def load_cpu_model(gf: GGUFFile, config: ModelConfig, chat_template: str | None = None) -> LoadedModel:
    """The CPU engine's model (ktlong/models/cpu_llama.py) from a file open_model opened, where
    cpu_llama.unsupported(gf, config) is None."""
    from ktlong.gguf.held_bytes import held_bytes
    from ktlong.models.cpu_llama import CpuLlama

    tokenizer, template = _tokenizer(gf, chat_template)
    size = held_bytes(gf, config, 4, compact=True, stored=True)
    return LoadedModel(gf.path, config, tokenizer, template, CpuLlama.from_gguf(gf, config), size)
