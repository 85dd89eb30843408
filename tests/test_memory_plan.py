"""The memory planner's figures and refusals."""

import pytest

from ktlong.errors import ConfigError
from ktlong.kv.layout import kv_layout
from ktlong.kv.memory_plan import GIB, check_plan, plan_memory
from ktlong.models.random_model import num_weight_elements, random_config

INTERNLM_7B = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=128)


def dram_gb(max_seq_len, kv_type="fp16"):
    layout = kv_layout(max_seq_len=max_seq_len, kv_type=kv_type, **INTERNLM_7B)
    return layout.num_layers * (layout.layer_bytes() + layout.side_table_bytes()) / 1e9


def test_kv_figures_match_ktransformers_table_for_internlm_7b():
    # KTransformers' long-context table (InternLM2.5-7B-Chat-1M, fp16): 4K 0.5 GB, 1M 145 GB
    assert round(dram_gb(4096), 1) in (0.5, 0.6)
    assert abs(dram_gb(1 << 20) - 145) / 145 < 0.03


def test_kv_bytes_are_exact_for_fp16():
    layout = kv_layout(max_seq_len=1000, kv_type="fp16", **INTERNLM_7B)  # 8 blocks of 128
    assert layout.num_blocks == 8 and layout.layer_bytes() == 2 * 8 * 1024 * 128 * 2


def plan_for(max_seq_len, budget_gb=24.0, chunk=8192):
    c = random_config("llama-3.1-8b")
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, max_seq_len, "bf16",
                       anchor_type="DYNAMIC", anchor_num=1)  # the default anchors
    return plan_memory(c, 2 * num_weight_elements(c), 2, layout, chunk, int(budget_gb * GIB), True)


def test_hidden_states_move_to_dram_when_they_do_not_fit():
    small, large = plan_for(32 << 10), plan_for(1 << 20)
    assert small.hidden_on_device and small.dram_hidden == 0
    assert not large.hidden_on_device and large.dram_hidden == (1 << 20) * 4096 * 2
    assert large.hidden == 2 * 8192 * 4096 * 2  # two staging chunks


def test_llama_8b_weights_are_counted():
    assert abs(plan_for(4096).weights / 1e9 - 16.06) < 0.05  # 8.03 B parameters in bf16


def test_refusals_say_how_much_and_which_option():
    plan = plan_for(1 << 20)
    with pytest.raises(ConfigError, match=r"needs .* GiB of DRAM .* lower max_seq_len to about"):
        check_plan(plan, 24 * GIB, True, free_dram=64 * GIB, max_seq_len=1 << 20)
    with pytest.raises(ConfigError, match=r"GiB of GPU memory .* gpu_memory_budget_gb allows 16.0 GiB"):
        check_plan(plan_for(128 << 10, budget_gb=16), 16 * GIB, True, free_dram=1 << 50, max_seq_len=128 << 10)
    check_plan(plan_for(128 << 10), 24 * GIB, True, free_dram=1 << 50, max_seq_len=128 << 10)


def test_sliding_and_global_layers_are_counted_apart_and_match_the_allocation():
    import torch

    from ktlong.decode.window import DeviceWindow
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.memory_plan import decode_window_bytes

    c = random_config("llama-3.1-8b")
    sliding = tuple((i + 1) % 6 != 0 for i in range(32))  # gemma3's pattern: every sixth layer global
    layout = kv_layout(32, 8, 128, 128, 128 << 10, "bf16", sliding, local_windows_len=4096)
    plan = plan_memory(c, 2 * num_weight_elements(c), 2, layout, 8192, 24 * GIB, True, local_windows_len=4096)
    assert plan.global_layers == 5 and plan.sliding_layers == 27
    assert "27 sliding" in plan.table() and "5 global" in plan.table()

    # what HostKVCache and DeviceWindow allocate is what the plan counts
    small = kv_layout(6, 2, 16, 16, 1000, "fp32", sliding[:6], local_windows_len=64)
    small_plan = plan_memory(c, 0, 4, small, 64, 24 * GIB, False, local_windows_len=64)
    host = HostKVCache(small, pin=False)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    is_sliding = [small.is_sliding(i) for i in range(6)]
    assert nbytes(t for i, t in enumerate(host.k + host.v) if not is_sliding[i % 6]) == small_plan.dram_kv
    assert nbytes(t for i, t in enumerate(host.k + host.v) if is_sliding[i % 6]) == small_plan.dram_kv_sliding
    assert nbytes(host.key_mean + host.key_max + host.key_min + host.anchor_keys) == small_plan.dram_side_tables
    tensors = host.k + host.v + host.key_mean + host.key_max + host.key_min + host.anchor_keys
    assert nbytes(tensors) == small_plan.dram_total
    window = DeviceWindow(small, 64, 16, torch.device("cpu"))
    assert sum(t.numel() * t.element_size() for t in (window.buf_k, window.buf_v)) == \
        decode_window_bytes(small, 64, 16) == small_plan.decode_window


