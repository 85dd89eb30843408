"""Long-context generation state: layer-major prefill into the DRAM KV cache, then decode.

Decode attends over every cached token on the CPU side of the cache for now (exact); the
sparse CPU operator and the GPU local window replace that path in the hybrid decoder.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from ktlong.kv_cache import HostKVCache, KVLayout
from ktlong.models.llama import LlamaModel
from ktlong.prefill import LayerMajorPrefill
from operators.block_summary import block_summaries
from operators.compact_attention import CompactParams
from operators.dense_attention import dense_attention

MAX_STEPPED_SUFFIX = 512  # a follow-up this short is fed token by token instead of re-prefilled


class LongContextSession:
    def __init__(self, model: LlamaModel, layout: KVLayout, chunk_size: int, backend: str,
                 hidden_on_device: bool, compact: CompactParams | None = None):
        self.model, self.layout = model, layout
        self.max_seq_len = layout.capacity
        self.engine = LayerMajorPrefill(model, layout, chunk_size, backend, hidden_on_device, compact)
        self.host = HostKVCache(layout, pin=model.device.type == "cuda")
        self.ids: list[int] = []
        self.last_stats = None

    def reset(self):
        self.ids = []
        self.host.num_tokens = 0

    def prefill(self, prompt_ids: list[int], show_progress: bool = False) -> torch.Tensor:
        reuse = len(self.ids)
        if self.ids and prompt_ids[:reuse] == self.ids and 0 < len(prompt_ids) - reuse <= MAX_STEPPED_SUFFIX:
            logits = None
            for token in prompt_ids[reuse:]:
                logits = self.step(token)
            return logits
        layers = self.model.config.num_layers
        bar = tqdm(total=len(prompt_ids), unit="tok", desc="prefill", leave=False,
                   disable=not show_progress or len(prompt_ids) <= self.engine.chunk_size)
        progress = _ScaledProgress(bar, 1.0 / layers)
        logits, self.last_stats = self.engine.run(prompt_ids, self.host, progress)
        bar.close()
        densities = self.last_stats.density_per_layer
        if show_progress and densities:
            shown = " ".join(f"{d:.2f}" for d in densities)
            print(f"[CompactAttention kept {sum(densities) / len(densities):.1%} of history blocks; "
                  f"per layer: {shown}]", file=sys.stderr)
        self.ids = list(prompt_ids)
        return logits

    @torch.inference_mode()
    def step(self, token_id: int) -> torch.Tensor:
        model, layout, host = self.model, self.layout, self.host
        pos = len(self.ids)
        assert pos < layout.capacity
        x = model.embed(torch.tensor([token_id], device=model.device))
        positions = torch.tensor([pos], device=model.device)
        for layer in range(model.config.num_layers):
            q, k, v = model.qkv(layer, x, positions)
            k_all = host.k[layer].view(layout.num_kv_heads, -1, layout.head_dim)
            v_all = host.v[layer].view(layout.num_kv_heads, -1, layout.head_dim)
            k_all[:, pos] = k[0].to("cpu", layout.dtype)
            v_all[:, pos] = v[0].to("cpu", layout.dtype)
            if (pos + 1) % layout.block_size == 0:
                self._summarise_block(layer, pos // layout.block_size)
            qc = q.to("cpu", layout.dtype)
            o = dense_attention(qc, k_all[:, :pos + 1], v_all[:, :pos + 1], model.scale)
            x = x + model.attention_output(layer, o.to(model.device, x.dtype))
            x = x + model.mlp(layer, x)
        self.ids.append(token_id)
        self.host.num_tokens = pos + 1
        return model.logits(x)[0]

    def _summarise_block(self, layer: int, block: int):
        k = self.host.k[layer][:, block:block + 1]
        mean, kmax, kmin = block_summaries(k, self.layout.block_size)
        self.host.key_mean[layer, :, block] = mean[:, 0]
        self.host.key_max[layer, :, block] = kmax[:, 0]
        self.host.key_min[layer, :, block] = kmin[:, 0]


class _ScaledProgress:
    """The engine reports tokens per layer; the bar counts prompt tokens."""

    def __init__(self, bar, scale):
        self.bar, self.scale, self.done = bar, scale, 0.0

    def update(self, n):
        self.done += n * self.scale
        step = min(int(self.done + 1e-6), self.bar.total) - self.bar.n
        if step > 0:
            self.bar.update(step)
