"""Plan GPU and DRAM bytes for a long-context run before any weight is read, and refuse what
cannot fit with the numbers and the option that would make it fit."""

from __future__ import annotations

from dataclasses import dataclass

from ktlong.errors import ConfigError
from ktlong.kv_cache import KVLayout
from ktlong.model_config import ModelConfig

GIB = 1 << 30
ATTENTION_WORKSPACE = 256 << 20  # FlashInfer's float workspace plus its int buffers


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_pages: int  # one layer of K/V pages on the GPU
    hidden: int  # all hidden states on the GPU, or two staging chunks when they live in DRAM
    workspace: int  # one chunk's activations, attention workspace, logits
    hidden_on_device: bool
    dram_kv: int
    dram_side_tables: int
    dram_hidden: int

    @property
    def device_total(self) -> int:
        return self.weights + self.kv_pages + self.hidden + self.workspace

    @property
    def dram_total(self) -> int:
        return self.dram_kv + self.dram_side_tables + self.dram_hidden

    def table(self) -> str:
        rows = [("device weights", self.weights), ("device KV pages (one layer)", self.kv_pages),
                ("device hidden states" if self.hidden_on_device else "device hidden staging", self.hidden),
                ("device workspace (one chunk)", self.workspace), ("device total", self.device_total),
                ("DRAM KV (all layers)", self.dram_kv), ("DRAM side tables", self.dram_side_tables),
                ("DRAM hidden states", self.dram_hidden), ("DRAM total", self.dram_total)]
        return "\n".join(f"  {name:<28}{size / GIB:>9.2f} GiB" for name, size in rows)


def workspace_bytes(c: ModelConfig, chunk: int, layout: KVLayout, act_bytes: int) -> int:
    # live at the peak of one chunk: residual x, normed input, q/k/v (+ kv-typed copies),
    # attention output, gate/up/activation of the MLP, and the block summaries
    per_token = (3 * c.hidden_size + 2 * c.num_heads * c.head_dim + 4 * c.num_kv_heads * c.head_dim
                 + 3 * c.intermediate_size) * act_bytes
    importance = c.num_heads * 64 * chunk * 4 * 2  # scores and softmax of the last 64 queries
    return chunk * per_token + importance + ATTENTION_WORKSPACE + c.vocab_size * 4 * 2


def plan_memory(c: ModelConfig, num_weight_elements: int, act_bytes: int, layout: KVLayout,
                chunk_size: int, budget_bytes: int, device_is_gpu: bool) -> MemoryPlan:
    weights = num_weight_elements * act_bytes
    kv_pages = layout.layer_bytes()
    chunk = min(chunk_size, layout.capacity)
    workspace = workspace_bytes(c, chunk, layout, act_bytes)
    full_hidden = layout.capacity * c.hidden_size * act_bytes
    staging = 2 * chunk * c.hidden_size * act_bytes
    hidden_on_device = not device_is_gpu or weights + kv_pages + full_hidden + workspace <= budget_bytes
    return MemoryPlan(
        weights=weights, kv_pages=kv_pages, hidden=full_hidden if hidden_on_device else staging,
        workspace=workspace, hidden_on_device=hidden_on_device,
        dram_kv=layout.num_layers * layout.layer_bytes(),
        dram_side_tables=layout.num_layers * layout.side_table_bytes(),
        dram_hidden=0 if hidden_on_device else full_hidden)


def available_dram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_plan(plan: MemoryPlan, budget_bytes: int, device_is_gpu: bool, free_dram: int,
               max_seq_len: int):
    if device_is_gpu and plan.device_total > budget_bytes:
        fixed = plan.weights + plan.workspace
        hint = ("lower max_seq_len" if fixed < budget_bytes else
                "the weights alone do not fit: use a smaller or more quantised model")
        raise ConfigError(f"The plan needs {plan.device_total / GIB:.1f} GiB of GPU memory but "
                          f"gpu_memory_budget_gb allows {budget_bytes / GIB:.1f} GiB; {hint}, lower "
                          "chunk_size, or raise gpu_memory_budget_gb if the GPU has more.")
    if plan.dram_total > free_dram:
        tokens = int(max_seq_len * free_dram / plan.dram_total)
        raise ConfigError(f"The KV cache for max_seq_len {max_seq_len:,} needs "
                          f"{plan.dram_total / GIB:.1f} GiB of DRAM but {free_dram / GIB:.1f} GiB is "
                          f"free; lower max_seq_len to about {tokens:,} or use kv_type fp16/bf16.")
