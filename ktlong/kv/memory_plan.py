"""Plan GPU and DRAM bytes for a long-context run before any weight is read, and refuse what
cannot fit with the numbers and the option that would make it fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ktlong.errors import ConfigError
from ktlong.kv.layout import SINK_BLOCKS, KVLayout
from ktlong.kv.free_memory import GIB, available_dram_bytes
from ktlong.kv.shared_prefix import shareable_blocks, shared_prefix_bytes
from ktlong.gguf.model_config import ModelConfig

ATTENTION_WORKSPACE = 256 << 20  # FlashInfer's float workspace plus its int buffers


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_pages: int  # one layer of K/V pages on the GPU
    hidden: int  # all hidden states on the GPU, or two staging chunks when they live in DRAM
    workspace: int  # one chunk's activations, attention workspace, logits
    decode_window: int  # decode: sinks + local window of every layer (prefill's hidden states are gone)
    # decode: the device copy of the anchors that blocks are scored with, if any, of one
    # conversation of max_seq_len (a decoder's own follow its length: anchor_bytes)
    decode_anchors: int
    hidden_on_device: bool
    dram_kv: int  # global layers: every block
    dram_kv_sliding: int  # sliding-window layers: the tail the decode window loads
    dram_side_tables: int  # global layers only
    dram_hidden: int
    dram_total_q8_0: int = 0  # what DRAM would hold with kv_type q8_0 (named when DRAM is short)
    global_layers: int = 0
    sliding_layers: int = 0
    device_is_gpu: bool = True
    # conversations decoded together (max_num_seqs): each has its own decode window and anchors
    # on the device and its own KV cache in DRAM (the fields above are one conversation's)
    conversations: int = 1
    decode_kept: int = 0  # decode: the blocks the device read for the last tokens, kept on it (context_attention: gpu)
    # the leading blocks every conversation holds in one copy with the others (a shared document:
    # ktlong/kv/shared_prefix.py), counted once
    dram_shared: int = 0
    # every decoder's anchors together (ktlong/session/anchors_pool.py): at least one
    # conversation of max_seq_len's, at most one such per conversation, as the budget leaves room
    anchors_pool: int = 0

    @property
    def decoder(self) -> int:
        """One conversation's decode state on the device beside its anchors (which are in
        anchors_pool): its window and kept blocks."""
        return self.decode_window + self.decode_kept

    @property
    def prefill_device(self) -> int:
        return self.weights + self.kv_pages + self.hidden + self.workspace

    @property
    def decode_device(self) -> int:
        return self.weights + self.kv_pages + self.conversations * self.decoder + self.anchors_pool

    @property
    def one_conversation(self) -> int:
        """The peak with one conversation: its prefill, or its decode steps."""
        return max(self.prefill_device, self.weights + self.kv_pages + self.decoder + self.decode_anchors)

    @property
    def prefill_beside_decoders(self) -> int:
        """A prefill while the other conversations decode (the server runs it in slices between
        their steps): its hidden states and workspace beside their decode states."""
        return self.prefill_device + (self.conversations - 1) * self.decoder + self.anchors_pool

    @property
    def device_total(self) -> int:
        """The peak: a prefill (hidden states, one chunk's workspace) beside the other
        conversations' decoders, or decode (every conversation's decode state)."""
        return max(self.prefill_beside_decoders, self.decode_device)

    @property
    def dram_cache(self) -> int:
        """One conversation's KV cache and side tables in DRAM."""
        return self.dram_kv + self.dram_kv_sliding + self.dram_side_tables

    @property
    def dram_total(self) -> int:
        return self.conversations * self.dram_cache - (self.conversations - 1) * self.dram_shared + self.dram_hidden

    def conversations_that_fit(self, budget_bytes: int, free_dram: int, ram_bytes: int = 1 << 62) -> int:
        """The most conversations whose decode states and caches fit beside the rest. With a GPU,
        CUDA page-locks each cache's whole range, shared blocks included, and refuses past the
        machine's RAM (ram_bytes): at most PINNABLE of it."""
        per_device = self.decoder + self.decode_anchors
        room = budget_bytes - self.weights - self.kv_pages if self.device_is_gpu else 1 << 62
        # every window and anchors while decoding; all but one beside a prefill's hidden states and workspace
        fit_device = (min(room // per_device, (room - self.hidden - self.workspace) // per_device + 1)
                      if per_device else 1 << 62)
        own = self.dram_cache - self.dram_shared  # what each conversation past the first adds
        fit_dram = (free_dram - self.dram_hidden - self.dram_shared) // own if own > 0 else 1 << 62
        fit_pinned = int(PINNABLE * ram_bytes) // self.dram_cache if self.device_is_gpu and self.dram_cache else 1 << 62
        return max(0, min(fit_device, fit_dram, fit_pinned))

    def table(self) -> str:
        """GPU and DRAM rows on a GPU run; on a CPU run both live in the machine's RAM."""
        dev, host = ("GPU", "DRAM") if self.device_is_gpu else ("RAM", "RAM")
        n = self.conversations
        each = f" x{n}" if n > 1 else ""  # every conversation's
        rows = [(f"{dev} weights", self.weights), (f"{dev} KV pages (one layer)", self.kv_pages),
                (f"{dev} hidden states" if self.hidden_on_device else f"{dev} hidden staging", self.hidden),
                (f"{dev} workspace (one chunk)", self.workspace),
                (f"{dev} decode window{each}", n * self.decode_window)]
        if self.decode_anchors:
            of = self.anchors_pool / self.decode_anchors  # every decoder's, each sized by its conversation
            rows.append((f"{dev} anchors: {of:.1f} x max_seq_len", self.anchors_pool))
        if self.decode_kept:
            rows.append((f"{dev} decode kept blocks{each}", n * self.decode_kept))
        rows += [(f"{dev} peak" if self.device_is_gpu else "RAM peak for compute", self.device_total),
                 (f"{host} KV ({self.global_layers} global layers){each}", n * self.dram_kv)]
        if self.sliding_layers:
            rows.append((f"{host} KV ({self.sliding_layers} sliding, tail){each}", n * self.dram_kv_sliding))
        rows.append((f"{host} side tables{each}", n * self.dram_side_tables))
        if self.dram_shared and n > 1:
            rows.append((f"{host} shared document, less its {n - 1} copies", -(n - 1) * self.dram_shared))
        if self.device_is_gpu:  # on the CPU the hidden states are the compute rows' own
            rows.append(("DRAM hidden states", self.dram_hidden))
        rows.append(("DRAM total" if self.device_is_gpu else "RAM for the KV cache", self.dram_total))
        return "\n".join(f"  {name:<36}{size / GIB:>9.2f} GiB" for name, size in rows)


def workspace_bytes(c: ModelConfig, chunk: int, layout: KVLayout, act_bytes: int) -> int:
    # live at the peak of one chunk: residual x, normed input, q/k/v (+ kv-typed copies),
    # attention output, gate/up/activation of the MLP, and the block summaries
    per_token = (3 * c.hidden_size + 2 * c.num_heads * c.head_dim + 4 * c.num_kv_heads * c.head_dim
                 + 3 * c.intermediate_size) * act_bytes
    importance = c.num_heads * 64 * chunk * 4 * 2  # scores and softmax of the last 64 queries
    # q8_0 / q4_0: quantising one chunk's K or V (float32 blocks, their scaled copy, the rounding)
    quantize = 4 * chunk * c.num_kv_heads * c.head_dim * 4 if layout.is_quantized else 0
    return chunk * per_token + importance + quantize + ATTENTION_WORKSPACE + c.vocab_size * 4 * 2


def decode_window_bytes(layout: KVLayout, local_windows_len: int, sink_tokens: int) -> int:
    """ktlong/decode/window.py: K and V of sinks + local window + two blocks, every layer."""
    tokens = sink_tokens + local_windows_len + 2 * layout.block_size
    return 2 * layout.num_layers * layout.num_kv_heads * tokens * layout.head_dim * layout.dtype.itemsize


def decode_anchor_bytes(layout: KVLayout, anchors_per_block: int, blocks: int | None = None) -> int:
    """ktlong/decode/device_anchors.py: bfloat16 anchors of `blocks` blocks (all the layout's by
    default) of every global layer, plus scoring's float32 copy of one layer's and the scores."""
    blocks = layout.num_blocks if blocks is None else blocks
    per_layer = layout.num_kv_heads * blocks * anchors_per_block * layout.head_dim * 2
    scores = len(layout.global_layers) * layout.num_kv_heads * blocks * 4
    return per_layer * (len(layout.global_layers) + 2) + scores if anchors_per_block else 0


def decode_kept_bytes(layout: KVLayout, kept_blocks: int) -> int:
    """ktlong/decode/dram_blocks.py: K and V of kept_blocks blocks per kv head of every global
    layer, stored as DRAM stores them."""
    return len(layout.global_layers) * layout.layer_bytes(min(kept_blocks, layout.num_blocks))


# the share of the machine's RAM that page-locked host memory may span: CUDA counts each
# registered range, and refused past 120 of 125 GiB on an H200 machine, two ranges of one memory
# file each counted in full (2026-11-28)
PINNABLE = 0.9


def plan_memory(c: ModelConfig, weight_bytes: int, act_bytes: int, layout: KVLayout,
                chunk_size: int, budget_bytes: int, device_is_gpu: bool, local_windows_len: int = 4096,
                device_anchors_per_block: int = 0, conversations: int = 1, kept_blocks: int = 0,
                shared_tokens: int = 0) -> MemoryPlan:
    """weight_bytes: what the weights hold (ktlong/gguf/held_bytes.py); act_bytes: an activation's
    element. device_anchors_per_block: anchors per block when decode scores blocks on the GPU, else 0.
    conversations: decoded together (max_num_seqs), each of up to layout.capacity tokens;
    shared_tokens: the leading tokens they all hold in one copy (as much as can be shared of them).
    kept_blocks: blocks per kv head and layer the device keeps from the last tokens
    (second_select_num when it reads the selected blocks, else 0)."""
    weights = weight_bytes
    kv_pages = layout.page_bytes()
    chunk = min(chunk_size, layout.capacity)
    workspace = workspace_bytes(c, chunk, layout, act_bytes)
    window = decode_window_bytes(layout, local_windows_len, SINK_BLOCKS * layout.block_size)
    full_hidden = layout.capacity * c.hidden_size * act_bytes
    staging = 2 * chunk * c.hidden_size * act_bytes
    hidden_on_device = not device_is_gpu or weights + kv_pages + full_hidden + workspace <= budget_bytes
    hidden = full_hidden if hidden_on_device else staging
    anchors = decode_anchor_bytes(layout, device_anchors_per_block) if device_is_gpu else 0
    kept = decode_kept_bytes(layout, kept_blocks) if device_is_gpu else 0
    # what the budget leaves beside the rest at the peak (a prefill beside the other decoders, or
    # every decoder) is the anchors' pool, up to one of max_seq_len a conversation; at least one
    # (less: the plan refuses)
    beside = weights + kv_pages + max(hidden + workspace + (conversations - 1) * (window + kept),
                                      conversations * (window + kept))
    pool = min(conversations * anchors, max(anchors, budget_bytes - beside))
    return MemoryPlan(
        weights=weights, kv_pages=kv_pages, hidden=hidden,
        workspace=workspace, decode_window=window, decode_anchors=anchors, anchors_pool=pool,
        hidden_on_device=hidden_on_device,
        dram_kv=layout.dram_kv_bytes(sliding=False), dram_kv_sliding=layout.dram_kv_bytes(sliding=True),
        dram_side_tables=layout.dram_side_table_bytes(),
        dram_hidden=0 if hidden_on_device else full_hidden,
        dram_total_q8_0=dram_total_with(dataclasses.replace(layout, kv_type="q8_0"), 0 if hidden_on_device else full_hidden,
                                        conversations)
        if layout.head_dim % 32 == 0 else 0,
        global_layers=len(layout.global_layers), sliding_layers=layout.num_layers - len(layout.global_layers),
        device_is_gpu=device_is_gpu, conversations=conversations,
        decode_kept=kept,
        dram_shared=shared_prefix_bytes(layout, shareable_blocks(layout, shared_tokens)))


def dram_total_with(layout: KVLayout, dram_hidden: int, conversations: int = 1) -> int:
    return conversations * layout.dram_cache_bytes() + dram_hidden


def dram_limit(device_is_gpu: bool) -> int:
    """The DRAM a server's KV caches may hold together (they grow as their conversations do):
    what is free now, and with a GPU at most what CUDA page-locks (PINNABLE of all of it)."""
    free = available_dram_bytes()
    return min(free, int(PINNABLE * available_dram_bytes("MemTotal"))) if device_is_gpu else free


def check_plan(plan: MemoryPlan, budget_bytes: int, device_is_gpu: bool, free_dram: int,
               max_seq_len: int):
    n = plan.conversations
    # the most that fit the device beside one conversation of max_seq_len's anchors (DRAM admits at run time)
    fewer = max((k for k in range(1, n) if plan.weights + plan.kv_pages + plan.decode_anchors + max(
        plan.hidden + plan.workspace + (k - 1) * plan.decoder, k * plan.decoder) <= budget_bytes), default=0)
    if device_is_gpu and plan.device_total > budget_bytes:
        fixed = plan.weights + plan.workspace
        hint = ("lower max_seq_len" if fixed < budget_bytes else
                "the weights alone do not fit: use a smaller or more quantised model")
        if n > 1 and plan.prefill_device <= budget_bytes and 0 < fewer < n:
            hint = f"lower max_num_seqs to {fewer}, or max_seq_len"
        if plan.decode_anchors and fixed < budget_bytes and plan.decode_device > budget_bytes:
            hint += f", set block_scoring: cpu (saves {plan.anchors_pool / GIB:.2f} GiB of device anchors)"
        raise ConfigError(f"The plan needs {plan.device_total / GIB:.1f} GiB of GPU memory but "
                          f"gpu_memory_budget_gb allows {budget_bytes / GIB:.1f} GiB; {hint}, lower "
                          "chunk_size, or raise gpu_memory_budget_gb if the GPU has more.")
    # one conversation of max_seq_len must fit; caches hold only what their conversations reserve
    # (ktlong/kv/host_cache.py), so more run together as DRAM allows (the server admits them)
    # (on a CPU beside the weights and that conversation's compute, which share its RAM)
    beside = 0 if device_is_gpu else plan.one_conversation
    if beside > free_dram:
        raise ConfigError(f"The weights and the compute need {beside / GIB:.1f} GiB of RAM but {free_dram / GIB:.1f} "
                          "GiB is free; use a smaller or more quantised model, or lower max_seq_len or chunk_size.")
    one = plan.dram_cache + plan.dram_hidden
    if beside + one > free_dram:
        tokens = int(max_seq_len * (free_dram - beside) / one)
        one_q8_0 = (plan.dram_total_q8_0 - plan.dram_hidden) // n + plan.dram_hidden if plan.dram_total_q8_0 else 0
        fits_q8_0 = 0 < one_q8_0 < one and beside + one_q8_0 <= free_dram
        smaller = f"set kv_type: q8_0 (needs {one_q8_0 / GIB:.1f} GiB) or " if fits_q8_0 else ""
        also = f" beside {beside / GIB:.1f} GiB of weights and compute" if beside else ""
        raise ConfigError(f"The KV cache for max_seq_len {max_seq_len:,} needs {one / GIB:.1f} GiB of DRAM{also} but "
                          f"{free_dram / GIB:.1f} GiB is free; {smaller}lower max_seq_len to about {tokens:,}.")
