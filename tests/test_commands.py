"""The benchmark and evaluation commands: every error a user can cause is one sentence and a
non-zero exit, and the capture benchmark keeps the keys prefill computed."""

import io
import sys

import numpy as np
import pytest
import torch

from ktlong.bench.__main__ import main as bench
from ktlong.eval.__main__ import main as evaluate
from tests.tiny_gguf import TinySpec, write_tiny_gguf


@pytest.fixture
def no_user_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def one_sentence_error(capsys, *needles):
    lines = [l for l in capsys.readouterr().err.strip().splitlines()
             if not l.startswith("ktlong: wrote the default configuration")]  # the first run's notice
    err = "\n".join(lines)
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize("argv,needles", [
    (["prefill", "--lengths", "12q", "--device", "cpu"], ["'12q'", "32k"]),
    (["decode", "--device", "tpu"], ["'device' = 'tpu'", "cuda:N"]),  # was torch's RuntimeError
    (["serve", "--model", "smollm2-135m", "--tokens", "1000000000"], ["--tokens", "from 2 to 8,192"]),
    (["prefill", "--set", "block_sise=64"], ["block_sise", "did you mean 'block_size'"]),
    (["prefill", "--set", "chunk_size=100", "--device", "cpu"], ["chunk_size", "multiple of block_size"]),
    (["decode", "--set", "kv_type=int3"], ["kv_type", "bf16, fp16"]),
    (["decode", "--contexts", "0"], ["'0'"]),
    (["decode", "--batch", "2,x"], ["--batch", "1,2,4,8", "2,x"]),
    (["decode", "--selection_drift", "1.5"], ["--selection_drift", "from 0 to 1", "1.5"]),
    (["decode", "--tokens", "999999999999"], ["--tokens", "from 1 to 4,096"]),  # not the batch's DRAM
    (["decode", "--device", "cpu", "--contexts", "1m", "--batch", "256"], ["--batch 256", "fit in this machine's DRAM"]),
    (["decode-op", "--contexts", "big"], ["'big'"]),
    # counts bounded before the work: these were an allocation's traceback (top_k, contexts), a
    # broadcast's (a window past the context) or a loop for years (reps, runs, repeats, prompts)
    (["decode-op", "--top_k", "99999999999"], ["--top_k", "from 1 to 4,096", "99,999,999,999"]),
    (["decode-op", "--contexts", "32k", "--local", "32768"], ["--local", "from 0 to 32,640", "32,768"]),
    (["decode-op", "--contexts", "99999999k"], ["GiB of DRAM", "use shorter contexts"]),
    (["decode-op", "--reps", "0"], ["--reps", "from 1 to 1,000"]),
    (["cpu-weights", "--runs", "101"], ["--runs", "from 1 to 100"]),
    (["structured", "--runs", "99999999999"], ["--runs", "from 1 to 100"]),
    (["prefill", "--runs", "0"], ["--runs", "from 1 to 100"]),
    (["follow-up", "--repeats", "99999999999"], ["--repeats", "from 1 to 100"]),
    (["kv-fidelity", "--prompts", "99999999999"], ["--prompts", "from 1 to 10,000"]),
    (["selection-drift", "--tokens", "8", "--window", "9"], ["--window", "at most --tokens", "from 1 to 8"]),
    (["kept-keys", "--depth", "2"], ["--depth", "0..1"]),
    (["kept-keys", "--set", "api_key=x"], ["api_key", "leave it out"]),
    (["decode", "--device", "cpu", "--modes", "hybrid,graphs"], ["graphs modes", "need a GPU"]),
    (["structured", "--tokens", "1"], ["--tokens"]),
    (["cache-hits", "--model", "smollm2-135m", "--docs", "9"], ["--docs must be 2 to 6"]),
    (["cache-hits", "--model", "smollm2-135m", "--set", "block_sise=64"], ["block_sise"]),
])
def test_bench_errors_are_one_sentence(no_user_file, capsys, argv, needles):
    assert bench(argv) == 2
    one_sentence_error(capsys, *needles)


@pytest.mark.parametrize("argv", [
    ["prefill", "--set", "second_select_num=8"], ["prefill", "--set", "temperature=1"],
    ["decode", "--set", "keep_blocks=64"], ["decode", "--set", "context_attention=gpu"],
    ["follow-up", "--set", "port=9000"], ["context-limit", "--set", "alpha=0.5"],
    ["kv-fidelity", "--set", "selector=xattention"], ["selection-drift", "--set", "max_new_tokens=3"],
    ["structured", "--set", "temperature=0.7"],
])
def test_benches_refuse_options_they_would_not_read(no_user_file, capsys, argv):
    assert bench(argv) == 2
    one_sentence_error(capsys, argv[-1].split("=")[0].join("''"), "leave it out")


@pytest.mark.parametrize("argv", [["passkey", "--set", "temperature=0.7"], ["passkey", "--set", "mode=normal"],
                                  ["passkey", "--attention", "dense,sparse@api_key=x"]])
def test_eval_refuses_options_it_would_not_read(no_user_file, capsys, argv):
    assert evaluate(argv) == 2
    one_sentence_error(capsys, "leave it out")


