"""Kernels that compile on first use are compiled before anything is timed, and the next
process loads every one of them from Numba's cache instead of compiling it again."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import json, sys
from ktlong.config import default_config
from ktlong.decode.warm_up import compile_decode_kernels
from ktlong.kv.layout import kv_layout
from ktlong.session.settings import selection_settings

kv_type, anchor_type, cache_blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
layout = kv_layout(4, 2, 64, 16, 1024, kv_type, anchor_type=anchor_type, anchor_num=1)
report = compile_decode_kernels(layout, selection_settings(default_config(anchor_type=anchor_type), 4), 8, 0.125,
                                cache_blocks)
print(json.dumps({"compiled": report.compiled, "loaded": report.loaded}))
"""


def run_once(kv_type: str, anchor_type: str, cache_blocks: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, kv_type, anchor_type, str(cache_blocks)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kv_type,anchor_type,cache_blocks", [("bf16", "DYNAMIC", 0), ("fp32", "QUEST", 0),
                                                              ("q8_0", "MAX", 64)])
def test_second_process_loads_every_decode_kernel_from_the_cache(kv_type, anchor_type, cache_blocks):
    first = run_once(kv_type, anchor_type, cache_blocks)  # compiles what no earlier run has cached
    second = run_once(kv_type, anchor_type, cache_blocks)
    assert second["compiled"] == 0
    # selection (scoring, top-k) and attention (partial, merge); with the block cache also its
    # split, admission and the gathers of quantised pages and of their scales
    assert second["loaded"] == first["compiled"] + first["loaded"] >= (8 if cache_blocks else 4)
