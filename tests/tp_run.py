"""One run of the tensor-parallel comparison (tests/test_tensor_parallel.py): the same prompt
through the dense session and long-context sessions (CompactAttention prefill, sparse decode with
SHARED and SEPARATE head selection), its prefill logits and those of decode steps fed the same
tokens.

Run by the test as `python -m torch.distributed.run --nproc_per_node 2 tests/tp_run.py OUT GGUF
[DEVICE [DTYPE [ARMS]]]` (each rank writes OUT/rank{R}_{arm}.npz; numpy files, no pickle), and in-process
with one rank.
"""

import dataclasses
import os
import sys

import numpy as np

ARMS = {
    "dense": dict(mode="normal"),
    "long_shared": dict(mode="long_context", head_select_mode="SHARED"),
    "long_separate": dict(mode="long_context", head_select_mode="SEPARATE", anchor_type="QUEST"),
    # q8_0 in DRAM, DYNAMIC anchors, blocks scored by torch on the model's device (the GPU's path)
    "long_device_q8": dict(mode="long_context", head_select_mode="SHARED", anchor_type="DYNAMIC",
                           block_scoring="device", kv_type="q8_0"),
    # the GPU's one-graph path: the device scores, selects and reads each rank's blocks from its
    # DRAM cache, SHARED scores summed over the ranks on the device (Triton's interpreter here)
    "long_device_reads": dict(mode="long_context", head_select_mode="SHARED", anchor_type="DYNAMIC",
                              block_scoring="device", kv_type="q8_0"),
}
DEVICE_READS = ("long_device_reads",)  # context_attention gpu, which a CPU's plan never picks
LONG = dict(block_size=16, chunk_size=32, local_windows_len=32, second_select_num=2, preselect_block=True,
            preselect_block_count=4, prefill_attention="compact", anchor_type="MAX", threads_num=1,
            max_new_tokens=12, cpu_stored_weights=False)  # ranks dequantise every weight: so does the one-process reference
PROMPT_LEN, STEPS = 230, 12


def run_arm(gguf: str, arm: str, world: int, device: str = "cpu", dtype: str = "auto"):
    from ktlong.config import default_config
    from ktlong.session.dense import DenseSession
    from ktlong.session.startup import start

    config = default_config(model=gguf, device=device, dtype=dtype, tensor_parallel=world, **{**LONG, **ARMS[arm]})
    started = start(config, log=open(os.devnull, "w"), cpu_engine=False)  # torch's model, as the ranks run
    session = started.session or DenseSession.from_config(started.lm.model, config, started.max_seq_len)
    if arm in DEVICE_READS:
        session.selection = dataclasses.replace(session.selection, context_attention="gpu")
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(0, 300, size=PROMPT_LEN)]
    tokens = [int(t) for t in rng.integers(0, 300, size=STEPS)]
    logits = [session.prefill(prompt).float().cpu().numpy()]
    for token in tokens:
        logits.append(session.step(token).float().cpu().numpy())
    selected = 0
    if started.session is not None and session.decoder.selection is not None:  # the device's: blocks per kv head
        selected = int(session.decoder.body.selected_host.max()) // LONG["block_size"]  # its last step's report
    elif started.session is not None:  # how many blocks the last step's CPU attention read (per kv head)
        selected = max(int(c.max()) for _, c, _ in session.decoder.selector.cache.values())
    return np.stack(logits), np.array(tokens), selected, started


def main(out: str, gguf: str, device: str = "cpu", dtype: str = "auto", arms: str = ""):
    """arms: comma-separated, every arm when empty."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    for arm in arms.split(",") if arms else ARMS:
        logits, tokens, selected, _ = run_arm(gguf, arm, world, device, dtype)
        np.savez(os.path.join(out, f"rank{rank}_{arm}.npz"), logits=logits, tokens=tokens, selected=selected)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(*sys.argv[1:])
