"""The torch-free CPU engine (ktlong/models/cpu_llama.py): its exp and its chunk attention
against numpy's and torch's, its prefill and decode against torch's model over the same bf16
cache, the models it takes, and a chat on the CPU that never imports torch."""

import subprocess
import sys
from pathlib import Path

import numba as nb
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import cpu_ops.chunk_attention as chunk
from cpu_ops.bf16 import from_bf16, to_bf16
from cpu_ops.exp import exp_nonpositive
from cpu_ops.workers import Workers
from ktlong.config import load_config
from ktlong.gguf.weights import CpuWeights
from ktlong.models.cpu_llama import CpuLlama, unsupported
from ktlong.models.loader import load_model, open_model
from ktlong.session.cpu_dense import CpuDenseSession
from ktlong.session.dense import DenseSession
from ktlong.session.startup import cpu_engine_refusal
from operators.dense_attention import dense_attention
from tests.tiny_gguf import TinySpec, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


@nb.njit
def _exp_all(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = exp_nonpositive(x[i])
    return out


def test_exp_is_numpys_within_4e_6():
    x = -np.concatenate([np.linspace(0, 87, 200001), [0.5, 1e-7, 0.0]]).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(_exp_all(x) - want) / want) < 4e-6
    tiny = _exp_all(np.array([-90.0, -200.0, -1e30, -np.inf], np.float32))
    assert np.all((tiny >= 0) & (tiny < 1.2e-38))


@pytest.mark.parametrize("num_q, heads, kv, end", [(37, 8, 2, 300), (64, 4, 4, 64), (1, 6, 3, 129), (48, 9, 3, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunk_attention_is_dense_attention(num_q, heads, kv, end, threads, monkeypatch):
    monkeypatch.setattr(chunk, "SCORE_BUDGET", 3000)  # blocks of a few queries: the block edges are tested too
    rng = np.random.default_rng(end)
    q = rng.standard_normal((num_q, heads, 32)).astype(np.float32)
    keys, values = (to_bf16(rng.standard_normal((kv, end + 20, 32)).astype(np.float32)) for _ in range(2))
    got = chunk.chunk_attention(q, keys, values, end, 0.3, Workers(threads))
    want = dense_attention(torch.from_numpy(q), torch.from_numpy(from_bf16(keys)[:, :end]),
                           torch.from_numpy(from_bf16(values)[:, :end]), 0.3)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


SPECS = {
    "llama": (TinySpec(hidden=128, intermediate=160, num_heads=4, num_kv_heads=2, head_dim=32, context=1024), {}),
    "qwen2 biases, mixed types": (
        TinySpec(arch="qwen2", hidden=128, intermediate=96, num_heads=8, num_kv_heads=2, head_dim=16, qkv_bias=True,
                 tied=True, weight_type=T.Q4_1, context=1024),
        {f"blk.{i}.attn_{p}.weight": t for i in range(2) for p, t in (("q", T.Q4_0), ("k", T.Q5_1), ("v", T.Q8_0))}),
}


@pytest.mark.parametrize("name", SPECS)
def test_prefill_and_decode_are_torchs_over_the_same_cache(tmp_path, name):
    """Two prefill chunks and a short follow-up: the logits and the bf16 cache are torch's
    model's (stored weights, a bf16 cache) within float32 sums. Then four decode steps, the same
    Numba step on both sides: the caches are a bf16 rounding apart here and there, which the
    step's 8-bit inputs can round apart (test_cpu_decode.py's bound)."""
    spec, types = SPECS[name]
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=5, tensor_types=types)
    gf, config = open_model(str(tmp_path / "m.gguf"))
    assert unsupported(gf, config) is None
    ours = CpuDenseSession(CpuLlama.from_gguf(gf, config), 400, 128)
    torchs = DenseSession(load_model(str(tmp_path / "m.gguf"), cpu=CpuWeights(stored=True)).model, 400, 128,
                          torch.bfloat16)
    prompt = np.random.default_rng(2).integers(0, spec.vocab - 2, 300).tolist()
    for ids in (prompt[:250], prompt):  # the second prefill reuses 250 tokens and computes 50
        np.testing.assert_allclose(ours.prefill(ids), torchs.prefill(ids).numpy(), rtol=2e-3, atol=2e-3)
    token = 7
    for _ in range(4):
        got, want = ours.step(token), torchs.step(token).numpy()
        assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) > 0.9999
        assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
        token = int(want.argmax())
    for layer in range(config.num_layers):
        for mine, theirs in ((ours.cache.keys, torchs.cache.words.keys), (ours.cache.values, torchs.cache.words.values)):
            a, b = from_bf16(mine[layer][:, :304]), from_bf16(theirs[layer][:, :304])
            np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=1e-3)  # a bf16 rounding apart at most


