"""What a long-context session will be, decided from the config before any weight is read, in
one frozen object: the KV type and layout, the memory plan (checked against the GPU budget and
free DRAM), where prefill's hidden states live, CompactAttention's settings and the attention
backend, decode's selection (where blocks are scored and who reads them), CUDA graphs and the
decode threads. Every `auto` is resolved here and nowhere else.

local_chat, the evaluation, the benches and the server all take this one way:
`plan_session(...)`, `apply_threads(plan.threads, plan.torch_threads)`, then `LongContextSession.from_plan(model, plan)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cpu_ops.anchors import anchors_per_block
from cpu_ops.threads import decode_threads, set_decode_threads
from ktlong.config import Config
from ktlong.decode.device_anchors import scores_on_device
from ktlong.decode.dram_blocks import resolve_context_attention
from ktlong.decode.selection import SelectionSettings
from ktlong.errors import KtlongError
from ktlong.gguf.model_config import ModelConfig
from ktlong.kv.layout import KVLayout, model_kv_layout
from ktlong.kv.free_memory import available_dram_bytes
from ktlong.kv.memory_plan import GIB, MemoryPlan, check_plan, plan_memory
from ktlong.prefill import resolve_backend
from ktlong.session.chunked import resolve_chunk_size
from ktlong.session.settings import compact_params, selection_settings, split_arm
from ktlong.session.sliced_prefill import green_contexts_supported, prefill_sms
from operators.compact_attention import CompactParams
from operators.kv_quant import QUANTIZED


@dataclass(frozen=True)
class SessionPlan:
    """Everything a long-context session will run, every `auto` of the config resolved: the
    session, its prefill and decoder and the memory plan take their settings from here, never
    from the config."""
    device: torch.device
    dtype: torch.dtype
    layout: KVLayout
    memory: MemoryPlan
    kv_type: str
    use_cuda_graph: bool
    max_seq_len: int
    budget_bytes: int
    is_gpu: bool
    local_windows_len: int  # the device window: local_windows_len, or all of a shorter max_seq_len
    chunk_size: int
    attention_backend: str  # fa2 | fa3 | torch
    compact: CompactParams | None  # None: dense prefill
    selection: SelectionSettings  # block_scoring device | cpu; context_attention cpu | gpu
    threads: int  # the decode operator's CPU threads (apply_threads sets them at start-up)
    torch_threads: int  # torch's, when threads_num asks for a number; 0: torch's own default
    resident_history: bool
    max_num_seqs: int  # conversations decoded together, each sized by the memory plan
    prefill_sms: int  # the SMs a prefill runs on beside decode steps (decode_sm_share); 0: every SM

    def describe(self) -> str:
        s, c = self.selection, self.compact
        prefill = (f"compact ({c.selector}, keep_blocks {c.keep_blocks}, dense_above {c.dense_above}, "
                   f"{c.prefill_dense_layer_num} dense layers)" if c is not None else "dense")
        lines = [f"[plan for max_seq_len {self.max_seq_len:,} on {self.device} ({str(self.dtype).removeprefix('torch.')})]",
                 f"  prefill: {prefill}, chunk {self.chunk_size}, attention backend {self.attention_backend}"
                 + ((f"; beside decode steps on {self.prefill_sms} SMs" if self.prefill_sms
                    else "; beside decode steps in turns with them") if self.is_gpu else ""),
                 f"  KV cache: {self.kv_type} in DRAM, block {self.layout.block_size}, device window "
                 f"{self.local_windows_len} tokens"
                 + ("; the sliding-window layers keep only the prompt's last "
                    f"{self.layout.sliding_blocks * self.layout.block_size:,} tokens, so a follow-up prefills the whole "
                    "conversation again (normal mode reuses it)" if self.layout.sliding else ""),
                 f"  decode: top {s.second_select_num} blocks by {s.anchor_type} anchors ({s.head_select_mode}), "
                 f"scored on the {'GPU' if s.block_scoring == 'device' and self.is_gpu else 'CPU'}, read by the "
                 f"{'GPU' if s.context_attention == 'gpu' else 'CPU operator'}; CUDA graphs "
                 f"{'on' if self.use_cuda_graph else 'off'}; {self.threads} CPU thread{'s' if self.threads > 1 else ''}"
                 + (f"; up to {self.max_num_seqs} conversations a step" if self.max_num_seqs > 1 else ""),
                 self.memory.table()]
        return "\n".join(lines)

    def check(self):
        """Refuse a plan that does not fit the GPU budget or free DRAM, naming what would fit."""
        check_plan(self.memory, self.budget_bytes, self.is_gpu, available_dram_bytes(), self.max_seq_len)


def resolve_kv_type(kv_type: str, dtype: torch.dtype) -> str:
    """auto: bf16, or fp32 when the model computes in float32 (CPU runs keep exact K/V)."""
    if kv_type != "auto":
        return kv_type
    return "fp32" if dtype == torch.float32 else "bf16"


def resolve_dense_kv_dtype(kv_type: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Normal mode's cache. auto: the model's dtype on a GPU; bfloat16 on the CPU, where a decode
    step reads the whole cache (half of float32's bytes, and the Numba operator reads it in place).
    Quantised types are long-context mode's; normal mode refuses them."""
    if kv_type in QUANTIZED:
        raise KtlongError(f"kv_type {kv_type} is for --mode long_context; normal mode stores bf16, fp16 or fp32: "
                          f"set kv_type to one of them or auto.")
    if kv_type == "auto":
        return dtype if device.type == "cuda" else torch.bfloat16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kv_type]


