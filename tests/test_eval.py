"""Evaluation generators are seeded, sized in model tokens and place the needle where asked;
a real 4K passkey gets dense attention's answer from sparse prefill and decode."""

import pytest

from ktlong.eval.haystack import sentences
from ktlong.eval.tasks import TASKS, first_integer, make_sample, references, score


def words(text):
    return len(text.split())


@pytest.mark.parametrize("task", sorted(TASKS))
def test_samples_fit_the_target_length_and_repeat_by_seed(task):
    a = make_sample(task, 1500, 0.5, seed=3, count_tokens=words)
    b = make_sample(task, 1500, 0.5, seed=3, count_tokens=words)
    c = make_sample(task, 1500, 0.5, seed=4, count_tokens=words)
    assert a == b and a.answer != c.answer
    assert 1500 * 0.9 <= a.num_tokens <= 1500 and all(ref in a.prompt for ref in references(task, a.answer))


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_sits_at_the_requested_depth_at_a_sentence_boundary(depth):
    s = make_sample("needle", 3000, depth, seed=1, count_tokens=words)
    body = s.prompt.split("\n\n")[1]
    at = body.index("The secret ingredient")
    assert abs(at / len(body) - depth) < 0.05
    assert at == 0 or body[at - 2:at] == ". "


def test_passkey_is_stated_once_and_scored_by_the_first_integer():
    s = make_sample("passkey", 800, 0.3, seed=2, count_tokens=words)
    assert s.prompt.count(f"The pass key is {s.answer}") == 1
    assert score("passkey", s.answer, f"It is {s.answer}, I think 123")
    assert not score("passkey", s.answer, f"The 2 keys... {s.answer}")
    assert first_integer("no digits") is None


def test_kv_and_multikey_answers_are_exact_values():
    kv = make_sample("kvretrieval", 1200, 0.5, seed=5, count_tokens=words)
    assert kv.prompt.count(kv.answer) == 1 and len(kv.answer) == 36
    mk = make_sample("multikey", 1200, 0.5, seed=6, count_tokens=words)
    assert mk.prompt.count("The special magic number for") == 6 and score("multikey", mk.answer, mk.answer + ".")


def test_haystack_is_deterministic_prose():
    a, b = sentences(50, 7), sentences(50, 7)
    assert a == b and len(set(a)) > 40 and all(s.endswith(".") and s[0].isupper() for s in a)
    assert sentences(5, 8) != a[:5]


def test_needle_heatmap_writes_a_png(tmp_path):
    from ktlong.eval.report import needle_heatmap
    from ktlong.eval.runner import Result

    results = [Result("needle", "sparse", n, d, 0, n, "x", "x", (n + int(d * 4)) % 3 == 0, 1.0, 1.0, 1.0)
               for n in (2048, 4096) for d in (0.0, 0.5, 1.0)]
    grid = needle_heatmap(results, "sparse", str(tmp_path / "h.png"))
    assert grid.shape == (3, 2) and (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert grid[1, 0] == float((2048 + 2) % 3 == 0)


@pytest.mark.slow
def test_sparse_prefill_and_decode_answer_like_dense_on_a_passkey(tmp_path, monkeypatch, real_model):
    """Issue 7, with CompactAttention's prefill too: on a 4K passkey (half SmolLM2's context) the
    sparse arm's greedy answer is the dense one's, and right, where each 1,024-token chunk after
    the first attends to 16 of the blocks before it (about 64% of the prefill's attention) and
    decode reads 8 of the 55 blocks past its window, preselection keeping 16 (the shares issue 7
    asked for at 8K, where a prefill costs 4 times as much)."""
    from ktlong.config import load_config, parse_set
    from ktlong.eval.runner import run_task

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    lm = real_model("smollm2-135m")
    config = load_config(overrides=parse_set(["chunk_size=1024", "keep_blocks=16", "local_windows_len=512",
                                              "block_size=64", "second_select_num=8", "preselect_block_count=16"]))
    dense, sparse = run_task(lm, config, "passkey", [4000], [0.4], 1, ["dense", "sparse"], seed=1,
                             warm_up_tokens=64)  # the answers count here, not the speed
    assert sparse.output == dense.output and dense.correct
    assert dense.density == 1.0 and sparse.density < 0.7  # CompactAttention did drop blocks


def test_same_answers_compares_first_integers_per_length():
    from ktlong.eval.runner import Result, same_answers

    def r(arm, length, sample, output):
        return Result("passkey", arm, length, 0.5, sample, length, "123", output, "123" in output, 1.0, 1.0, 1.0)

    results = [r("dense", 64, 0, "The pass key is 123."), r("transformers", 64, 0, "123, it is"),
               r("dense", 64, 1, "I found 77"), r("transformers", 64, 1, "The key is 78"),
               r("dense", 128, 0, "nothing"), r("transformers", 128, 0, "no number here"),
               r("dense", 128, 1, "unmatched: transformers never ran this one")]
    assert same_answers(results, "dense", "transformers") == {64: (1, 2), 128: (1, 1)}


def test_transformers_arm_gets_the_models_rope_scaling():
    from types import SimpleNamespace

    from ktlong.eval.transformers_session import hf_rope_parameters
    from ktlong.gguf.model_config import RopeConfig

    yarn = SimpleNamespace(config=SimpleNamespace(rope=RopeConfig(base=1e6, dim=64, scaling_type="yarn", factor=4.0,
                                                                  original_context_length=32768)))
    assert hf_rope_parameters(yarn, 1e6) == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                             "original_max_position_embeddings": 32768,
                                             "beta_fast": 32.0, "beta_slow": 1.0}
    plain = SimpleNamespace(config=SimpleNamespace(rope=RopeConfig(base=1e4, dim=64)))
    assert hf_rope_parameters(plain, 1e4) == {"rope_type": "default", "rope_theta": 1e4}