def test_every_option_a_command_reads_exists():
    from ktlong.bench import context_limit, decode, follow_up, kv_fidelity, prefill, selection_drift
    from ktlong.config import greedy_session_options, option_names

    for reads in (context_limit.READS, decode.READS, follow_up.READS, kv_fidelity.READS, prefill.READS,
                  selection_drift.READS, greedy_session_options()):
        assert reads <= set(option_names())


@pytest.mark.slow  # seconds on the 2-core machine: the full suite runs it, the fast lane does not
def test_prefill_bench_runs_the_configs_prefill_against_dense(no_user_file, capsys):
    args = ["prefill", "--shape", "tiny", "--lengths", "16k", "--device", "cpu", "--set", "block_size=64",
            "--set", "chunk_size=1024", "--set", "prefill_dense_layer_num=0"]
    assert bench(args + ["--set", "keep_blocks=8"]) == 0
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("|") and "16K" in line]
    by_arm = {row[2]: row for row in rows}
    assert set(by_arm) == {"compact", "dense"}
    # 8 of 16K/64 = 256 history blocks at most: the kept fraction is the mean of 8/history over the chunks
    history = [s // 64 for s in range(1024, 16384, 1024)]
    expected = sum(min(1.0, 8 / h) if 8 <= 0.9 * h else 1.0 for h in history) / len(history)
    assert by_arm["compact"][3] == f"{expected:.1%}" and by_arm["dense"][3] == "100.0%"
    assert by_arm["dense"][11] == "1.00x"
    assert bench(args + ["--set", "prefill_attention=dense"]) == 0
    arms = [line.split("|")[3].strip() for line in capsys.readouterr().out.splitlines() if "16K" in line]
    assert arms == ["dense"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
@pytest.mark.parametrize("name", ["attention"])
def test_gpu_benches_say_they_need_a_gpu(no_user_file, capsys, name):
    assert bench([name]) == 2
    one_sentence_error(capsys, "needs a CUDA GPU")


def test_a_plan_that_does_not_fit_is_refused_before_any_weight(no_user_file, capsys, monkeypatch):
    """1M tokens of float32 K/V for LLaMA-3.1-8B on a CPU: 256 GiB of cache beside 32 GB of float32
    weights and 16 GiB of hidden states."""
    import ktlong.session.plan

    monkeypatch.setattr(ktlong.session.plan, "available_dram_bytes", lambda: 140 << 30)
    assert bench(["prefill", "--lengths", "1m", "--device", "cpu", "--set", "kv_type=fp32"]) == 2
    one_sentence_error(capsys, "needs 260.0 GiB of DRAM beside 54.3 GiB of weights and compute but 140.0 GiB is free",
                       "set kv_type: q8_0 (needs 72.0 GiB) or lower max_seq_len to about 345,")
    monkeypatch.setattr(ktlong.session.plan, "available_dram_bytes", lambda: 100 << 30)  # q8_0 does not fit either
    assert bench(["prefill", "--lengths", "1m", "--device", "cpu", "--set", "kv_type=fp32"]) == 2
    one_sentence_error(capsys, "260.0 GiB of DRAM beside 54.3 GiB of weights and compute but 100.0 GiB is free; "
                       "lower max_seq_len to about 184,")
    monkeypatch.setattr(ktlong.session.plan, "available_dram_bytes", lambda: 40 << 30)
    assert bench(["prefill", "--lengths", "1m", "--device", "cpu", "--set", "kv_type=fp32"]) == 2
    one_sentence_error(capsys, "The weights and the compute need 54.3 GiB of RAM but 40.0 GiB is free")


@pytest.mark.parametrize("argv,needles", [
    (["passkey", "--lengths", "2k", "--set", "alpah=0.1"], ["alpah", "did you mean 'alpha'"]),
    (["passkey", "--lengths", "2k", "--attention", "both"], ["--attention"]),
    (["needle", "--lengths", "2k", "--depths", "0,half"], ["--depths"]),
    (["passkey", "--lengths", "two"], ["'two'"]),
    (["passkey", "--lengths", "2k", "--samples", "0"], ["--samples is", "(got 0)"]),
    (["passkey", "--lengths", "2k", "--samples", "99999999999"], ["--samples is the samples per (length, depth) cell, from 1 to 10,000 (got 99,999,999,999)"]),
    (["passkey", "--lengths", "2k", "--model", "/nonexistent/model.gguf"], ["model.gguf"]),
])
def test_eval_errors_are_one_sentence(no_user_file, capsys, argv, needles):
    assert evaluate(argv) == 2
    one_sentence_error(capsys, *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_eval_on_a_missing_gpu_is_one_sentence(no_user_file, capsys):
    assert evaluate(["passkey", "--lengths", "2k", "--device", "cuda"]) == 2
    one_sentence_error(capsys, "no CUDA GPU", "use --device cpu")


def test_capture_keeps_the_chunks_q_and_the_layers_keys(no_user_file, tmp_path, capsys):
    from ktlong.models.loader import load_model
    from ktlong.kv.dense_cache import DenseKVCache

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=2), seed=3)
    text = tmp_path / "doc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    out = tmp_path / "captured.npz"
    assert bench(["capture", "--model", str(path), "--text_file", str(text), "--tokens", "200",
                  "--chunk_size", "128", "--layers", "1", "--out", str(out)]) == 0
    captured = np.load(out)  # no pickle: allow_pickle stays False
    assert sorted(captured.files) == ["layer01_k", "layer01_q", "layer01_start", "layer01_v"]
    assert int(captured["layer01_start"]) == 128
    # the keys equal the dense forward's keys of layer 1 (stored as float16)
    lm = load_model(str(path))
    ids = lm.tokenizer.encode(text.read_text(), parse_special=False)
    while len(ids) < 200:
        ids = ids + ids
    ids = ids[:200]
    c = lm.config
    cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 200, lm.model.device, torch.float32)
    lm.model.forward(torch.tensor(ids), cache, 0)
    keys = captured["layer01_k"].reshape(c.num_kv_heads, -1, c.head_dim)[:, :200].astype(np.float32)
    np.testing.assert_allclose(keys, cache.k[1, :, :200].numpy(), rtol=2e-3, atol=2e-3)
    assert captured["layer01_q"].shape == (200 - 128, c.num_heads, c.head_dim)
    from ktlong.bench.attention import read_captured

    (q, k, v, start), = read_captured(str(out)).values()  # what the attention bench reads back
    assert start == 128 and np.array_equal(q, captured["layer01_q"]) and np.array_equal(v, captured["layer01_v"])
    bad = tmp_path / "bad.npz"
    np.savez(bad, layer01_q=q, layer01_k=k, layer01_v=v[:, :1], layer01_start=np.array(128))
    for wrong, needle in [(bad, "do not fit one another"), (text, "not a file that"), (tmp_path / "none.npz", "capture")]:
        assert bench(["attention", "--captured", str(wrong)]) == 2  # refused before the GPU is asked
        one_sentence_error(capsys, f"--captured {wrong}", needle)


