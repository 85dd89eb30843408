"""Decode selection and CompactAttention settings for tests, built the way sessions build them:
from the defaults with some options set."""

import dataclasses

import torch

from ktlong.config import default_config
from ktlong.decode.selection import SelectionSettings
from ktlong.kv.layout import KVLayout
from ktlong.prefill import resolve_backend
from ktlong.session.plan import resolve_block_scoring
from ktlong.session.settings import compact_params, selection_settings
from operators.compact_attention import CompactParams


def selection(device: str = "cpu", **options) -> SelectionSettings:
    """Decode settings, resolved as a plan resolves them for a model on `device`: blocks scored
    on a GPU device ("auto"); the CPU operator attends to the selected blocks (on a GPU too: the
    tests of the hybrid path's mechanism) unless a test sets context_attention itself."""
    options.setdefault("context_attention", "cpu")
    options["block_scoring"] = resolve_block_scoring(options.get("block_scoring", "auto"), torch.device(device))
    return selection_settings(default_config(**options), num_layers=1 << 10)


def gpu_backend(model) -> str:
    """attention_backend auto, resolved for a model on the GPU as the plan resolves it."""
    return resolve_backend("auto", model.device, model.config.head_dim, model.dtype)


def compact_settings(**options) -> CompactParams:
    """CompactAttention settings; the paged path runs whatever it keeps (dense_above 1) in every
    layer (prefill_dense_layer_num 0) unless a test sets those itself."""
    options.setdefault("dense_above", 1.0)
    options.setdefault("prefill_dense_layer_num", 0)
    return compact_params(default_config(prefill_attention="compact", **options))


def flashprefill_settings(**options) -> CompactParams:
    """compact_settings with the FlashPrefill selector (alpha of the best score), for tests of it."""
    return compact_settings(selector="flashprefill", **options)


def with_anchors(layout: KVLayout, settings: SelectionSettings) -> KVLayout:
    """The layout keeps the anchor keys these decode settings select with (as plan_session does)."""
    return dataclasses.replace(layout, anchor_type=settings.anchor_type, anchor_num=settings.anchor_num)


def few_shares(monkeypatch):
    """The selected blocks' kernel in 4 programs a kv head, each walking several blocks, as a
    selection of more blocks than its 16 shares runs it; the few blocks of these tests would give
    each share one, and Triton's interpreter costs mostly by the program: a quarter to a third less
    time."""
    monkeypatch.setattr("operators.selected_blocks_kernel.SHARES", 4)


def selection_kernels_as_on_a_gpu(monkeypatch):
    """The device selection's Triton kernels (scores, rows) where the anchors are linear, as a GPU
    runs them (Triton's interpreter on the CPU); but torch's top-k: the interpreter takes 1.6 s a
    call of block_topk's sorts (which tests/test_block_topk_kernel.py holds equal to torch's)."""
    from ktlong.decode import device_selection
    from operators import block_topk_kernel
    from operators.block_scores_kernel import kernel_applies

    monkeypatch.setattr(device_selection, "_kernels_apply", lambda anchors, selector, device: kernel_applies(
        selector.num_anchors, anchors.quest, selector.host.layout.head_dim))
    monkeypatch.setattr(block_topk_kernel, "kernel_applies", lambda num_scores, k: False)