def test_device_anchors_are_counted_as_allocated_and_named_in_the_refusal():
    import numpy as np
    import torch

    from ktlong.decode.selection import DecodeBlockSelector
    from ktlong.decode.device_anchors import DeviceAnchors
    from ktlong.kv.host_cache import HostKVCache
    from ktlong.kv.memory_plan import decode_anchor_bytes

    c = random_config("llama-3.1-8b")
    layout = kv_layout(32, 8, 128, 128, 512 << 10, "bf16")
    plan = plan_memory(c, 2 * num_weight_elements(c), 2, layout, 8192, 24 * GIB, True, 4096, device_anchors_per_block=1)
    assert "GPU anchors: 1.0 x max_seq_len" in plan.table()
    assert plan_memory(c, 2 * num_weight_elements(c), 2, layout, 8192, 24 * GIB, False, 4096, 1).decode_anchors == 0
    many = plan_memory(c, 2 * num_weight_elements(c), 2, layout, 8192, 24 * GIB, True, 4096, 32)  # DYNAMIC, 32 keys
    assert many.decode_device > many.prefill_device
    with pytest.raises(ConfigError, match=r"set block_scoring: cpu \(saves 8.50 GiB"):
        check_plan(many, many.decode_device - (1 << 20), True, free_dram=1 << 50, max_seq_len=512 << 10)

    small = kv_layout(3, 2, 16, 16, 1000, "fp32", (False, True, False), local_windows_len=64)
    host = HostKVCache(small, pin=False)
    from tests.settings import selection

    settings = selection(anchor_type="QUEST", block_scoring="device")
    anchors = DeviceAnchors(DecodeBlockSelector(settings, host, 4), small.global_layers, torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for t in anchors.anchors.values())
    per_layer = allocated // 2
    assert allocated + 2 * per_layer + 2 * 2 * small.num_blocks * 4 == decode_anchor_bytes(small, 2)
    assert np.prod(anchors.anchors[0].shape) == 2 * small.num_blocks * 2 * 16


def test_a_cpu_plan_names_ram_not_the_device():
    c = random_config("llama-3.1-8b")
    layout = kv_layout(32, 8, 128, 128, 32 << 10, "fp32")
    table = plan_memory(c, 4 * num_weight_elements(c), 4, layout, 8192, 24 * GIB, False).table()
    assert "RAM weights" in table and "RAM KV (32 global layers)" in table
    assert "device" not in table.lower() and "GPU" not in table


def test_a_cpu_plan_holds_the_weights_and_compute_beside_the_cache():
    """On a CPU the weights, the compute and the KV cache share the machine's RAM: all three must
    fit what is free (a GPU plan's DRAM holds the cache alone)."""
    c = random_config("llama-3.1-8b")
    layout = kv_layout(32, 8, 128, 128, 128 << 10, "bf16")
    plan = plan_memory(c, 5 * GIB, 4, layout, 512, 24 * GIB, False)  # 5 GiB of weights kept as stored
    assert plan.dram_cache - plan.dram_side_tables == 2 * 32 * 8 * (128 << 10) * 128 * 2  # K and V: 16 GiB
    compute = plan.one_conversation
    assert compute > 5 * GIB + (128 << 10) * 4096 * 4  # the weights and every hidden state in float32
    check_plan(plan, 24 * GIB, False, free_dram=compute + plan.dram_cache, max_seq_len=128 << 10)
    with pytest.raises(ConfigError, match=rf"needs {plan.dram_cache / GIB:.1f} GiB of DRAM beside "
                                          rf"{compute / GIB:.1f} GiB of weights and compute but"):
        check_plan(plan, 24 * GIB, False, free_dram=compute + plan.dram_cache - 1, max_seq_len=128 << 10)
    check_plan(plan, 24 * GIB, True, free_dram=plan.dram_cache, max_seq_len=128 << 10)  # a GPU's DRAM: the cache
    dequantised = plan_memory(c, 4 * num_weight_elements(c), 4, layout, 512, 24 * GIB, False)  # 32 GB of float32
    with pytest.raises(ConfigError, match=r"The weights and the compute need 3\d\.\d GiB of RAM but 24\.0 GiB is "
                                          r"free; use a smaller or more quantised model"):
        check_plan(dequantised, 24 * GIB, False, free_dram=24 * GIB, max_seq_len=128 << 10)


def test_bf16_at_1m_on_a_125_gib_host_is_refused_naming_q8_0():
    plan = plan_for(1 << 20)  # LLaMA-3.1-8B, bf16 K/V, 24 GiB GPU: hidden states in DRAM too
    with pytest.raises(ConfigError, match=r"needs 140.0 GiB of DRAM .* set kv_type: q8_0 \(needs 80.0 GiB\)"):
        check_plan(plan, 24 * GIB, True, free_dram=125 * GIB, max_seq_len=1 << 20)