def test_prefill_rows_compare_each_arm_with_dense():
    from ktlong.eval.report import prefill_rows
    from ktlong.eval.runner import Result

    def r(arm, length, seconds, attention, density, setup=0.25):
        return Result("passkey", arm, length, 0.5, 0, length, "1", "1", True, length / seconds, 1.0, density,
                      seconds, attention, setup)

    results = [r("dense", 1000, 4.0, 2.0, 1.0), r("dense", 1000, 6.0, 3.0, 1.0), r("dense", 1000, 5.0, 2.5, 1.0),
               r("sparse", 1000, 2.0, 0.5, 0.4), r("sparse", 1000, 3.0, 1.0, 0.5), r("sparse", 1000, 2.5, 0.25, 0.3),
               r("transformers", 1000, 1.0, 0.0, 1.0)]
    headers, rows = prefill_rows(results)
    by_arm = {row[1]: dict(zip(headers, row)) for row in rows}
    assert by_arm["sparse"]["prefill s"] == "2.50" and by_arm["sparse"]["dense prefill s"] == "5.00"
    assert by_arm["sparse"]["speedup"] == "2.00x" and by_arm["sparse"]["attention speedup"] == "5.00x"
    assert by_arm["sparse"]["density"] == "40%" and by_arm["sparse"]["decoder set-up s"] == "0.25"
    assert by_arm["transformers"]["attention s"] == "-" and by_arm["transformers"]["speedup"] == "5.00x"


def test_an_arm_with_options_of_its_own_runs_with_them(monkeypatch):
    """'sparse@selector=xattention@threshold=0.95' is the sparse arm over the config with those
    two options set, checked like --set; the other arms keep the config as it was."""
    import ktlong.eval.runner as runner
    from ktlong.config import default_config
    from ktlong.errors import ConfigError

    seen = []

    class Stop(Exception):
        pass

    def fake_session(lm, config, arm, max_seq_len):
        seen.append((arm, config.selector, config.threshold, config.where("threshold")))
        raise Stop

    monkeypatch.setattr(runner, "make_session", fake_session)
    monkeypatch.setattr(runner, "Conversation", lambda *a: None)
    config = default_config()
    lm = type("LM", (), {"tokenizer": None, "chat_template": None})()
    for attention in ("sparse@selector=xattention@threshold=0.95", "dense"):
        with pytest.raises(Stop):
            runner.run_task(lm, config, "passkey", [1024], [0.5], 1, [attention], seed=0)
    assert seen == [("sparse", "xattention", 0.95, "--attention sparse@selector=xattention@threshold=0.95"), ("dense", "topk", 0.9, "default")]
    with pytest.raises(ConfigError, match="threshold"):
        runner.variant_config(config, "sparse@threshold=2")


