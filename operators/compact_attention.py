"""CompactAttention for one prefill chunk of one layer: select, union, execute in place.

1. a selector marks (query block, history block) pairs per head;
2. the Q-block union and the intra-group union reduce them to one page list per group;
3. one paged-attention call (FlashInfer on the GPU, the torch reference elsewhere) runs
   every group over its selected history pages followed by the chunk's own pages, causal.
With nothing dropped (alpha = 0, threshold = 1) the result is dense attention.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from operators.block_selector import RANKS, flashprefill_group_keep, topk_group_blocks
from operators.chunk_attention import chunk_attention
from operators import triton_installed
from operators.block_union import (PageLists, build_page_lists, every_page_lists, execution_groups,
                                   fixed_page_indices, fixed_page_lists, union_groups, union_query_blocks)
from operators.layer_budget import SAMPLE_STRIDE, LayerBudgets, blocks_to_hold, sampled_share
from operators.paged_attention_reference import paged_attention_reference
from operators.xattention_selector import select_blocks_xattention

SELECTORS = ("flashprefill", "xattention", "topk", "all")
# Chunks of at most this many queries (a follow-up's question) run on fa2 where the backend is
# fa3: fa3's query tile is 128 rows and it gives each tile a whole request's keys, so a short
# chunk over a long history keeps a few SMs busy; fa2 splits the keys across the SMs and merges
# (FlashInfer falls back to fa2 the same way for short queries, flashinfer-ai/flashinfer#5188).
SHORT_CHUNK = 64
# Plans kept per kind of chunk, so that a prompt's first chunk (no history), its full chunks and
# its last, shorter one each keep theirs from layer to layer; the dense chunks of a compact
# prefill (the first few of every layer) keep theirs the same way. Each plan is a FlashInfer
# wrapper with its own 8 MB of int buffers (memory_plan's ATTENTION_WORKSPACE holds them).
PLAN_SLOTS = 3


@dataclass(frozen=True, kw_only=True)
class CompactParams:
    """The prefill options of ktlong/options.py, same names and types (ktlong builds them from its
    config, which holds the values, checked; a test holds the names and types)."""
    selector: str  # flashprefill | xattention | topk | all (keep every block: dense)
    alpha: float
    keep_blocks: int  # topk: history blocks every group keeps
    topk_rank: str  # topk: what orders the history blocks: margin | mass (block_selector.RANKS)
    layer_budget: str  # topk: fixed (keep_blocks every layer) | attention (a count per layer: layer_keep)
    budget_mass: float  # layer_budget attention: the share of the sampled attention a layer's count must hold
    threshold: float
    stride: int
    sink_blocks: int
    window_blocks: int
    subgroup_size: int
    dense_above: float  # a chunk keeping more of its history than this runs dense (1: never)
    tail_queries: int  # flashprefill: the prompt's last queries also score history tokens one by one
    dense_tail: int  # the prompt's last queries attend to every history block
    prefill_dense_layer_num: int  # first layers that never select (the prefill runs them dense)

    def __post_init__(self):
        assert self.selector in SELECTORS, self.selector

    @classmethod
    def keep_all(cls) -> "CompactParams":
        """Every block kept: dense attention through the paged path. With nothing selected the
        heads of a kv group share one page list, so each group is one request."""
        return cls(selector="all", alpha=0.0, keep_blocks=1 << 30, topk_rank="margin", layer_budget="fixed",
                   budget_mass=1.0, threshold=1.0, stride=1, sink_blocks=0,
                   window_blocks=0, subgroup_size=1 << 30, dense_above=1.0, tail_queries=0, dense_tail=0,
                   prefill_dense_layer_num=0)


class CompactAttention:
    def __init__(self, params: CompactParams, num_heads: int, num_kv_heads: int, block_size: int,
                 scale: float, backend: str, device: torch.device):
        self.params, self.block_size, self.scale, self.backend = params, block_size, scale, backend
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.groups = execution_groups(num_heads, num_kv_heads, params.subgroup_size)
        self.device = device
        # per kind of chunk (short: True), up to PLAN_SLOTS executors and, by the key of their
        # lengths, the page lists each was planned for: one plan serves every layer of a chunk
        # whose page lists have the same lengths (every block kept; topk's fixed counts)
        self.executors: dict[bool, list] = {False: [], True: []}
        self.plans: dict[bool, OrderedDict[tuple, tuple[int, PageLists]]] = {False: OrderedDict(), True: OrderedDict()}
        # topk's selection and page lists in a few Triton kernels (operators/topk_selection_kernel.py)
        self.topk_kernel = device.type == "cuda" and triton_installed()
        # layer_budget attention: the prompt's count per layer (new_prompt() forgets them)
        self.budgets = LayerBudgets(params.keep_blocks, params.sink_blocks + params.window_blocks)

    def new_prompt(self):
        """A prefill begins: the layers' counts are measured again (layer_budget attention)."""
        self.budgets.reset()

    def num_keep(self, num_hist: int) -> int:
        """topk: history blocks every group keeps (at least the sinks and the window)."""
        p = self.params
        return min(num_hist, max(p.keep_blocks, p.sink_blocks + p.window_blocks))

    def group_keep(self, q: torch.Tensor, k_pages: torch.Tensor, pooled_keys: torch.Tensor,
                   start: int, tail: int = 0) -> torch.Tensor:
        """The history blocks each execution group reads: q: [T, H, D]; pooled_keys: [KV, >= start/B, D]
        -> [G, start/B] bool. FlashPrefill's selection comes fused with the Q-block and group
        unions; XAttention's per (head, query block) choice goes through the two unions. tail: how
        many of the chunk's last queries are the prompt's last tail_queries (the question)."""
        p, num_hist = self.params, start // self.block_size
        if p.selector == "all" or num_hist == 0:
            return torch.ones((self.groups.shape[0], num_hist), dtype=torch.bool, device=q.device)
        keys = token_rows(k_pages)[:, :start]
        if p.selector == "flashprefill":
            return flashprefill_group_keep(q, pooled_keys[:, :num_hist], self.block_size, p.alpha, self.scale,
                                           p.sink_blocks, p.window_blocks, self.groups.shape[1],
                                           tail_queries=tail, keys=keys)
        keep = select_blocks_xattention(q, keys, self.block_size, p.stride, p.threshold, self.scale,
                                        p.sink_blocks, p.window_blocks)  # [H, nqb, start/B]
        return union_groups(union_query_blocks(keep), self.groups)

    def page_lists(self, group_keep: torch.Tensor, start: int, end: int, blocks_per_head: int) -> PageLists | None:
        """The groups' page lists, or None when they would keep more than dense_above of the
        history: there, building them and planning costs more than the dropped blocks save. One
        host sync tells both (the kept counts)."""
        counts = group_keep.sum(1).cpu()
        num_hist = group_keep.shape[1]
        if self.params.dense_above < 1.0 and num_hist:
            if float(counts.sum()) / (num_hist * len(counts)) > self.params.dense_above:
                return None
        return build_page_lists(group_keep, self.groups, self.num_heads, self.num_kv_heads, blocks_per_head,
                                start // self.block_size, end - start, self.block_size, counts)

    def make_executor(self, short: bool):
        """A FlashInfer executor for chunks of this kind (short: fa2 where the backend is fa3), or
        None where the torch reference runs."""
        if self.backend == "torch":
            return None
        from operators.flashinfer_paged import FlashInferPagedExecutor

        return FlashInferPagedExecutor(self.device, "fa2" if short and self.backend == "fa3" else self.backend)

    def execute(self, q, k_pages, v_pages, pages: PageLists, what: tuple | None = None) -> torch.Tensor:
        """what: a key for the lengths of these page lists (None: plan anew); when an executor was
        planned for the same key, it runs on that plan, and pages must be the planned lists,
        their indices rewritten in place."""
        # q's length picks the kind of executor, and every key holds that length
        short = q.shape[0] <= SHORT_CHUNK
        plans, executors = self.plans[short], self.executors[short]
        if what is not None and what in plans:
            slot, planned = plans[what]
            plans.move_to_end(what)
            assert planned.indices is pages.indices  # rewritten in place
            return executors[slot].run(q, k_pages, v_pages, self.groups)
        held = {slot for slot, _ in plans.values()}
        free = [slot for slot in range(len(executors)) if slot not in held]
        if free:
            slot = free[0]
        elif len(executors) < PLAN_SLOTS:
            executor = self.make_executor(short)
            if executor is None:
                return paged_attention_reference(q, k_pages, v_pages, self.groups, pages, self.scale)
            executors.append(executor)
            slot = len(executors) - 1
        else:  # the least recently used plan makes way
            slot = plans.pop(next(iter(plans)))[0]
        executor = executors[slot]
        executor.plan(q.shape[0], self.groups, pages, q.shape[-1], self.block_size, self.scale, q.dtype)
        # FlashInfer keeps a device tensor of indices as it is; a copy could not be rewritten in place
        if what is not None and executor.reads_indices_from(pages.indices):
            plans[what] = (slot, pages)
        return executor.run(q, k_pages, v_pages, self.groups)

    def planned_pages(self, what: tuple) -> PageLists | None:
        """The page lists an executor was planned for under this key, if one still is."""
        for plans in self.plans.values():
            if what in plans:
                return plans[what][1]
        return None

    def layer_keep(self, layer: int, q, k_pages, pooled_keys, num_hist: int) -> int:
        """topk: the history blocks every group of this layer keeps: keep_blocks, or with
        layer_budget attention the layer's own count, measured at its first chunk that selects
        (operators/layer_budget.py: one host sync a layer)."""
        p = self.params
        if p.layer_budget == "fixed":
            return self.num_keep(num_hist)
        if layer not in self.budgets.counts:
            sample = q[::SAMPLE_STRIDE]
            share = sampled_share(sample, token_rows(k_pages)[:, :num_hist * self.block_size], num_hist,
                                  self.block_size, self.scale, self.groups.shape[1])
            need = blocks_to_hold(share, self.rank_scores(q, pooled_keys, num_hist), p.budget_mass)
            self.budgets.decide(layer, float(need.float().mean()))
        return min(num_hist, self.budgets.counts[layer])

    def topk_kernels_take(self, q) -> bool:
        """Whether topk's Triton kernels select for q: on a GPU with Triton, a head_dim that is a
        power of two of at least 16 (the torch path elsewhere)."""
        dim = q.shape[-1]
        return self.topk_kernel and dim >= 16 and dim & (dim - 1) == 0

    def rank_scores(self, q, pooled_keys, num_hist: int) -> torch.Tensor:
        """[G, num_hist] float32: what topk ranks the history blocks by (topk_rank), the sinks and
        the window +inf; the Triton kernels' where topk_indices uses them."""
        p, group_size = self.params, self.groups.shape[1]
        if self.topk_kernels_take(q):
            from operators.topk_selection_kernel import group_margins

            return group_margins(q, pooled_keys, num_hist, self.block_size, self.scale, group_size, p.sink_blocks,
                                 p.window_blocks, p.topk_rank)
        return RANKS[p.topk_rank](q, pooled_keys[:, :num_hist], self.block_size, self.scale, p.sink_blocks,
                                  p.window_blocks, group_size)

    def select(self, q, k_pages, pooled_keys, start: int, end: int,
               prompt_end: int | None = None, layer: int = 0) -> tuple[PageLists | None, tuple | None]:
        """The page lists of the chunk's queries (positions start..end) and the key of their
        lengths for the executor's plan (None: plan anew), or (None, None) when the selection
        keeps more than dense_above of the history: the caller runs the chunk dense.
        prompt_end: where the prompt ends (its last tail_queries queries score history tokens);
        None: not in this chunk's prompt. layer: whose count topk keeps (layer_budget)."""
        assert start % self.block_size == 0 and q.shape[0] == end - start
        p, num_hist = self.params, start // self.block_size
        if p.selector == "all" or start == 0:  # nothing to select: no host sync
            what = ("every", start, end, k_pages.shape[1], tuple(q.shape), q.dtype, q.device)
            planned = self.planned_pages(what)
            if planned is not None:
                return planned, what
            return every_page_lists(self.groups.shape[0], self.num_kv_heads, k_pages.shape[1], num_hist,
                                    end - start, self.block_size, q.device), what
        if p.selector == "topk":
            if self.num_keep(num_hist) > p.dense_above * num_hist:  # the fixed count's chunks run dense
                return None, None
            num_keep = self.layer_keep(layer, q, k_pages, pooled_keys, num_hist)
            if num_keep > p.dense_above * num_hist:
                return None, None
            # the lengths, not the chunk's place: every full chunk of every layer past keep_blocks shares one plan
            what = ("topk", num_keep, end - start, k_pages.shape[1], q.shape[1:], q.dtype, q.device)
            planned = self.planned_pages(what)
            out = planned.indices if planned is not None else None
            indices = self.topk_indices(q, pooled_keys, num_hist, num_keep, k_pages.shape[1], end - start, out)
            return fixed_page_lists(indices, self.groups.shape[0], num_keep, num_hist, end - start,
                                    self.block_size), what
        tail = prompt_tail(start, end, prompt_end, p.tail_queries)
        keep = self.group_keep(q, k_pages, pooled_keys, start, tail)
        return self.page_lists(keep, start, end, k_pages.shape[1]), None

    def topk_indices(self, q, pooled_keys, num_hist: int, num_keep: int, blocks_per_head: int, chunk_tokens: int,
                     out: torch.Tensor | None) -> torch.Tensor:
        """The page indices of the num_keep best history blocks of every group, then the chunk's."""
        p, group_size = self.params, self.groups.shape[1]
        if self.topk_kernels_take(q):
            from operators.topk_selection_kernel import topk_page_indices

            return topk_page_indices(q, pooled_keys, num_hist, self.block_size, self.scale, num_keep, group_size,
                                     p.sink_blocks, p.window_blocks, self.num_kv_heads, blocks_per_head,
                                     chunk_tokens, out, p.topk_rank)
        ids = topk_group_blocks(q, pooled_keys[:, :num_hist], self.block_size, self.scale, num_keep,
                                p.sink_blocks, p.window_blocks, group_size, p.topk_rank)
        return fixed_page_indices(ids, self.num_kv_heads, blocks_per_head, num_hist, chunk_tokens, self.block_size,
                                  out)

    def attend(self, q, k_pages, v_pages, pages: PageLists, what: tuple | None, start: int, end: int,
               prompt_end: int | None = None) -> torch.Tensor:
        """Attention of the chunk's queries over select()'s pages -> [T, H, D]. The prompt's last
        dense_tail queries (the question, and the position the first answer token comes from)
        attend to every history block, as dense prefill computes them, at the cost of a few rows
        over the history."""
        out = self.execute(q, k_pages, v_pages, pages, what)
        every = self.params.selector == "all" or not pages.num_hist  # nothing was dropped
        dense = 0 if every else prompt_tail(start, end, prompt_end, self.params.dense_tail)
        if dense:
            keys, values = token_rows(k_pages)[:, :end], token_rows(v_pages)[:, :end]
            out[-dense:] = chunk_attention(q[-dense:], keys, values, self.scale, self.backend)
        return out

    def __call__(self, q, k_pages, v_pages, pooled_keys, start: int, end: int, prompt_end: int | None = None,
                 layer: int = 0):
        """select() then attend() -> (out [T, H, D], page lists), or (None, None) where the
        caller runs the chunk dense."""
        pages, what = self.select(q, k_pages, pooled_keys, start, end, prompt_end, layer)
        if pages is None:
            return None, None
        return self.attend(q, k_pages, v_pages, pages, what, start, end, prompt_end), pages


def token_rows(pages: torch.Tensor) -> torch.Tensor:
    """Head-major pages [KV, NB, B, D] as token rows [KV, NB * B, D] (a view)."""
    return pages.view(pages.shape[0], -1, pages.shape[-1])


def prompt_tail(start: int, end: int, prompt_end: int | None, n: int) -> int:
    """How many of the queries start..end are among the prompt's last n (the prompt ends at prompt_end)."""
    return min(max(end - (prompt_end - n), 0), end - start) if n and prompt_end is not None else 0
