"""What a long-context session will be, decided from the config before any weight is read:
the KV type and layout, the memory plan (checked against the GPU budget and free DRAM), where
prefill's hidden states live, CUDA graphs and the decode threads.

local_chat, the evaluation, the benches and the server all take this one way:
`plan_session(...)`, then `LongContextSession.from_config(model, config, plan)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_ops.anchors import anchors_per_block
from cpu_ops.threads import set_decode_threads
from ktlong.config import Config
from ktlong.decode.device_anchors import scores_on_device
from ktlong.gguf.model_config import ModelConfig
from ktlong.kv.layout import KVLayout, model_kv_layout
from ktlong.kv.memory_plan import GIB, MemoryPlan, available_dram_bytes, check_plan, plan_memory
from ktlong.session.settings import selection_settings
from operators.kv_quant import QUANTIZED


@dataclass(frozen=True)
class SessionPlan:
    layout: KVLayout
    memory: MemoryPlan
    kv_type: str
    use_cuda_graph: bool
    max_seq_len: int
    budget_bytes: int
    is_gpu: bool
    local_windows_len: int  # the device window: local_windows_len, or all of a shorter max_seq_len

    def describe(self) -> str:
        return (f"[memory plan for max_seq_len {self.max_seq_len:,}, kv_type {self.kv_type}]\n"
                f"{self.memory.table()}")

    def check(self):
        """Refuse a plan that does not fit the GPU budget or free DRAM, naming what would fit."""
        check_plan(self.memory, self.budget_bytes, self.is_gpu, available_dram_bytes(), self.max_seq_len)


def resolve_kv_type(kv_type: str, dtype: torch.dtype) -> str:
    """auto: bf16, or fp32 when the model computes in float32 (CPU runs keep exact K/V)."""
    if kv_type != "auto":
        return kv_type
    return "fp32" if dtype == torch.float32 else "bf16"


def resolve_cuda_graph(use_cuda_graph: bool | str, device: torch.device) -> bool:
    """Graphs replay the long-context decode step on a GPU: auto and true mean on with CUDA."""
    return device.type == "cuda" and use_cuda_graph in (True, "auto")


def apply_threads(threads_num: int) -> int:
    """CPU threads of the decode operator (every core but one by default) and of torch."""
    if threads_num:
        torch.set_num_threads(threads_num)
    return set_decode_threads(threads_num)


def plan_session(config: Config, model_config: ModelConfig, num_weight_elements: int, max_seq_len: int,
                 device: torch.device, dtype: torch.dtype) -> SessionPlan:
    """Decide; `SessionPlan.check()` refuses what does not fit (callers print the plan first)."""
    local_windows_len = config.local_window_for(max_seq_len, model_config.sliding_window)
    apply_threads(config.threads_num)
    kv_type = resolve_kv_type(config.kv_type, dtype)
    page_type = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    layout = model_kv_layout(model_config, config.block_size, max_seq_len, kv_type, local_windows_len,
                             page_type if kv_type in QUANTIZED else None, config.anchor_type, config.anchor_num)
    budget = int(config.gpu_memory_budget_gb * GIB)
    is_gpu = device.type == "cuda"
    selection = selection_settings(config, model_config.num_layers)
    on_device = scores_on_device(selection, device)
    anchors = anchors_per_block(config.anchor_type, config.anchor_num) if on_device else 0
    memory = plan_memory(model_config, num_weight_elements, dtype.itemsize, layout, config.chunk_size, budget,
                         is_gpu, local_windows_len, anchors)
    return SessionPlan(layout, memory, kv_type, resolve_cuda_graph(config.use_cuda_graph, device), max_seq_len,
                       budget, is_gpu, local_windows_len)
