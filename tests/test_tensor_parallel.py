"""Tensor parallelism on the CPU over gloo: two processes give the logits one gives (float32,
1e-4) for the dense forward, CompactAttention prefill and sparse decode with SHARED and SEPARATE
selection; the chat and the server under torchrun (a qwen2 model: its q/k/v biases split with
their heads) answer as one process; refusals come before any weight is read."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ktlong.errors import ConfigError
from tests.tiny_gguf import TinySpec, write_tiny_gguf
from tests.tp_run import ARMS, DEVICE_READS, PROMPT_LEN, run_arm

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=3, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate=256), seed=9)
    return path


@pytest.fixture(scope="module")
def biased_path(tmp_path_factory):
    """The commands' model: qwen2's q/k/v biases split with their heads."""
    path = tmp_path_factory.mktemp("tp_biased") / "tiny.gguf"  # served as "tiny"
    write_tiny_gguf(path, TinySpec(arch="qwen2", qkv_bias=True, num_layers=3, hidden=256, num_heads=4, num_kv_heads=2,
                                   head_dim=64, intermediate=256), seed=9)
    return path


def torchrun(n: int, *args, env=None, timeout=600):
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                           "--standalone", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)  # torchrun's signals to its group stay there


@pytest.fixture(scope="module")
def two_ranks(tiny_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_out")
    done = torchrun(2, "tests/tp_run.py", out, tiny_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# an arm whose one-process reference is another arm's run: the device's selection and reads
# against the host's and the Numba operator's over the same blocks (an independent reference,
# and Triton's interpreter runs once less)
REFERENCE = {"long_device_reads": "long_device_q8"}
_one_process: dict = {}


def one_process(tiny_path, arm: str, dtype: str = "float32"):
    """One process's logits, tokens and selection on the CPU, run once per module (in float32
    they are the exact reference of every test here)."""
    if (arm, dtype) not in _one_process:
        _one_process[arm, dtype] = run_arm(str(tiny_path), arm, 1, "cpu", dtype)[:3]
    return _one_process[arm, dtype]


@pytest.mark.parametrize("arm", list(ARMS))
def test_two_ranks_give_the_logits_of_one(tiny_path, two_ranks, arm, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    expected, _, selected = one_process(tiny_path, REFERENCE.get(arm, arm))
    got = np.load(two_ranks / f"rank0_{arm}.npz")
    other = np.load(two_ranks / f"rank1_{arm}.npz")
    scale = np.abs(expected).max()
    assert np.abs(got["logits"] - expected).max() / scale < 1e-4
    assert np.abs(other["logits"] - got["logits"]).max() == 0  # ranks agree: the same all-reduced numbers
    if arm != "dense":  # decode really was sparse: 2 of the context's blocks, on both sides
        context_blocks = PROMPT_LEN // 16
        assert selected == int(got["selected"]) == 2 < context_blocks - 4


def test_a_model_that_does_not_split_is_refused_before_loading(tiny_path, tmp_path):
    odd = tmp_path / "odd.gguf"
    write_tiny_gguf(odd, TinySpec(num_heads=3, num_kv_heads=3, head_dim=32), seed=1)
    done = torchrun(2, "local_chat.py", "--model", odd, "--tensor_parallel", "2", "--device", "cpu",
                    env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert done.returncode != 0
    assert "This model's 3 kv heads do not split over 2 ranks" in done.stderr


def test_rank_counts_that_do_not_match_are_refused(tiny_path, monkeypatch):
    from ktlong.parallel.group import start_tensor_parallel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node 2"):
        start_tensor_parallel(2, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="pass --tensor_parallel 2"):
        start_tensor_parallel(1, "cpu")
    monkeypatch.setenv("RANK", "0")
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="needs 2 GPUs but this machine has 1"):
        start_tensor_parallel(2, "cuda")


def test_context_limit_is_where_the_plan_stops_fitting(capsys):
    """The bench's limits are the planner's own: the plan fits at the limit and not one block
    later; half the weights per rank leave more room for the context."""
    import torch

    from ktlong.bench.context_limit import main
    from ktlong.config import load_config, parse_set
    from ktlong.kv.memory_plan import GIB
    from ktlong.models.random_model import num_weight_elements, random_config
    from ktlong.parallel.shard import shard_config
    from ktlong.session.plan import plan_session

    assert main(["--tensor_parallel", "1,2", "--gpu_cap_gb", "20", "--dram_gb", "4000"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("|  ")]
    limits = {int(r[0]): int(r[1].replace(",", "")) for r in rows}
    config = load_config(overrides=parse_set(["gpu_memory_budget_gb=20"]), write_user_file=False)
    for n, limit in limits.items():
        c = shard_config(random_config("llama-3.1-8b"), n)
        need = lambda t: plan_session(config, c, 2 * num_weight_elements(c), t, torch.device("cuda"),
                                      torch.bfloat16).memory.device_total
        assert need(limit) <= 20 * GIB < need(limit + config.block_size)
    assert limits[2] > 2 * limits[1]


# In bfloat16 two ranks are held to one process's own rounding: both are measured against the
# exact (float32, one process) logits, and the ranks' departure may be at most this much more than
# one process's. On the CPU (gloo) the tiny model's bfloat16 logits depart from float32 by 19% of
# the largest logit in one process and 18% on two ranks (dense), 83% and 77% (SHARED: rounding
# flips selections), 44% and 44% (SEPARATE), 104% and 104% (q8_0, device scoring); a fixed bound
# of 3% between two GPUs and one (the NCCL test's, failed at 5.9%) was below bfloat16's own error.
ROUNDING_MARGIN = 1.25


def bf16_within_one_process_rounding(two: np.ndarray, one: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    scale = np.abs(exact).max()
    return np.abs(two - exact).max() / scale, np.abs(one - exact).max() / scale


def test_two_ranks_in_bfloat16_round_as_one_process_does(tiny_path, tmp_path, monkeypatch):
    """bfloat16 over gloo: each arm's logits on two ranks depart from the exact ones no further
    than one process's bfloat16 logits do (ROUNDING_MARGIN), and the ranks agree bit for bit.
    The arm of the device's reads is left out: the float32 test holds it to one process, the
    NCCL test in bfloat16 on two GPUs; here it would add three runs of Triton's interpreter, the
    slowest of the file."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    arms = [arm for arm in ARMS if arm not in DEVICE_READS]
    done = torchrun(2, "tests/tp_run.py", tmp_path, tiny_path, "cpu", "bfloat16", ",".join(arms))
    assert done.returncode == 0, done.stderr[-3000:]
    for arm in arms:
        exact, one = one_process(tiny_path, REFERENCE.get(arm, arm))[0], one_process(tiny_path, arm, "bfloat16")[0]
        got, other = (np.load(tmp_path / f"rank{r}_{arm}.npz")["logits"] for r in (0, 1))
        two_error, one_error = bf16_within_one_process_rounding(got, one, exact)
        assert 0 < one_error and two_error <= ROUNDING_MARGIN * one_error, (arm, two_error, one_error)
        assert np.abs(other - got).max() == 0