def test_max_num_seqs_conversations_each_get_a_window_anchors_and_a_cache_and_the_refusal_names_how_many_fit():
    c = random_config("llama-3.1-8b")
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, 128 << 10, "q8_0", page_type="bf16",
                       anchor_type="DYNAMIC", anchor_num=1)
    one = plan_memory(c, 2 * num_weight_elements(c), 2, layout, 8192, 24 * GIB, True, 4096, 1)
    eight = plan_memory(c, 2 * num_weight_elements(c), 2, layout, 8192, 24 * GIB, True, 4096, 1, conversations=8)
    # by hand: q8_0 keeps 34 bytes per 32 values; K and V of 32 layers x 8 heads x 128 at 128K
    assert one.dram_kv == 2 * 32 * 8 * (128 << 10) * 128 * 34 // 32
    assert eight.dram_total == 8 * (one.dram_kv + one.dram_side_tables) + eight.dram_hidden
    window = 2 * 32 * 8 * (128 + 4096 + 2 * 128) * 128 * 2  # sinks, window and two blocks, bf16
    assert one.decode_window == window
    # the anchors' pool: what the budget leaves at the peak, up to eight conversations of max_seq_len's
    beside = one.weights + one.kv_pages + max(one.hidden + one.workspace + 7 * window, 8 * window)
    assert eight.anchors_pool == min(8 * one.decode_anchors, 24 * GIB - beside) > one.decode_anchors
    assert eight.decode_device - one.decode_device == 7 * window + eight.anchors_pool - one.anchors_pool
    assert one.anchors_pool == one.decode_anchors  # a budget with room to spare: one conversation's
    assert "GPU decode window x8" in eight.table() and "DRAM KV (32 global layers) x8" in eight.table()
    check_plan(eight, 24 * GIB, True, free_dram=8 * eight.dram_cache + (1 << 30), max_seq_len=128 << 10)
    # caches hold what their conversations reserve, and the server admits requests as DRAM
    # allows: the plan needs DRAM for one conversation of max_seq_len, not for eight
    check_plan(eight, 24 * GIB, True, free_dram=eight.dram_cache + (1 << 20), max_seq_len=128 << 10)
    with pytest.raises(ConfigError, match=r"The KV cache for max_seq_len 131,072 needs 9\.0 GiB of DRAM but 8\.5 "
                                          r"GiB is free; lower max_seq_len to about 1[23]\d,\d\d\d\."):
        check_plan(eight, 24 * GIB, True, free_dram=eight.dram_cache - (1 << 29), max_seq_len=128 << 10)
    # the server prefills one conversation while the other seven decode: its hidden states and
    # workspace beside seven windows, and the anchors' pool
    assert eight.device_total == beside + eight.anchors_pool <= 24 * GIB
    # a GPU budget that leaves room for five conversations beside one of max_seq_len's anchors:
    # five windows while they decode, four of them beside a prefill
    budget = (one.weights + one.kv_pages + one.decode_anchors
              + max(5 * window, one.hidden + one.workspace + 4 * window) + window // 2)
    assert budget >= one.prefill_device
    with pytest.raises(ConfigError, match=r"lower max_num_seqs to 5, or max_seq_len"):
        check_plan(eight, budget, True, free_dram=1 << 50, max_seq_len=128 << 10)


def test_the_anchors_pool_holds_one_1m_conversation_beside_four_short_ones_within_24_gib():
    """#61's 1M row: four streams of 60K tokens decode while a fifth prefills 1M, 8B shapes, q8_0,
    24 GiB. Five decoders with anchors for 1M each needed 25.7 GiB; a decoder's anchors follow its
    own length, in one pool that holds at least one conversation of max_seq_len's."""
    from ktlong.kv.memory_plan import decode_anchor_bytes

    c = random_config("llama-3.1-8b")
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, 1050624, "q8_0", page_type="bf16",
                       anchor_type="DYNAMIC", anchor_num=1)
    plan = plan_memory(c, 2 * num_weight_elements(c), 2, layout, 4096, 24 * GIB, True, 4096, 1, conversations=5,
                       kept_blocks=32)
    check_plan(plan, 24 * GIB, True, free_dram=1 << 50, max_seq_len=1050624)  # no refusal
    fixed = plan.weights + plan.kv_pages + max(plan.hidden + plan.workspace + 4 * plan.decoder, 5 * plan.decoder)
    assert fixed + 5 * plan.decode_anchors > 25.5 * GIB  # every decoder sized for 1M: over the budget
    # by hand: bfloat16 anchors of 32 layers x 8 heads x 128 channels per block, the scores in
    # float32 and scoring's copy of two layers' anchors
    short = decode_anchor_bytes(layout, 1, -(-(60_000 + 8192) // 128))
    assert short == 533 * (8 * 128 * 2 * 34 + 32 * 8 * 4)
    assert plan.anchors_pool >= plan.decode_anchors + 4 * short and plan.device_total <= 24 * GIB
