"""The batch kernels compile for Hopper (the H100 and H200) on a machine without a GPU, and read
their tiles as wide loads. Triton's interpreter, which runs them in the other CPU tests, takes
code that the compiler refuses (a module global read in a kernel), and shows nothing of how a
load comes out: window kernels that moved each member's pointers by a count of single elements
read K and V two bytes at a time (65 and 64 such loads where 1 and 0 are left now), and a batch
of 8 at 128K decoded at 273 tok/s instead of 367 on the H200."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_batch_kernels_compile_for_hopper_with_wide_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "tests/compile_for_hopper.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loads = {line["kernel"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert len(loads) == 16
    for name in ("window logits", "window values"):  # K and V: 16 bytes a load, but for q's one
        assert loads[name]["narrow"] <= 1, loads[name]
    for name in ("window logits", "scores, shared", "scores, per head", "selected blocks",
                 "selected blocks, sharing", "selected blocks, sharing, borrowed"):
        assert loads[name]["wide"] >= 4, loads[name]
