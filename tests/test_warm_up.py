"""Kernels that compile on first use are compiled before anything is timed, and the next
process loads every one of them from Numba's cache instead of compiling it again."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_ops import int8_runs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import json, sys
from ktlong.config import default_config
from ktlong.decode.warm_up import compile_decode_kernels, kernel_dispatchers
from ktlong.kv.layout import kv_layout
from ktlong.session.settings import selection_settings

kv_type, anchor_type = sys.argv[1], sys.argv[2]
layout = kv_layout(4, 2, 64, 16, 1024, kv_type, anchor_type=anchor_type, anchor_num=1)
report = compile_decode_kernels(layout, selection_settings(default_config(anchor_type=anchor_type), 4), 8, 0.125)
loaded = [d.py_func.__name__ for d in kernel_dispatchers() if d.stats.cache_hits]
print(json.dumps({"compiled": report.compiled, "loaded": report.loaded, "names": sorted(loaded)}))
"""


def run_once(kv_type: str, anchor_type: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, kv_type, anchor_type], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # seconds on the 2-core machine: the full suite runs it, the fast lane does not
@pytest.mark.parametrize("kv_type,anchor_type", [("bf16", "DYNAMIC"), ("fp32", "QUEST"), ("q8_0", "MAX")])
def test_second_process_loads_every_decode_kernel_from_the_cache(kv_type, anchor_type):
    run_once(kv_type, anchor_type)  # compiles what no earlier run has cached
    second = run_once(kv_type, anchor_type)
    assert second["compiled"] == 0
    # the kernels decode calls, each loaded whole (their callees compiled into them): selection
    # (scoring, top-k) and attention (this storage type's partial states, and their merge)
    assert second["names"] == sorted(["score_blocks", "select_blocks", f"partial_attention_{kv_type}", "_merge_items"])
    assert second["loaded"] == 4


WEIGHTS_SCRIPT = """
import json, sys
import numpy as np
from gguf import GGMLQuantizationType as T
from cpu_ops.gguf_blocks import BLOCK_SIZE, TYPE_SIZE
from cpu_ops.gguf_matmul import _KERNELS
from ktlong.gguf.stored_matrix import StoredMatrix, compile_kernels

types = [T[name] for name in sys.argv[1:]]
compile_kernels([StoredMatrix(np.zeros((4, 256 // BLOCK_SIZE[t] * TYPE_SIZE[t]), np.uint8), t, (4, 256)) for t in types])
stats = {k.py_func.__name__: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())]
         for t in types for k in _KERNELS[t]}
print(json.dumps(stats))
"""


@pytest.mark.slow
def test_second_process_loads_every_weight_kernel_from_the_cache():
    """The products and dequantisation of K types, whose 8-bit products call a helper compiled
    into them (not cached itself): the next process finds each kernel in the cache (one whose
    closure held another kernel would get a new cache key in every process, and compile again).
    The 8-bit products run where the machine has AVX2."""
    def run():
        out = subprocess.run([sys.executable, "-c", WEIGHTS_SCRIPT, "Q4_K", "Q6_K"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    run()
    second = run()
    kernels = ("matmul", "dequantize") + (("int8_matmul",) if int8_runs.AVAILABLE else ())
    assert all(second[f"{k}_{t}"] == [1, 0] for t in ("Q4_K", "Q6_K") for k in kernels), second