class FakeSession:
    """What run_task asks of a session when generate is replaced."""
    last_stats = None

    def reset(self):
        pass


class FakeConversation:
    """A prompt's ids: one a word."""

    def __init__(self, *a):
        pass

    def render_ids(self, history, text):
        return list(range(len(text.split())))


def test_results_are_saved_after_every_sample(monkeypatch, tmp_path):
    """A run cut short keeps what it measured: on_result sees the results after each sample,
    and write_json replaces results.json whole (no temporary file left beside it)."""
    import json
    import types

    import ktlong.eval.runner as runner
    from ktlong.config import default_config

    monkeypatch.setattr(runner, "make_session", lambda *a: FakeSession())
    monkeypatch.setattr(runner, "Conversation", FakeConversation)
    monkeypatch.setattr(runner, "generate", lambda session, ids, *a, **k: types.SimpleNamespace(
        text="12345", prefill_seconds=1.0, decode_tokens_per_second=2.0))
    lm = types.SimpleNamespace(tokenizer=types.SimpleNamespace(stop_ids=[], decode=str), chat_template=None)
    from ktlong.eval.results_file import as_dicts, write_json

    path, seen = tmp_path / "results.json", []

    def save(results):
        seen.append(len(results))
        write_json(path, as_dicts(results))

    runner.run_task(lm, default_config(), "passkey", [300, 400], [0.5], 2, ["dense", "sparse"], seed=0,
                    log=open(tmp_path / "log", "w"), on_result=save)
    assert seen == list(range(1, 9))
    saved = json.loads(path.read_text())
    assert [(r["attention"], r["length"], r["sample"]) for r in saved] == [
        (a, n, i) for a in ("dense", "sparse") for n in (300, 400) for i in (0, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log", "results.json"]


def test_ctrl_c_during_a_sample_stops_the_run_and_keeps_only_whole_samples(monkeypatch, tmp_path):
    """Ctrl-C ends a chat's answer early and keeps it; in an evaluation a cut answer would be
    saved as a wrong result and the run would go on: there it stops the run, and what was saved
    is the samples that finished (the real generate, over a session that is interrupted in the
    third sample's decode)."""
    import types

    import torch

    import ktlong.eval.runner as runner
    from ktlong.config import default_config

    class Session(FakeSession):
        max_seq_len, prefills = 1 << 20, 0

        def prefill(self, ids, *a):
            self.prefills += 1
            return torch.arange(10.0)  # greedy: token 9, never a stop

        def step(self, token):
            if self.prefills == 4:  # the warm-up, samples 0 and 1, then sample 2
                raise KeyboardInterrupt
            return torch.arange(10.0)

    monkeypatch.setattr(runner, "make_session", lambda *a: Session())
    monkeypatch.setattr(runner, "Conversation", FakeConversation)
    tokenizer = types.SimpleNamespace(stop_ids=frozenset(), decode=lambda ids: " ".join(map(str, ids)),
                                      decode_stream=lambda: str)
    lm = types.SimpleNamespace(tokenizer=tokenizer, chat_template=None)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        runner.run_task(lm, default_config(), "passkey", [300], [0.5], 4, ["dense"], seed=0,
                        log=open(tmp_path / "log", "w"), on_result=lambda results: seen.append(list(results)))
    assert [len(r) for r in seen] == [1, 2] and all(r.output.startswith("9 9") for r in seen[-1])


def longest_units(count, length) -> int:
    """The most units whose prompt fits length, by doubling then halving (count grows with units)."""
    lo, hi = 1, 2
    while count(hi) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= length else (lo, mid)
    return lo


@pytest.mark.parametrize("task", sorted(TASKS))
def test_samples_are_the_longest_that_fit(task):
    """The prompt make_sample settles on has the most units that fit, as a plain search finds
    them, at lengths from a few units to thousands; and it counts few long prompts on the way."""
    import random

    gen = TASKS[task]
    units_words = lambda u: words(gen(random.Random(5), u, 0.5)[0])
    for length in (60, 400, 1500, 20000):
        counted = []
        spy = lambda text: counted.append(words(text)) or counted[-1]
        s = make_sample(task, length, 0.5, seed=5, count_tokens=spy)
        assert s.prompt == gen(random.Random(5), longest_units(units_words, length), 0.5)[0]
        assert sum(n > length / 2 for n in counted) <= 10, counted


def test_each_arm_runs_once_untimed_before_its_samples(monkeypatch, tmp_path):
    """The first run of an arm compiles and loads what it uses on first use; it is run on the
    first prompt (its first WARM_UP_TOKENS) before the samples and counts in no result (a
    density-100% table read 4.82x when it did)."""
    import types

    import ktlong.eval.runner as runner
    from ktlong.config import default_config

    calls = []

    def generate(session, ids, *a, **k):
        calls.append((session, len(ids)))
        first = sum(s is session for s, _ in calls) == 1
        return types.SimpleNamespace(text="12345", prefill_seconds=50.0 if first else 1.0,
                                     decode_tokens_per_second=2.0)

    monkeypatch.setattr(runner, "make_session", lambda *a: FakeSession())
    monkeypatch.setattr(runner, "Conversation", FakeConversation)
    monkeypatch.setattr(runner, "generate", generate)
    lm = types.SimpleNamespace(tokenizer=types.SimpleNamespace(stop_ids=[], decode=str), chat_template=None)
    log = tmp_path / "log"
    with open(log, "w") as f:
        results = runner.run_task(lm, default_config(), "passkey", [300, 400], [0.5], 2, ["dense", "sparse"],
                                  seed=0, log=f)
    assert len(calls) == 2 * (1 + 4) and len(results) == 8
    assert all(r.prefill_seconds == 1.0 for r in results)  # the 50 s first runs are in none
    timed = {(r.attention, r.length, r.sample): r.prompt_tokens for r in results}
    assert calls[0][1] == timed["dense", 300, 0] and calls[5][1] == timed["sparse", 300, 0]
    assert log.read_text().count("warm-up run, not timed") == 2


def test_help_gives_the_defaults_and_the_forms_of_lengths(capsys):
    from ktlong.eval.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for text in ("4096,32k,1m (default: 2k,4k,8k)", "(default: 10)", "(default: dense,sparse)", "(default: 0)",
                 "(default: results)"):
        assert text in shown, text


def test_ruler_tasks_ask_what_their_text_says():
    """Each RULER task's answer, recomputed from its prompt by plain parsing: the values stated
    for the asked key(s), the variables a value reaches through its chain, the words counted in
    the list or text, the passage whose first sentence the question quotes."""
    import re
    from collections import Counter

    mv = make_sample("multivalue", 2000, 0.3, seed=1, count_tokens=words)
    person = re.search(r"numbers for (\w+)\?", mv.prompt).group(1)
    assert re.findall(rf"One of the special magic numbers for {person} is (\d+)\.", mv.prompt) == references(
        "multivalue", mv.answer) and len(references("multivalue", mv.answer)) == 4

    mq = make_sample("multiquery", 2000, 0.6, seed=2, count_tokens=words)
    asked = re.search(r"numbers for (.+)\? Answer", mq.prompt).group(1).replace(" and ", ", ").split(", ")
    stated = dict(re.findall(r"The special magic number for (\w+) is (\d+)\.", mq.prompt))
    assert len(stated) == 5 and references("multiquery", mq.answer) == [stated[p] for p in asked]

    vt = make_sample("vartrack", 2000, 0.1, seed=3, count_tokens=words)
    value = re.search(r"assigned the value (\d+)", vt.prompt).group(1)
    reached = set(re.findall(rf"VAR (\w+) = {value}\.", vt.prompt))
    for source, target in re.findall(r"VAR (\w+) = VAR (\w+)\.", vt.prompt) * 5:  # follow the copies
        if target in reached:
            reached.add(source)
    assert sorted(reached) == sorted(references("vartrack", vt.answer)) and len(reached) == 5

    cw = make_sample("commonwords", 3000, 0.5, seed=4, count_tokens=words)
    listed = Counter(re.findall(r"\d+\. (\w+)", cw.prompt.split("\n\n")[1]))
    assert sorted(w for w, n in listed.most_common(10)) == sorted(references("commonwords", cw.answer))
    assert listed.most_common(11)[-1][1] < listed.most_common(10)[-1][1]

    fw = make_sample("freqwords", 3000, 0.5, seed=5, count_tokens=words)
    counted = Counter(fw.prompt.split("\n\n")[1].split()).most_common(4)
    assert [w for w, _ in counted[:3]] == references("freqwords", fw.answer) and counted[2][1] > counted[3][1]

    qa = make_sample("qa", 3000, 0.5, seed=6, count_tokens=words)
    quoted = re.search(r'documented as follows: "(.+)"\?', qa.prompt).group(1)
    holders = [line for line in qa.prompt.split("\n\n")[1].split("\n") if quoted in line]
    assert len(holders) == 1 and holders[0].split(": ")[0].split(".")[-1] == qa.answer

    # scored as RULER scores them: every reference (any order, any case), or for qa any one
    assert score("multiquery", "1, 2, 3, 4", "4 3 2 and 1") and not score("multiquery", "1, 2, 3, 44", "1 2 3 4")
    assert score("commonwords", "Apple, pear", "pear and APPLE") and score("qa", qa.answer, f"It is {qa.answer}.")
    assert not score("qa", qa.answer, "I do not know.")


def _result(task, attention, length, sample, correct):
    from ktlong.eval.runner import Result

    return Result(task, attention, length, 0.5, sample, length, "1", "1" if correct else "2", correct, 1.0, 1.0, 1.0)


def test_the_grid_holds_each_arm_to_dense_cell_by_cell_and_in_sum():
    """Issue 62's grid: per (task, length) each arm's right answers; an arm holds when no cell is
    more than 2 below dense and its sum is at least 97% of dense's. Counted by hand: dense 4/4,
    4/4 and 2/4 (10); sparse 1/4 (3 below: a failing cell), 4/4, 3/4 (8, under 9.7); other 3/4,
    4/4, 2/4 (9, under 9.7 though no cell is more than 2 below)."""
    from ktlong.eval.report import grid_rows

    right = {("multikey", 1024): {"dense": 4, "sparse": 1, "other": 3},
             ("multikey", 2048): {"dense": 4, "sparse": 4, "other": 4},
             ("qa", 1024): {"dense": 2, "sparse": 3, "other": 2}}
    results = [_result(task, arm, length, i, i < n) for (task, length), arms in right.items()
               for arm, n in arms.items() for i in range(4)]
    headers, rows, verdicts = grid_rows(results)
    assert headers == ["task", "length", "dense", "other", "sparse", "other = dense", "sparse = dense"]
    # the last two columns: the prompts on which the arm answered as dense did (right or wrong)
    assert rows == [["multikey", 1024, "4/4", "3/4", "1/4", "3/4", "1/4"],
                    ["multikey", 2048, "4/4", "4/4", "4/4", "4/4", "4/4"],
                    ["qa", 1024, "2/4", "2/4", "3/4", "4/4", "3/4"]]
    other, sparse = verdicts
    assert other.startswith("other: 9 right against dense's 10 (at least 9.7 asked)") and "below dense: none" in other
    assert other.endswith("does not hold")
    assert sparse.startswith("sparse: 8 right") and "multikey 1,024 (1 against 4)" in sparse
    one_more = [r for r in results if r.attention == "dense" or (r.attention == "other" and
                                                                 (r.task, r.length, r.sample) != ("qa", 1024, 2))]
    assert _holds(grid_rows(one_more + [_result("qa", "other", 1024, 2, True)])[2][0])  # 10, over 9.7
    same = [r for r in results if r.attention == "dense"] + [_result(r.task, "copy", r.length, r.sample, r.correct)
                                                             for r in results if r.attention == "dense"]
    assert _holds(grid_rows(same)[2][0])


def _holds(verdict: str) -> bool:
    return verdict.endswith(": holds")


def test_several_tasks_run_on_one_model_into_a_folder_each_and_end_with_the_grid(monkeypatch, tmp_path, capsys):
    """`python -m ktlong.eval multikey,qa`: the model loads once, each task's results.json goes to
    its own folder (rewritten after every sample), and the grid closes the report."""
    import json

    import ktlong.eval.runner as runner
    from ktlong.eval.__main__ import main

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    ran = []

    def fake_run_task(lm, config, task, lengths, depths, samples, attentions, seed, on_result=None, **kw):
        ran.append(task)
        results = [_result(task, a, n, i, a == "dense" or i) for a in attentions for n in lengths for i in range(samples)]
        on_result(results)
        return results

    monkeypatch.setattr(runner, "run_task", fake_run_task)
    assert main(["multikey,qa", "--model", "smollm2-135m", "--lengths", "1k", "--samples", "2", "--device", "cpu",
                 "--out", str(tmp_path / "out")]) == 0
    assert ran == ["multikey", "qa"]
    for task in ran:
        saved = json.loads((tmp_path / "out" / task / "results.json").read_text())
        assert saved["task"] == task and len(saved["results"]) == 4
    out = capsys.readouterr().out
    assert "sparse: 2 right against dense's 4" in out and "multikey 1,024" not in out  # 1 below: within 2


def test_a_run_goes_on_from_its_earlier_results(monkeypatch, tmp_path):
    """earlier: the samples a run measured before are kept first and not run again; an arm with
    nothing left loads no session and runs no warm-up; the rest run on the prompts they would
    have had (the same lengths as a run from the start gives them)."""
    import types

    import ktlong.eval.runner as runner
    from ktlong.config import default_config

    sessions, calls = [], []

    def make_session(lm, config, arm, max_seq_len):
        sessions.append(arm)
        return FakeSession()

    def generate(session, ids, *a, **k):
        calls.append(len(ids))
        return types.SimpleNamespace(text="12345", prefill_seconds=1.0, decode_tokens_per_second=2.0)

    monkeypatch.setattr(runner, "make_session", make_session)
    monkeypatch.setattr(runner, "Conversation", FakeConversation)
    monkeypatch.setattr(runner, "generate", generate)
    lm = types.SimpleNamespace(tokenizer=types.SimpleNamespace(stop_ids=[], decode=str), chat_template=None)
    args = (lm, default_config(), "passkey", [300, 400], [0.5], 2, ["dense", "sparse"])
    whole = runner.run_task(*args, seed=0, log=open(tmp_path / "a", "w"))
    sessions.clear(), calls.clear()
    earlier = [r for r in whole if r.attention == "dense"] + [r for r in whole if r.attention == "sparse"][:3]
    results = runner.run_task(*args, seed=0, log=open(tmp_path / "b", "w"), earlier=earlier)
    assert sessions == ["sparse"]  # dense had every sample
    assert results[:len(earlier)] == earlier and len(results) == 8
    last = results[-1]
    assert (last.attention, last.length, last.sample) == ("sparse", 400, 1)
    assert last.prompt_tokens == whole[-1].prompt_tokens and calls[-1] == last.prompt_tokens


def _saved_run(tmp_path, monkeypatch, argv, correct=lambda arm, i: True):
    """main(argv) over a fake run_task that keeps `earlier` and answers the rest: (exit code,
    the samples it ran, stdout and stderr)."""
    import ktlong.eval.runner as runner
    from ktlong.eval.__main__ import main

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    ran = []

    def fake_run_task(lm, config, task, lengths, depths, samples, attentions, seed, on_result=None, earlier=(), **kw):
        results = list(earlier)
        done = {(r.attention, r.length, r.sample) for r in earlier}
        for a in attentions:
            for n in lengths:
                for i in range(samples):
                    if (a, n, i) not in done:
                        ran.append((task, a, n, i))
                        results.append(_result(task, a, n, i, correct(a, i)))
                        on_result(results)
        return results

    monkeypatch.setattr(runner, "run_task", fake_run_task)
    code = main(argv)
    return code, ran


def test_resume_completes_a_split_run_and_prints_its_grid(monkeypatch, tmp_path, capsys):
    """Without --resume an earlier results.json is refused, untouched; with it, a run measured
    with the same settings goes on (one process ran dense, the next runs sparse only), and the
    grid compares the two; a run with other options is refused in one sentence, the file kept."""
    import json

    out = tmp_path / "out"
    base = ["multikey,qa", "--model", "smollm2-135m", "--lengths", "1k", "--samples", "2", "--device", "cpu",
            "--out", str(out)]
    code, ran = _saved_run(tmp_path, monkeypatch, base + ["--attention", "dense"])
    assert code == 0 and len(ran) == 4
    before = (out / "qa" / "results.json").read_bytes()
    capsys.readouterr()
    code, ran = _saved_run(tmp_path, monkeypatch, base + ["--attention", "dense,sparse"])
    err = capsys.readouterr().err
    assert code == 2 and ran == [] and "holds an earlier run" in err and "--resume" in err and len(err.splitlines()) == 1
    assert (out / "qa" / "results.json").read_bytes() == before
    code, ran = _saved_run(tmp_path, monkeypatch, base + ["--attention", "dense,sparse", "--resume"],
                           correct=lambda arm, i: arm == "dense" or i == 0)
    assert code == 0 and sorted(ran) == [(t, "sparse", 1024, i) for t in ("multikey", "qa") for i in (0, 1)]
    saved = json.loads((out / "qa" / "results.json").read_text())
    assert [(r["attention"], r["sample"]) for r in saved["results"]] == [("dense", 0), ("dense", 1), ("sparse", 0),
                                                                          ("sparse", 1)]
    assert "sparse: 2 right against dense's 4" in capsys.readouterr().out
    code, ran = _saved_run(tmp_path, monkeypatch, base + ["--resume", "--set", "keep_blocks=64"])
    err = capsys.readouterr().err
    assert code == 2 and ran == [] and "keep_blocks: 128 there, 64 here" in err and len(err.splitlines()) == 1
    assert json.loads((out / "qa" / "results.json").read_text()) == saved


@pytest.mark.parametrize("content, why", [
    (b"{not json", "cannot read"),
    (b'[1, 2]', "not an evaluation's results"),
    (b'{"task": "qa", "results": []}', "holds results of task 'qa'"),
    (None, "result 0 is not one this version writes"),
])
def test_resume_refuses_a_file_it_did_not_write(tmp_path, content, why):
    """read_earlier checks what it reads: JSON, the task, the settings, every field's type."""
    import json

    from ktlong.config import default_config
    from ktlong.errors import KtlongError
    from ktlong.eval.results_file import as_dicts, read_earlier, run_settings

    settings = run_settings(default_config(), "m.gguf", 0)
    path = tmp_path / "results.json"
    if content is None:  # ours, but a sample's `correct` is a string
        bad = as_dicts([_result("passkey", "dense", 1024, 0, True)])
        bad[0]["correct"] = "yes"
        content = json.dumps({"task": "passkey", "settings": settings, "results": bad}).encode()
    path.write_bytes(content)
    with pytest.raises(KtlongError, match=why):
        read_earlier(path, "passkey", settings)
    assert read_earlier(tmp_path / "none.json", "passkey", settings) == []
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(KtlongError, match="is a folder"):  # not a regular file: refused before anything is read
        read_earlier(tmp_path / "folder.json", "passkey", settings)


def test_the_grid_compares_the_prompts_both_arms_ran():
    """Cells an arm has not run (a split run, one cut short) do not count as wrong answers: the
    sums are over the prompts both ran, and the verdict names what is missing and does not hold."""
    from ktlong.eval.report import grid_rows

    results = ([_result("qa", "dense", 1024, i, True) for i in range(4)]
               + [_result("qa", "sparse", 1024, i, i != 1) for i in range(2)]
               + [_result("multikey", "dense", 1024, i, True) for i in range(4)])
    headers, rows, (verdict,) = grid_rows(results)
    assert rows == [["multikey", 1024, "4/4", "-", "-"], ["qa", 1024, "4/4", "1/2", "1/2"]]
    assert verdict.startswith("sparse: 1 right against dense's 2 ") and "below dense: none" in verdict
    assert "not run: multikey 1,024 (0 of 4), qa 1,024 (2 of 4)" in verdict and not _holds(verdict)


def test_the_grid_counts_answers_like_dense_even_where_both_are_wrong():
    """Two arms wrong on a prompt in different ways score alike but did not answer alike; the
    same wrong answer counts as the same (passkey compares first integers)."""
    from ktlong.eval.report import grid_rows
    from ktlong.eval.runner import Result

    def result(arm, sample, output):
        return Result("passkey", arm, 1024, 0.5, sample, 1024, "1", output, output.startswith("1"), 1.0, 1.0, 1.0)

    results = [result("dense", 0, "7"), result("sparse", 0, "8"), result("dense", 1, "The key is 5."),
               result("sparse", 1, "5, I think")]
    headers, rows, _ = grid_rows(results)
    assert rows == [["passkey", 1024, "0/2", "0/2", "1/2"]]