def test_models_it_does_not_take_say_why(tmp_path):
    write_tiny_gguf(tmp_path / "g.gguf", TinySpec(arch="gemma3", num_heads=4, num_kv_heads=1, sliding_window=64))
    assert "gemma3" in unsupported(*open_model(str(tmp_path / "g.gguf")))
    write_tiny_gguf(tmp_path / "f.gguf", TinySpec(), tensor_types={"blk.1.ffn_down.weight": T.F16})
    gf, config = open_model(str(tmp_path / "f.gguf"))
    assert unsupported(gf, config) == "blk.1.ffn_down.weight is F16, which the CPU kernels do not read"
    write_tiny_gguf(tmp_path / "m.gguf", TinySpec())
    gf, config = open_model(str(tmp_path / "m.gguf"))

    def refusal(**options):
        overrides = {"device": ("cpu", "test")} | {k: (v, "test") for k, v in options.items()}
        return cpu_engine_refusal(load_config(overrides=overrides, write_user_file=False), gf, config)

    assert refusal() is None
    assert refusal(cpu_engine="torch") == "cpu_engine is torch"
    assert refusal(kv_type="fp32") == refusal(cpu_stored_weights=False) != None
    assert refusal(mode="long_context") == "it runs normal mode on one CPU process"


def test_chat_on_the_cpu_never_imports_torch(tmp_path):
    """local_chat.py on the CPU: the engine answers, and torch is never imported (about 200 MB
    of the process's memory); the same model under cpu_engine torch answers the same."""
    write_tiny_gguf(tmp_path / "m.gguf", TinySpec(context=1024), seed=3)
    probe = ("import atexit, runpy, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, "
             "file=sys.stderr)); sys.argv = ['local_chat.py'] + sys.argv[1:]; runpy.run_path('local_chat.py', "
             "run_name='__main__')")
    answers = []
    for engine in ("auto", "torch"):
        run = subprocess.run([sys.executable, "-c", probe, "--device", "cpu", "--gguf_path", str(tmp_path / "m.gguf"),
                              "--max_new_tokens", "6", "--set", f"cpu_engine={engine}", "--set", "use_chat_template=false"],
                             input="a b c\n", capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert run.returncode == 0, run.stderr
        assert f"torch imported: {engine == 'torch'}" in run.stderr
        assert ("on cpu (numpy and Numba)" in run.stderr) == (engine == "auto")
        answers.append(run.stdout)
    assert answers[0] == answers[1] and answers[0].strip()


ENGINES = {  # normal mode's dense sessions: the CPU engine's, torch's with the Numba step, torch's gemma3
    "cpu_engine": SPECS["llama"][0],
    "torch": SPECS["llama"][0],
    "torch gemma3": TinySpec(arch="gemma3", hidden=128, intermediate=160, num_heads=4, num_kv_heads=1, head_dim=32,
                             context=1024, sliding_window=64, tied=True),
}


def _model(path: Path, engine: str):
    if engine == "cpu_engine":
        return CpuLlama.from_gguf(*open_model(str(path)))
    return load_model(str(path), cpu=CpuWeights(stored=True)).model


@pytest.mark.parametrize("engine", ENGINES)
def test_the_session_compiles_behind_the_notice_and_forgets_its_warm_up(tmp_path, capsys, engine):
    """The session made for a chat or the server runs its kernels once behind the start-up
    notice (a fresh install would otherwise stop the first answer after its first word for half
    a minute and count that in its speed), and what it ran leaves no trace: a prompt's logits
    and the steps after it equal a session's that never warmed up."""
    from ktlong.config import default_config
    from ktlong.session.chunked import dense_session

    spec = ENGINES[engine]
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=5)
    model = _model(tmp_path / "m.gguf", engine)
    config = default_config(chunk_size=128)
    capsys.readouterr()
    warmed = dense_session(model, config, 400)
    notice = capsys.readouterr().err
    assert notice.startswith("[kernels that compile on first use:") and "before anything is timed]" in notice
    assert warmed.ids == []
    cold = (CpuDenseSession(model, 400, warmed.chunk_size) if engine == "cpu_engine"
            else DenseSession.from_config(model, config, 400))
    prompt = np.random.default_rng(3).integers(0, spec.vocab - 2, 200).tolist()
    got, want = warmed.prefill(prompt), cold.prefill(prompt)
    for token in (5, 9, 11):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        got, want = warmed.step(token), cold.step(token)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


WARM_UP_PROBE = """
import sys
import numpy as np
from numba.core.dispatcher import Dispatcher
from ktlong.config import default_config
from ktlong.session.chunked import dense_session
from tests.test_cpu_engine import ENGINES, _model

compiled = []  # a kernel signature compiled or loaded from Numba's cache: a Dispatcher.compile call
original = Dispatcher.compile
Dispatcher.compile = lambda self, sig: (compiled.append(self.py_func.__name__), original(self, sig))[1]
engine, path = sys.argv[1:]
model = _model(path, engine)
before = len(compiled)
session = dense_session(model, default_config(chunk_size=128), 400)
during = len(compiled) - before
session.prefill(np.arange(200).tolist())
for token in (5, 9, 11):
    session.step(token)
print(during, compiled[before + during:])
"""


@pytest.mark.parametrize("engine", ["cpu_engine", "torch gemma3"])
def test_after_the_warm_up_nothing_compiles(tmp_path, engine):
    """In a fresh process the warm-up is what compiles (or loads from Numba's cache) the kernels
    the model's weights did not: the first prompt and steps after it find every one ready."""
    write_tiny_gguf(tmp_path / "m.gguf", ENGINES[engine], seed=5)
    run = subprocess.run([sys.executable, "-c", WARM_UP_PROBE, engine, str(tmp_path / "m.gguf")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    during, after = run.stdout.split(" ", 1)
    assert int(during) > 0 and after.strip() == "[]"
