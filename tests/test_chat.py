"""Generation and the chat loop: greedy decode with the cache equals recomputation, history
stays within max_seq_len, commands and Ctrl-C behave, and a real model answers."""

import io

import numpy as np
import pytest

from ktlong.config import load_config, parse_set
from ktlong.chat.conversation import Conversation, PromptTooLongError
from ktlong.session.dense import DenseSession
from ktlong.chat.generate import generate
from ktlong.models.loader import load_model
from ktlong.chat.sampling import Sampler
from tests.reference_llama import reference_logits
from tests.tiny_gguf import TinySpec, write_tiny_gguf
from tests.no_text import NO_TEXT


@pytest.fixture
def tiny(tmp_path):
    spec = TinySpec()
    path = tmp_path / "tiny.gguf"
    tensors = write_tiny_gguf(path, spec, seed=5)
    return load_model(str(path)), spec, tensors


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return load_config(overrides=parse_set(["max_new_tokens=12", "chunk_size=128", "block_size=16"]))


def test_greedy_generation_equals_recomputing_every_step(tiny):
    lm, spec, tensors = tiny
    prompt = [5, 17, 99, 3, 250, 41, 7]
    session = DenseSession(lm.model, 64, chunk_size=4)  # prompt spans two chunks
    result = generate(session, prompt, 10, Sampler(), frozenset(), NO_TEXT)
    expected, ids = [], list(prompt)
    for _ in range(10):
        token = int(reference_logits(tensors, spec, ids)[-1].argmax())
        expected.append(token)
        ids.append(token)
    assert result.token_ids == expected and result.finish_reason == "length"


def test_second_turn_reuses_cached_prefix(tiny):
    lm, spec, tensors = tiny
    session = DenseSession(lm.model, 64, chunk_size=8)
    session.prefill([1, 2, 3, 4, 5])
    logits = session.prefill([1, 2, 3, 9, 8, 7]).numpy()  # diverges at position 3
    expected = reference_logits(tensors, spec, [1, 2, 3, 9, 8, 7])[-1]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4


def test_old_turns_dropped_to_fit_and_too_long_prompt_refused(tiny):
    lm, _, _ = tiny
    conv = Conversation(lm.tokenizer, lm.chat_template)
    for i in range(5):
        conv.add_turn("question " * 5, "answer " * 5)
    full = len(conv.render_ids(conv.turns, "hi"))
    ids, dropped = conv.prompt_ids("hi", max_seq_len=full - 10, reserve=0)
    assert dropped >= 1 and len(ids) <= full - 10 and len(conv.turns) == 5 - dropped
    with pytest.raises(PromptTooLongError, match="max_seq_len is 20"):
        conv.prompt_ids("word " * 50, max_seq_len=20, reserve=0)
    assert len(conv.turns) == 5 - dropped  # nothing lost on refusal


def test_loop_commands_files_and_multiline(tiny, config, tmp_path):
    from ktlong.chat.loop import ChatLoop

    lm, _, _ = tiny
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("from the prompt file")
    other = tmp_path / "other.txt"
    other.write_text("from another file")
    loop = ChatLoop(lm, config, 256, str(prompt_file), out=io.StringIO(), err=io.StringIO())
    lines = iter(["", str(other), '"""', "line one", "line two", '"""', "/reset", "plain", "/exit",
                  "never read"])
    read = lambda: next(lines, None)
    assert loop.next_prompt(read) == "from the prompt file"
    assert loop.next_prompt(read) == "from another file"
    assert loop.next_prompt(read) == "line one\nline two"
    loop.conversation.add_turn("a", "b")
    assert loop.next_prompt(read) == "plain" and loop.conversation.turns == []
    assert loop.next_prompt(read) is None


def test_ctrl_c_stops_the_answer_but_not_the_session(tiny, config):
    from ktlong.chat.loop import ChatLoop

    lm, _, _ = tiny
    out = io.StringIO()
    loop = ChatLoop(lm, config, 256, None, out=out, err=io.StringIO())
    count = {"n": 0}

    def interrupt_after_three(piece):
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt

    session, sampler = loop.session, loop.sampler
    result = generate(session, [1, 2, 3], 20, sampler, frozenset(), lm.tokenizer,
                      on_text=interrupt_after_three)
    assert result.finish_reason == "interrupted" and len(result.token_ids) == 3
    again = loop.ask("still alive?")
    assert again is not None and again.finish_reason in ("stop", "length")