def test_capture_refuses_what_it_cannot_do_in_one_sentence(no_user_file, tmp_path, capsys):
    """A missing text, a bad --layers or --out, layers the model lacks: one sentence each, exit 2,
    and an existing --out is left as it was."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=2), seed=3)
    text = tmp_path / "doc.txt"
    text.write_text("the quick brown fox " * 20)
    kept = tmp_path / "kept.npz"
    kept.write_bytes(b"earlier")
    base = ["capture", "--model", str(path), "--tokens", "200", "--chunk_size", "128"]
    for argv, needles in [
        (["--text_file", str(tmp_path / "none.txt"), "--out", str(tmp_path / "a.npz")], ["--text_file", "does not exist"]),
        (["--text_file", "/dev/zero", "--out", str(tmp_path / "a.npz")], ["--text_file", "not a regular file"]),
        (["--text_file", str(text), "--out", str(tmp_path / "a.txt")], ["ending in .npz"]),
        (["--text_file", str(text), "--out", str(kept)], ["exists", "never overwrites"]),
        (["--text_file", str(text), "--out", str(tmp_path / "no" / "a.npz")], ["does not exist"]),
        (["--text_file", str(text), "--out", str(tmp_path / "a.npz"), "--layers", "1,x"], ["--layers", "5,15,25"]),
        (["--text_file", str(text), "--out", str(tmp_path / "a.npz"), "--layers", "2"], ["layers 0 to 1"]),
        (["--text_file", str(text), "--out", str(tmp_path / "a.npz"), "--chunk_size", "100"], ["multiple of 128"]),
    ]:
        assert bench(base + argv) == 2
        one_sentence_error(capsys, *needles)
    assert kept.read_bytes() == b"earlier" and not (tmp_path / "a.npz").exists()


def test_kept_keys_never_overwrites_its_masses_file(no_user_file, tmp_path, capsys):
    kept = tmp_path / "m.npz"
    kept.write_bytes(b"earlier")
    assert bench(["kept-keys", "--masses", str(kept)]) == 2
    one_sentence_error(capsys, f"--masses {kept} exists")
    assert bench(["kept-keys", "--masses", str(tmp_path / "no" / "m.npz")]) == 2
    one_sentence_error(capsys, "does not exist")
    assert kept.read_bytes() == b"earlier"


def test_selection_drift_counts_blocks_kept_from_earlier_tokens():
    from ktlong.bench.selection_drift import drift

    f = frozenset
    # one layer, one kv head; token 1 keeps {1, 2} of {1, 2, 3}, token 2 brings back 3 and adds 9
    history = [{5: [f({1, 2, 3})]}, {5: [f({1, 2, 4})]}, {5: [f({3, 4, 9, 1})]}]
    prev, window, new, size = drift(history, window=2)[5]
    assert prev == (2 / 3 + 2 / 4) / 2  # {1,2} of 3, then {4,1} of 4
    assert window == (2 / 3 + 3 / 4) / 2  # the last 2 tokens' blocks: {1,2,3} then {1,2,3,4}
    assert new == (1 + 1) / 2 and size == 3


def test_bench_help_lists_the_benchmarks_and_exits_zero(capsys):
    assert bench(["--help"]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "NAME --help" in out


def test_eval_out_that_is_a_file_is_one_sentence(no_user_file, capsys, tmp_path):
    out = tmp_path / "results"
    out.write_text("keep me")
    assert evaluate(["passkey", "--lengths", "2k", "--out", str(out)]) == 2
    one_sentence_error(capsys, "is a file", "give a folder")
    assert out.read_text() == "keep me"


@pytest.mark.parametrize("content,needle", [(b"\x00\x01\xffbinary", "not UTF-8 text"), (b"  \n", "is empty"),
                                            (None, "No such file")])
def test_prompt_and_text_files_are_checked_before_the_model_loads(no_user_file, capsys, tmp_path, monkeypatch,
                                                                  content, needle):
    import local_chat
    import ktlong.session.startup
    from ktlong.perplexity import main as perplexity

    path = tmp_path / "doc.txt"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setattr(ktlong.session.startup, "start", lambda *a, **k: pytest.fail("the model was loaded"))
    assert local_chat.main(["--prompt_file", str(path)]) == 2
    one_sentence_error(capsys, "--prompt_file", needle)
    assert perplexity(["--text_file", str(path)]) == 2
    one_sentence_error(capsys, "--text_file", needle)


@pytest.mark.parametrize("flags,needles", [
    (["--max_windows", "-1"], ["--max_windows -1 is negative"]),  # was a ZeroDivisionError traceback
    (["--device", "tpu"], ["'device' = 'tpu'", "auto, cpu, cuda or cuda:N"]),  # was torch's RuntimeError
    (["--rope_scale", "-2"], ["'rope_scale' = -2.0", "at least 0"]),
])
def test_perplexitys_flags_are_the_configurations_options_checked_before_the_model_loads(
        no_user_file, capsys, tmp_path, monkeypatch, flags, needles):
    import ktlong.perplexity
    from ktlong.perplexity import main as perplexity

    path = tmp_path / "doc.txt"
    path.write_text("words " * 50)
    monkeypatch.setattr(ktlong.perplexity, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert perplexity(["--text_file", str(path), *flags]) == 2
    one_sentence_error(capsys, *needles)


NO_USER = "~ktlong-no-such-user/doc"  # ~user of a user this machine does not have: pathlib raises
NO_USER_SAID = ["~ktlong-no-such-user/doc begins with ~ktlong-no-such-user", "no user", "write the path in full"]
LONG_NAME = "n" * 300  # longer than a file name can be: pathlib's exists() and is_file() raise


@pytest.mark.parametrize("flag", ["--gguf_path", "--model_path", "--prompt_file", "--save_kv", "--load_kv",
                                  "--config"])
@pytest.mark.parametrize("path,needles", [(NO_USER, NO_USER_SAID),
                                          (LONG_NAME, ["longer than a file system takes", "check the path"])])
def test_a_path_no_file_system_takes_is_one_sentence(no_user_file, capsys, monkeypatch, flag, path, needles):
    """A path under the ~user of no user here (kept as typed it would name a folder "~user"), or
    with a name past 255 bytes, is refused as such before the model loads: one sentence and exit 2
    (both were tracebacks)."""
    import local_chat
    import ktlong.session.startup

    if flag != "--gguf_path":  # which start() opens first, before any weight
        monkeypatch.setattr(ktlong.session.startup, "start", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert local_chat.main(["--mode", "long_context", flag, path]) == 2
    one_sentence_error(capsys, *needles)


def test_eval_and_perplexity_take_no_path_no_file_system_takes(no_user_file, capsys):
    from ktlong.perplexity import main as perplexity

    assert evaluate(["passkey", "--lengths", "2k", "--out", LONG_NAME]) == 2
    one_sentence_error(capsys, "longer than a file system takes")
    assert perplexity(["--text_file", LONG_NAME]) == 2
    one_sentence_error(capsys, "longer than a file system takes")
    assert perplexity(["--text_file", NO_USER]) == 2
    one_sentence_error(capsys, *NO_USER_SAID)
    assert evaluate(["passkey", "--lengths", "2k", "--out", NO_USER]) == 2
    one_sentence_error(capsys, *NO_USER_SAID)


@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_normal_modes_cache_past_the_free_memory_is_refused_before_any_weight(no_user_file, capsys, monkeypatch,
                                                                             engine):
    """SmolLM2-135M's cache, 30 layers x 3 kv heads x 64 x keys and values in bfloat16, is 23,040
    bytes a token: 10^12 tokens against 1 GiB free is one sentence with the size and the length
    that fits (it was numpy's or torch's allocation traceback)."""
    import local_chat
    import ktlong.kv.free_memory
    import ktlong.models.loader

    for loader in ("load_cpu_model", "load_model"):
        monkeypatch.setattr(ktlong.models.loader, loader, lambda *a, **k: pytest.fail("a weight was read"))
    monkeypatch.setattr(ktlong.kv.free_memory, "available_dram_bytes", lambda field="MemAvailable": 1 << 30)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert local_chat.main(["--max_seq_len", str(10**12), "--set", f"cpu_engine={engine}", "--device", "cpu"]) == 2
    fits = (1 << 30) // 23040 // 1024 * 1024
    one_sentence_error(capsys, f"needs {23040 * 10**12 / 2**30:,.1f} GiB of DRAM but 1.0 GiB is free",
                       f"lower max_seq_len to about {fits:,}.")


@pytest.mark.gpu
def test_normal_modes_cache_past_the_free_gpu_memory_is_refused_before_any_weight(no_user_file, capsys, monkeypatch,
                                                                                 tmp_path):
    """On a GPU the cache is held to the GPU's free memory (torch.cuda.mem_get_info, not the DRAM):
    a tiny model's cache, 2 layers x 2 kv heads x 16 x keys and values in bfloat16 (the model's
    dtype), is 256 bytes a token; 10^12 tokens against 1 GiB free is one sentence."""
    import local_chat
    import ktlong.models.loader

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(), seed=1)
    monkeypatch.setattr(ktlong.models.loader, "load_model", lambda *a, **k: pytest.fail("a weight was read"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 37))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert local_chat.main(["--model", str(path), "--device", "cuda", "--max_seq_len", str(10**12)]) == 2
    fits = (1 << 30) // 256 // 1024 * 1024
    one_sentence_error(capsys, f"needs {256 * 10**12 / 2**30:,.1f} GiB of GPU memory but 1.0 GiB is free",
                       f"lower max_seq_len to about {fits:,}, or use --mode long_context")


def test_a_prompt_file_that_is_a_folder_is_one_sentence(no_user_file, capsys, tmp_path):
    import local_chat

    assert local_chat.main(["--prompt_file", str(tmp_path)]) == 2
    one_sentence_error(capsys, "is a folder")


@pytest.mark.parametrize("kind", ["fifo", "device", "too_big", "too_big_for_max_seq_len"])
def test_a_prompt_file_is_a_regular_file_within_the_bytes_max_seq_len_can_use(no_user_file, capsys, tmp_path,
                                                                              monkeypatch, kind):
    """Refused before anything is read: a pipe would block, /dev/zero never ends, a file
    larger than the context could hold would be read and tokenized whole."""
    import os

    import local_chat
    import ktlong.session.startup
    from ktlong.chat.text_file import BYTES_PER_TOKEN, MAX_TEXT_BYTES

    path, flags = tmp_path / "doc.txt", []
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = "/dev/zero"
    else:
        with open(path, "wb") as f:  # sparse: no disk used
            f.truncate(MAX_TEXT_BYTES + 1 if kind == "too_big" else 4096 * BYTES_PER_TOKEN + 1)
        flags = [] if kind == "too_big" else ["--max_seq_len", "4096"]
    monkeypatch.setattr(ktlong.session.startup, "start", lambda *a, **k: pytest.fail("the model was loaded"))
    assert local_chat.main(["--prompt_file", str(path), *flags]) == 2
    one_sentence_error(capsys, "--prompt_file", "regular file" if kind in ("fifo", "device") else "MiB")


def test_config_show_takes_the_options_flags_and_no_abbreviation(no_user_file, capsys):
    from ktlong.config_command import main as config_command

    assert config_command(["show", "--mode", "long_context", "--set", "block_size=32"]) == 0
    shown = capsys.readouterr().out
    assert any(line.split() == ["mode", "'long_context'", "--mode"] for line in shown.splitlines())
    with pytest.raises(SystemExit) as e:  # --mod is not --mode, nor --model
        config_command(["show", "--mod", "long_context"])
    assert e.value.code == 2 and "unrecognized arguments: --mod" in capsys.readouterr().err


@pytest.mark.parametrize("module, argv", [
    ("local_chat", ["--max_seq", "4096"]), ("ktlong.server.__main__", ["--max_seq", "4096"]),
    ("ktlong.eval.__main__", ["passkey", "--sampl", "2"]), ("ktlong.perplexity", ["--text_file", "x", "--ct", "64"]),
    ("ktlong.bench.__main__", ["decode", "--context", "4k"])])
def test_no_command_takes_an_abbreviated_flag(capsys, module, argv):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_ctrl_c_while_the_model_loads_is_one_line_and_exit_130(no_user_file, capsys, monkeypatch):
    import local_chat
    import ktlong.session.startup

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ktlong.session.startup, "start", interrupted)
    assert local_chat.main([]) == 130
    err = capsys.readouterr().err
    assert "[interrupted]" in err and "Traceback" not in err


@pytest.mark.parametrize("world", [1, 2])
def test_the_models_line_is_begun_before_it_loads_and_ended_when_the_load_fails(monkeypatch, world):
    """The model's line names the file before its weights are read (a fresh install waits there
    for its CPU kernels) and gives the time at its end; a load that fails ends the line, so that
    its error starts one of its own. Ranks under torchrun print their lines whole."""
    from pathlib import Path
    from types import SimpleNamespace

    from ktlong.session.startup import _loading

    monkeypatch.setenv("WORLD_SIZE", str(world))
    config = SimpleNamespace(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, context_length=512)
    head = "[loading m.gguf: llama, 2 layers, 4/2 heads, context 512, on cpu"
    log = io.StringIO()
    with _loading(Path("/x/m.gguf"), config, "cpu", 99, log):
        assert log.getvalue() == (head if world == 1 else "")
    line = log.getvalue()
    assert line.startswith(head + " in ") and line.endswith("s; max_seq_len 99]\n") and line.count("\n") == 1
    log = io.StringIO()
    with pytest.raises(MemoryError):
        with _loading(Path("/x/m.gguf"), config, "cpu", 99, log):
            raise MemoryError
    assert log.getvalue() == (head + "\n" if world == 1 else "")


def test_eval_renders_its_prompts_with_the_chat_template_file(no_user_file, tmp_path, monkeypatch):
    """--set chat_template_file reaches the model the evaluation prompts with (it was refused
    as an option the command does not read)."""
    import ktlong.eval.runner as runner

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    seen = []

    class Stop(Exception):
        pass

    def fake_run_task(lm, config, *args, **kwargs):
        seen.append(lm.chat_template.render([{"role": "user", "content": "hi"}]))
        raise Stop

    monkeypatch.setattr(runner, "run_task", fake_run_task)
    with pytest.raises(Stop):
        evaluate(["passkey", "--lengths", "1k", "--out", str(tmp_path / "out"), "--set", f"chat_template_file={template}"])
    assert seen == ["[hi]"]


def test_cpu_weights_bench_compares_its_arms_in_processes_of_their_own(tmp_path, capsys):
    from gguf import GGMLQuantizationType as T

    path = tmp_path / "q4.gguf"
    write_tiny_gguf(path, TinySpec(weight_type=T.Q4_0), seed=5)
    assert bench(["cpu-weights", "--model", str(path), "--lengths", "64", "--tokens", "2", "--runs", "1",
                  "--arms", "float32,stored,cpu_engine"]) == 0
    out = capsys.readouterr().out
    assert "prefill chunks of 512" in out  # the config's chunk_size, 0: 512 on the CPU
    rows = [line for line in out.splitlines() if line.startswith("|") and "64" in line]
    assert [row.split("|")[2].strip() for row in rows] == ["float32", "stored", "cpu_engine"]
    assert rows[0].rstrip(" |").endswith("1.00x")
    assert bench(["cpu-weights", "--model", str(path), "--lengths", "64", "--runs", "1", "--arms", "cpu_engine",
                  "--set", "kv_type=fp32"]) == 2  # the engine keeps a bf16 cache: one sentence
    err = capsys.readouterr().err
    assert "cpu_engine arm cannot run" in err and err.count("error:") == 1 and "Traceback" not in err
    assert bench(["cpu-weights", "--model", str(path), "--lengths", "600"]) == 2  # past the context: one sentence
    err = capsys.readouterr().err
    assert "context of 512" in err and err.count("error:") == 1 and "Traceback" not in err


def test_cpu_weights_bench_refuses_its_llama_cpp_arm_in_one_sentence_without_llama_cpp_python(tmp_path, capsys,
                                                                                              monkeypatch):
    """Its run is a process that imports neither torch nor the model code (its peak memory is
    llama.cpp's own); where llama-cpp-python is missing, the bench says so in one sentence,
    before any arm runs."""
    import subprocess

    import ktlong.bench.cpu_weights

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TinySpec(), seed=5)
    hidden = tmp_path / "site" / "llama_cpp"  # import llama_cpp fails, as where it is not installed
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(ktlong.bench.cpu_weights, "command", lambda *a: pytest.fail("an arm ran first"))
    assert bench(["cpu-weights", "--model", str(path), "--lengths", "64", "--tokens", "1", "--runs", "1",
                  "--llama_cpp"]) == 2
    err = capsys.readouterr().err
    assert "pip install llama-cpp-python" in err and err.count("error:") == 1 and "Traceback" not in err
    imported = subprocess.run([sys.executable, "-c", "import sys, ktlong.bench.llama_cpp_arm; "
                               "print('torch' in sys.modules, 'ktlong.gguf.weights' in sys.modules)"],
                              capture_output=True, text=True, check=True)
    assert imported.stdout.split() == ["False", "False"]


def test_cache_hits_bench_refuses_in_one_sentence_without_the_openai_client(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai fails, as where it is not installed
    assert bench(["cache-hits", "--model", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert "pip install openai" in err and err.count("error:") == 1 and "Traceback" not in err


def test_cache_hits_bench_summarises_phases_answers_and_loads(tmp_path):
    """The documents carry their planted sentence; the table's medians and ratio, the answers
    equal to the reference's and the logged load rates come out of known results."""
    from ktlong.bench.cache_hits import documents, equal_answers, load_rates, summary

    docs = documents(3, 5000)
    assert [(name, code) for name, code, _ in docs] == [("ALPHA", 5111), ("BRAVO", 6222), ("CHARLIE", 7333)]
    assert all(f"archive {name} is {code}." in text and len(text) > 5000 for name, code, text in docs)
    assert docs[0][2] != docs[1][2]
    names = [name for name, _, _ in documents(14, 1000)]  # past the six names (bench serve's 8 clients and more)
    assert len(set(names)) == 14 and names[6] == "ALPHA-2" and names[13] == "BRAVO-3"
    r = lambda tag, doc, q, ttft, answer, where=None: dict(tag=tag, doc=doc, q=q, ttft=ttft, answer=answer, **{"from": where})
    results = [r("cached", "A", 0, 2.0, "x"), r("cached", "B", 0, 1.0, "y"), r("cached", "C", 0, 3.0, "z"),
               r("cached", "A", 1, 0.1, "a", "dram"), r("cached", "B", 1, 0.05, "b", "dram"),
               r("cached", "C", 1, 0.2, "c", "session"),  # not a DRAM hit: left out of the hits
               r("restarted", "A", 2, 0.9, "d", "disk"),
               r("reference", "A", 0, 2.2, "x"), r("reference", "A", 1, 2.1, "a"), r("reference", "B", 1, 2.1, "B!"),
               r("reference", "A", 2, 2.0, "d")]
    rows, ratio = summary(results)
    assert rows[:3] == [["cold", 3, "2.000", "1.000-3.000"], ["DRAM hit", 2, "0.075", "0.050-0.100"],
                        ["disk hit after restart", 1, "0.900", "0.900-0.900"]]
    assert rows[3][:2] == ["reference (fresh server)", 4] and ratio == pytest.approx(2.0 / 0.075)
    assert equal_answers(results) == (3, 4)  # A q0, A q1, A q2 equal; B q1 differs; the rest has no reference
    log = tmp_path / "server.log"
    log.write_text("[cache: conversation ab loaded from disk: 119,737 tokens, 1.42 GiB in 0.18 s (7.97 GiB/s)]\nother\n")
    assert load_rates(str(log)) == ["1.42 GiB in 0.18 s (7.97 GiB/s)"]


def test_a_bench_whose_server_died_says_so_in_one_sentence(tmp_path, smollm2_path):
    """The serve and cache-hits benches ask a server of their own; when it dies under them (the
    1M serve row's server was killed for memory) they say how, and where its log is, instead of
    the client's traceback."""
    import socket

    openai = pytest.importorskip("openai")
    from ktlong.bench.cache_hits import Server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "server.log"
    server = Server(str(smollm2_path), port, str(log), ["--max_seq_len", "2048"])
    server.process.kill()
    server.process.wait()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=10)
    with pytest.raises(openai.OpenAIError) as failed:
        client.models.list()
    message = str(server.lost(failed.value))
    assert "SIGKILL" in message and "out of memory" in message and message.endswith(f"its log is {log}.")
    server.stop()  # gone already: nothing to stop, no error
    assert server.process.returncode == -9