@pytest.mark.gpu
def test_two_gpus_over_nccl_give_the_logits_of_one(tiny_path, tmp_path, monkeypatch):
    """The same comparison on two GPUs (NCCL, bf16, FlashInfer, CUDA graphs on): the two GPUs'
    logits depart from the exact ones (float32, one process on the CPU) no further than one GPU's
    do (ROUNDING_MARGIN), and the ranks agree bit for bit."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    done = torchrun(2, "tests/tp_run.py", tmp_path, tiny_path, "cuda")
    assert done.returncode == 0, done.stderr[-3000:]
    for arm in ARMS:
        exact, one = one_process(tiny_path, REFERENCE.get(arm, arm))[0], run_arm(str(tiny_path), arm, 1, "cuda")[0]
        got, other = (np.load(tmp_path / f"rank{r}_{arm}.npz")["logits"] for r in (0, 1))
        two_error, one_error = bf16_within_one_process_rounding(got, one, exact)
        assert two_error <= ROUNDING_MARGIN * one_error, (arm, two_error, one_error)
        assert np.abs(other - got).max() == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_saved_cache_under_torchrun_is_a_part_a_rank_and_reads_back_as_one_process_goes_on(biased_path, tmp_path,
                                                                                           device):
    """Rank 0 reads the chat's input and every rank follows. Each rank writes its kv heads' part
    of the cache (PATH.rank0-of-2, PATH.rank1-of-2); two ranks started again from them answer the
    next question as a chat that never stopped answers it: one process on the CPU (float32 sums alike), two ranks on two GPUs (bfloat16's partial
    sums round otherwise on one GPU). A missing part is refused on every rank, naming the rank and
    the file, and the command exits non-zero."""
    import torch

    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"w{i % 97}" for i in range(70)) + "\n")
    saved = tmp_path / "chat.kv"
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    options = ["--model", biased_path, "--device", device, "--mode", "long_context", "--max_new_tokens", "12",
               "--set", "block_size=16", "--set", "local_windows_len=64", "--set", "chunk_size=128"]

    def chat(ranks: int, lines: str, *more):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "local_chat.py", "--tensor_parallel", "2"] if ranks == 2 else [sys.executable, "local_chat.py"]
        base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        return subprocess.run([*command, *map(str, options), *map(str, more)], input=lines, cwd=ROOT,
                              env={**base, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                              timeout=600, start_new_session=True)  # torchrun's signals to its group stay there

    first = chat(2, "\n", "--prompt_file", doc, "--save_kv", saved)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[rank 0 of 2: 2 heads, 1 kv heads" in first.stderr  # each rank its half of the heads
    parts = sorted(p.name for p in tmp_path.glob("chat.kv*"))
    assert parts == ["chat.kv.rank0-of-2", "chat.kv.rank1-of-2"]
    again = chat(2, "w5 w6 w7\n", "--load_kv", saved)
    assert again.returncode == 0, again.stderr[-3000:]
    one = chat(1 if device == "cpu" else 2, "\nw5 w6 w7\n", "--prompt_file", doc)
    assert one.returncode == 0, one.stderr[-3000:]
    assert again.stdout.strip() and one.stdout.endswith(again.stdout)  # the third answer, the reference's
    reused = re.findall(r"\((\d+) from the cache, (\d+) prefilled\)", one.stderr)[-1]
    assert re.findall(r"\((\d+) from the cache, (\d+) prefilled\)", again.stderr) == [reused]
    loaded = int(re.search(r"\[loaded (\d+) tokens of KV cache", again.stderr)[1])
    assert int(reused[0]) <= loaded
    if device == "cpu":  # the known counts of this prompt's one-process run
        assert (loaded, reused[0]) == (297, "286")
    (tmp_path / "chat.kv.rank1-of-2").unlink()
    missing = chat(2, "w5 w6 w7\n", "--load_kv", saved)
    assert missing.returncode != 0 and not missing.stdout
    assert f"[not loaded: rank 1: Saved cache {tmp_path}/chat.kv.rank1-of-2 does not exist" in missing.stderr


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_server_under_torchrun_answers_as_its_reference_does(biased_path, tmp_path, device):
    """`torchrun ... -m ktlong.server --tensor_parallel 2`: rank 0 serves HTTP and both ranks run
    each prefill and step. Through the official client, a question, a follow-up that extends its
    conversation (the ranks reuse their caches alike) and a streamed completion get the answers
    of the reference: on the CPU a one-process server with its weights dequantised as a rank's are
    (float32 sums alike; kept as stored, its products would take 8-bit inputs), on two GPUs the chat
    on the same two GPUs, sent the same messages (bfloat16's partial sums round otherwise on one
    GPU; the chat renders and encodes messages by its own code). The server stops on SIGINT with
    status 0."""
    import signal

    import torch

    from tests.http_server import LaunchedServer

    openai = pytest.importorskip("openai")
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    options = ["--model", biased_path, "--device", device, "--mode", "long_context", "--max_new_tokens", "10",
               "--set", "block_size=16", "--set", "local_windows_len=64", "--set", "chunk_size=64",
               "--set", "temperature=0"]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = {**base, "OMP_NUM_THREADS": "1", "XDG_CONFIG_HOME": str(tmp_path)}
    document = " ".join(f"w{i % 89}" for i in range(90))  # about 360 tokens of the tiny model's 512
    question, follow_up, completion_tokens = "Which word comes after w7?", "And after w8?", 8
    two_ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

    def rank0(launcher: int) -> int:
        """torchrun's rank-0 process (a signal to torchrun itself ends in its own traceback)."""
        for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
            if b"RANK=0" in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                return int(child)
        raise AssertionError("no rank 0 under torchrun")

    def answers(ranks: int) -> tuple[list[str], str]:
        launch = ([*two_ranks, "-m", "ktlong.server", "--tensor_parallel", "2"] if ranks == 2 else
                  [sys.executable, "-m", "ktlong.server", "--set", "cpu_stored_weights=false"])
        # a session of its own: a signal meant for its processes' group never reaches pytest's
        server = LaunchedServer([*launch, *map(str, options)], cwd=ROOT, env=env, start_new_session=True)
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
            messages = [{"role": "user", "content": f"{document}\n{question}"}]
            first = client.chat.completions.create(model="tiny", messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": follow_up}]
            second = client.chat.completions.create(model="tiny", messages=messages)
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model="tiny", prompt=document[:200], max_tokens=completion_tokens, stream=True) if chunk.choices)
            reused = second.usage.prompt_tokens_details.cached_tokens
            assert reused > 300  # the follow-up prefilled only its new tokens, on every rank
            got = [first.choices[0].message.content, second.choices[0].message.content, streamed]
        finally:
            if server.process.poll() is None:  # a launcher that already exited has no rank 0 to signal
                os.kill(rank0(server.process.pid) if ranks == 2 else server.process.pid, signal.SIGINT)
            code = server.wait(120)
        log = server.log()
        assert code == 0, log[-3000:]
        return got, log

    def chat_on_two_ranks() -> list[str]:
        """The same messages through local_chat.py on the same two ranks: the question as one
        multi-line message and the follow-up; the completion as a message without the template."""
        def chat(lines: str, *more) -> str:
            done = subprocess.run([*two_ranks, "local_chat.py", "--tensor_parallel", "2", *map(str, [*options, *more])],
                                  input=lines, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                                  start_new_session=True)  # torchrun's signals to its group stay there
            assert done.returncode == 0, done.stderr[-3000:]
            return done.stdout

        conversation = chat(f'"""\n{document}\n{question}\n"""\n{follow_up}\n')
        plain = chat(f"{document[:200]}\n", "--set", "use_chat_template=false",
                     "--max_new_tokens", completion_tokens)
        return [conversation, plain]

    two, log = answers(2)
    assert all(two) and "Traceback" not in log
    if device == "cpu":
        assert two == answers(1)[0]
    else:  # the chat prints each answer and a line's end
        assert chat_on_two_ranks() == [f"{two[0]}\n{two[1]}\n", f"{two[2]}\n"]