def test_an_answer_cut_by_max_seq_len_says_so(tiny, config):
    """An answer that stops where max_seq_len leaves no room (before max_new_tokens, 12 here) is
    noticed as such; one that reaches max_new_tokens is not."""
    from ktlong.chat.loop import ChatLoop

    lm, _, _ = tiny
    quiet = ChatLoop(lm, config, 256, None, out=io.StringIO(), err=io.StringIO())
    prompt = len(quiet.conversation.render_ids([], "hi"))
    for max_seq_len, tokens in ((prompt + 4, 4), (256, 12)):
        err = io.StringIO()
        result = ChatLoop(lm, config, max_seq_len, None, out=io.StringIO(), err=err).ask("hi")
        assert (result.finish_reason, len(result.token_ids)) == ("length", tokens)
        assert (f"stopped at max_seq_len {max_seq_len}" in err.getvalue()) == (tokens < 12), err.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_model_knows_the_capital_of_france(model, tmp_path, monkeypatch, capsys):
    import local_chat

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    assert local_chat.main(["--model", model, "--max_new_tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_a_prompt_files_trailing_whitespace_is_not_part_of_the_prompt(tiny, config, tmp_path):
    from ktlong.chat.loop import ChatLoop

    lm, _, _ = tiny
    loop = ChatLoop(lm, config, 256, None, out=io.StringIO(), err=io.StringIO())
    path = tmp_path / "doc.txt"
    path.write_text("  indented\n\ninner  line\n \n\t\n")
    assert loop.read_file(str(path)) == "  indented\n\ninner  line"


@pytest.mark.slow
def test_readme_example_file_answers_paris(tmp_path, monkeypatch, capsys):
    """The README's first command: the default model, examples/capital.txt (it ends with a newline)."""
    from pathlib import Path

    import local_chat

    example = Path(__file__).resolve().parent.parent / "examples" / "capital.txt"
    assert example.read_text().endswith("\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert local_chat.main(["--prompt_file", str(example), "--max_new_tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_piped_input_that_is_not_utf8_is_one_sentence_not_a_traceback(tiny, config, monkeypatch):
    """Undecodable bytes reach input() as lone surrogates, which the tokenizer cannot take."""
    from ktlong.chat.loop import ChatLoop
    from ktlong.errors import KtlongError

    lm, _, _ = tiny
    out = io.StringIO()
    monkeypatch.setattr("builtins.input", lambda prompt="": "hello \udcff\udcfe there")
    loop = ChatLoop(lm, config, 256, None, out=out, err=io.StringIO())
    with pytest.raises(KtlongError, match="Standard input is not UTF-8 text"):
        loop.run(interactive=False)
    assert out.getvalue() == ""


@pytest.mark.parametrize("interactive", [False, True])
def test_what_a_run_could_not_send_is_noticed_and_a_piped_run_fails(tiny, config, tmp_path, piped_input, interactive):
    """A --prompt_file longer than max_seq_len, and input lines refused (a message too long, /save
    without a path, a binary file named), are each noticed and nothing of the conversation is lost;
    the chat answers the rest. run() returns them as not done: the prompt file always, the input's
    refusals in a piped run only (local_chat.py then exits 1)."""
    from ktlong.chat.loop import ChatLoop

    lm, _, _ = tiny
    long_file = tmp_path / "long.txt"
    long_file.write_text(" ".join(f"w{i}" for i in range(300)))
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x00\x01\x02 not text")
    piped_input([" ".join(f"w{i}" for i in range(300)), "/save", str(binary), "hello"])
    out, err = io.StringIO(), io.StringIO()
    loop = ChatLoop(lm, config, 256, str(long_file), out=out, err=err)
    failed = loop.run(interactive=interactive)
    notices = err.getvalue()
    assert notices.count("max_seq_len is 256") == 2 and "/save needs a file path" in notices
    assert f"{binary}" in notices and loop.refused == 4
    assert [user for user, _ in loop.conversation.turns] == ["hello"]  # the one message sent, answered
    assert out.getvalue().strip() == loop.conversation.turns[0][1].strip()
    expected = [f"--prompt_file {long_file}"] + ([] if interactive else ["3 messages or commands of the piped input"])
    assert failed == expected
