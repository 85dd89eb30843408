"""The memory planner's figures and refusals."""

import pytest

from ktlong.errors import ConfigError
from ktlong.kv_cache import kv_layout
from ktlong.memory_plan import GIB, check_plan, plan_memory
from ktlong.random_model import num_weight_elements, random_config

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
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, max_seq_len, "bf16")
    return plan_memory(c, num_weight_elements(c), 2, layout, chunk, int(budget_gb * GIB), True)


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