@pytest.mark.parametrize("given", [None, "max_split_size_mb:64"])
def test_importing_ktlong_gives_the_gpu_allocator_expandable_segments_unless_set(given):
    """Blocks cut to one session's sizes would count against the device cap beside the next
    session's plan (the follow-up bench ran out of memory at 24 GiB); a value the user set stays."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if given is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = given
    out = subprocess.run([sys.executable, "-c", "import os, ktlong; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == (given or "expandable_segments:True")


@pytest.mark.parametrize("name", ["serve", "cache-hits"])
def test_a_bench_of_servers_refuses_a_missing_model_in_one_sentence_before_one_starts(tmp_path, capsys, name):
    missing = tmp_path / "r8b.gguf"
    assert bench([name, "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--model {missing}: no such GGUF file" in err and "random-gguf" in err
    assert err.count("error:") == 1 and "Traceback" not in err and "while starting" not in err


def test_bench_serve_quotes_the_servers_line_for_the_prefill_beside_the_streams(tmp_path):
    from ktlong.bench.serve import alone_queued, beside_account

    log = tmp_path / "server.log"
    beside = ("[answer: 1 tokens after 1,050,111 prompt tokens (none cached): queued 0.34 s, cache moved 0.00 s, "
              "prefill 215.84 s (of it the decoder's setup 9.18 s; beside 2210 decode steps of 68.1 ms each, "
              "its slices 29.9 ms a step); first token 216.18 s after the request came, then 0.0 tok/s]")
    log.write_text("[answer: 128 tokens after 60,045 prompt tokens (none cached): prefill 4.5 s]\n" + beside + "\n"
                   "[answer: 1 tokens after 1,050,118 prompt tokens (none cached): prefill 95.1 s]\n"
                   "[answer: 1902 tokens after 60,045 prompt tokens (60,044 cached from the dram): prefill 0.71 s "
                   "(beside 13 decode steps of 14.4 ms each, its slices 40.0 ms a step)]\n")
    assert beside_account(str(log)) == beside
    # the same document alone: the last line of the longest prompt with nothing beside it
    log.write_text(log.read_text() + "[answer: 1 tokens after 1,050,118 prompt tokens (none cached): queued 6.69 s, "
                   "cache moved 0.00 s, prefill 98.19 s]\n")
    assert alone_queued(str(log)) == 6.69
    log.write_text("[answer: 1 tokens after 12 prompt tokens]\n")
    assert beside_account(str(log)) == "" and beside_account(str(tmp_path / "missing.log")) == ""
    assert alone_queued(str(log)) == 0.0 and alone_queued(str(tmp_path / "missing.log")) == 0.0


def test_decode_bench_profiles_its_own_steps_after_each_rows_figures(monkeypatch, capsys):
    """--profile: after each row's timed tokens (4 warm-up and --tokens), PROFILE_STEPS more
    steps run under the profiler, of that row's batch, and print after the row's figures."""
    import ktlong.bench.decode as bench
    from ktlong.decode.batch import DecodeBatch

    steps, inside = [], []
    step = DecodeBatch.step

    def counted(self, sequences, tokens, while_waiting=None):
        steps.append(len(sequences))
        return step(self, sequences, tokens, while_waiting)

    def profiled(fn, **kwargs):
        before = len(steps)
        fn()
        inside.append(steps[before:])

    monkeypatch.setattr(DecodeBatch, "step", counted)
    monkeypatch.setattr(bench, "print_profile", profiled)
    import ktlong.bench.decode_op

    # the floors' rates (GiB-sized reads, seconds here) are not what this is about
    monkeypatch.setattr(ktlong.bench.decode_op, "stream_read_gbps", lambda nbytes: 10.0)
    monkeypatch.setattr(bench, "device_copy_gbps", lambda device: 10.0)
    assert bench.main(["--contexts", "1k", "--batch", "1,2", "--tokens", "3", "--modes", "hybrid", "--profile",
                       "--device", "cpu"]) == 0
    assert inside == [[1] * bench.PROFILE_STEPS, [2] * bench.PROFILE_STEPS]
    assert steps == [1] * (4 + 3 + bench.PROFILE_STEPS) + [2] * (4 + 3 + bench.PROFILE_STEPS)
    out = capsys.readouterr().out
    assert out.index("partial: 1K | 1") < out.index("profile of 8 steps: 1K, batch 1") < out.index("partial: 1K | 2")


def ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", ["server", "bench", "eval", "perplexity", "chat"])
def test_ctrl_c_while_a_command_loads_is_one_line_and_status_130(no_user_file, capsys, monkeypatch, tmp_path, command):
    """Ctrl-C before the work ends (here: while the model loads, or as a bench begins) says so in
    one line and exits 130, as a shell reports a command SIGINT ended; it was Python's traceback
    but in the chat."""
    import local_chat
    import ktlong.bench.__main__
    import ktlong.models.loader
    import ktlong.perplexity
    import ktlong.session.startup
    from ktlong.server.__main__ import main as serve

    monkeypatch.setitem(ktlong.bench.__main__.BENCHES, "kv-fidelity", ctrl_c)
    monkeypatch.setattr(ktlong.session.startup, "start", ctrl_c)
    monkeypatch.setattr(ktlong.models.loader, "load_model", ctrl_c)
    monkeypatch.setattr(ktlong.perplexity, "load_model", ctrl_c)
    text = tmp_path / "t.txt"
    text.write_text("some words to score\n")
    run = {"server": lambda: serve([]),
           "bench": lambda: bench(["kv-fidelity", "--lengths", "1k", "--device", "cpu"]),
           "eval": lambda: evaluate(["passkey", "--lengths", "1k", "--samples", "1", "--device", "cpu",
                                     "--out", str(tmp_path / "eval")]),
           "perplexity": lambda: ktlong.perplexity.main(["--text_file", str(text), "--device", "cpu"]),
           "chat": lambda: local_chat.main(["--device", "cpu"])}[command]
    assert run() == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == ("[interrupted]" if command != "eval" else
                                            f"[interrupted: the samples measured are in {tmp_path / 'eval'}; "
                                            "add --resume to go on from them]")
    assert "Traceback" not in err


def test_a_gpu_index_past_the_machines_gpus_is_one_sentence(no_user_file, capsys, monkeypatch):
    """--device cuda:2 on a machine of two GPUs, or of one, is refused by name (was torch's error on
    first use)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, said in ((2, "GPUs cuda:0 to cuda:1"), (1, "has one GPU, cuda:0;")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        assert evaluate(["passkey", "--lengths", "2k", "--device", "cuda:2"]) == 2
        one_sentence_error(capsys, "'cuda:2'", said)


@pytest.mark.parametrize("max_seq_len,past", [(512, False), (2048, True)])
def test_a_max_seq_len_past_the_models_context_is_said_before_it_loads(no_user_file, capsys, monkeypatch, tmp_path,
                                                                      max_seq_len, past):
    """The tiny model's GGUF gives a context of 512 tokens: a longer max_seq_len runs (as
    llama.cpp's n_ctx does) with a line that says so, once, before the model's line."""
    import local_chat

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(context=512), seed=1)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert local_chat.main(["--gguf_path", str(path), "--max_seq_len", str(max_seq_len), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    said = f"[max_seq_len {max_seq_len:,} is past the model's context of 512 tokens: "
    assert err.count(said) == int(past), err
    assert not past or err.index(said) < err.index("[loading tiny.gguf")