def resolve_cuda_graph(use_cuda_graph: bool | str, device: torch.device) -> bool:
    """Graphs replay the long-context decode step on a GPU: auto and true mean on with CUDA."""
    return device.type == "cuda" and use_cuda_graph in (True, "auto")


def resolve_block_scoring(block_scoring: str, device: torch.device) -> str:
    """auto: the device on a GPU, else the CPU."""
    if block_scoring != "auto":
        return block_scoring
    return "device" if device.type == "cuda" else "cpu"


def kept_blocks(selection: SelectionSettings, num_layers: int) -> int:
    """Blocks per kv head and layer the device keeps from the last tokens (ktlong/decode/dram_blocks.py):
    those it reads, where it reads the selected blocks; none where every layer is dense (the
    evaluation's dense arm), which keeps slots for sparse layers only."""
    if selection.context_attention != "gpu" or selection.dense_layer_num >= num_layers:
        return 0
    return selection.second_select_num


def resolve_selection(settings: SelectionSettings, device: torch.device, layout: KVLayout | None) -> SelectionSettings:
    """block_scoring (resolve_block_scoring), and context_attention: auto is the GPU where its
    kernel reads the layout's blocks (ktlong/decode/dram_blocks.py), and on the CPU it is always
    cpu. layout: needed only to resolve context_attention's auto."""
    where = resolve_context_attention(settings.context_attention, device, layout)
    return dataclasses.replace(settings, block_scoring=resolve_block_scoring(settings.block_scoring, device),
                               context_attention=where)


def resolve_prefill_sms(share: float, device: torch.device) -> int:
    """decode_sm_share: the SMs a prefill beside decode steps runs on (ktlong/session/sliced_prefill.py),
    on a GPU where torch makes green contexts; 0 (every SM) elsewhere, which the plan's prefill
    line says on a GPU."""
    if device.type != "cuda" or not share or not green_contexts_supported():
        return 0
    return prefill_sms(share, torch.cuda.get_device_properties(device).multi_processor_count)


def apply_threads(threads: int, torch_threads: int = 0):
    """The start-up step that sets the CPU threads: the decode operator's, and torch's when a
    number was asked for (0 leaves torch's default, every core)."""
    if torch_threads:
        torch.set_num_threads(torch_threads)
    set_decode_threads(threads)


def plan_session(config: Config, model_config: ModelConfig, weight_bytes: int, max_seq_len: int,
                 device: torch.device, dtype: torch.dtype, attention: str | None = None) -> SessionPlan:
    """Decide; `SessionPlan.check()` refuses what does not fit (callers print the plan first).
    attention: an evaluation arm (ktlong/session/settings.ARMS); None follows the config."""
    local_windows_len = config.local_window_for(max_seq_len, model_config.sliding_window)
    kv_type = resolve_kv_type(config.kv_type, dtype)
    page_type = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    layout = model_kv_layout(model_config, config.block_size, max_seq_len, kv_type, local_windows_len,
                             page_type if kv_type in QUANTIZED else None, config.anchor_type, config.anchor_num)
    budget = int(config.gpu_memory_budget_gb * GIB)
    is_gpu = device.type == "cuda"
    prefill, decode = split_arm(attention)
    selection = resolve_selection(selection_settings(config, model_config.num_layers, decode), device, layout)
    anchors = anchors_per_block(config.anchor_type, config.anchor_num) if scores_on_device(selection) else 0
    chunk_size = resolve_chunk_size(config.chunk_size, config.block_size, device)
    memory = plan_memory(model_config, weight_bytes, dtype.itemsize, layout, chunk_size, budget,
                         is_gpu, local_windows_len, anchors, config.max_num_seqs,
                         kept_blocks(selection, model_config.num_layers))
    return SessionPlan(device, dtype, layout, memory, kv_type, resolve_cuda_graph(config.use_cuda_graph, device),
                       max_seq_len, budget, is_gpu, local_windows_len, chunk_size,
                       resolve_backend(config.attention_backend, device, model_config.head_dim, layout.dtype),
                       compact_params(config, prefill), selection, decode_threads(config.threads_num, spare_core=is_gpu),
                       config.threads_num, config.resident_history, config.max_num_seqs,
                       resolve_prefill_sms(config.decode_sm_share, device))


def plan_for_file(config: Config, gf, model_config: ModelConfig, max_seq_len: int, device: torch.device,
                  dtype: torch.dtype, world: int) -> SessionPlan:
    """plan_session for one rank of `world` over a GGUF that open_model opened (model_config:
    the whole model's), before any weight is read: the weights it will hold counted from the
    header (ktlong/gguf/held_bytes.py), its share of the heads (ktlong/parallel/shard.py)."""
    from ktlong.gguf.held_bytes import held_bytes
    from ktlong.parallel.shard import shard_config

    weight_bytes = held_bytes(gf, model_config, dtype.itemsize, world, device.type == "cpu", config.cpu_stored_weights)
    rank_config = shard_config(model_config, world) if world > 1 else model_config
    return plan_session(config, rank_config, weight_bytes, max_seq_len, device, dtype)
