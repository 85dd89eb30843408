"""The server's cache of many conversations (ktlong/server/cache_store.py), through the official
`openai` client and the cache endpoints: three documents asked about in turn, with room in DRAM
for one besides the session's, so that each comes back from DRAM or from disk; every answer
equals a fresh dense run of the same prompt; the files survive a restart; the disk budget and
the endpoints' errors."""

import dataclasses
import json

import pytest

openai = pytest.importorskip("openai")

from ktlong.errors import ConfigError
from ktlong.kv.memory_plan import GIB
from ktlong.server.__main__ import make_app
from tests.http_server import RunningServer, started
from tests.test_server import MODEL, chat_ids, reference

pytestmark = pytest.mark.slow  # loads a real model

MIN_TOKENS = 64
TOPICS = ("the river Vlatna and its seven bridges", "the orchard of Kessa and its grey apples",
          "the clockmaker Odrin and his brass owls")


def document(i: int) -> str:
    topic = TOPICS[i]
    lines = [f"Note {n} about {topic}: the record for day {n} says {n * 7 + i} visitors came." for n in range(12)]
    return "\n".join(lines)


def messages(i: int, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{document(i)}\n\n{question}"}]


@pytest.fixture(scope="module")
def lm(real_model):
    return real_model(MODEL)


def app_for(lm, folder, dram_slots=1, **options):
    """Long-context mode on the CPU with room in DRAM for dram_slots conversations besides the session's."""
    options = dict(mode="long_context", max_new_tokens=8, block_size=16, chunk_size=64, local_windows_len=64,
                   max_seq_len=2048, cache_min_tokens=MIN_TOKENS, cache_dir=str(folder), **options)
    st = started(lm, MODEL, **options)
    budget = (dram_slots + 0.5) * st.session.cache_bytes / GIB
    st = dataclasses.replace(st, config=st.config.with_overrides({"cache_dram_gb": (budget, "test")}))
    return make_app(st)[0]


def ask(server, lm, i, question):
    """The answer and usage, checked against a fresh dense run of the same prompt."""
    msgs = messages(i, question)
    out = server.client().chat.completions.create(model=MODEL, messages=msgs)
    expected = reference(lm, chat_ids(lm, msgs), 8)
    assert out.choices[0].message.content == expected.text
    return out.usage


def cache_list(server) -> dict:
    status, data = server.raw("GET", "/cache")
    assert status == 200
    return {e["id"]: e for e in json.loads(data)["data"]}


def test_documents_come_back_from_dram_and_disk_and_survive_a_restart(lm, tmp_path):
    server = RunningServer(app_for(lm, tmp_path))
    try:
        prefix = [len(chat_ids(lm, messages(i, ""))) - 8 for i in range(3)]  # the document's tokens, at least
        for i in range(3):
            first = ask(server, lm, i, "How many visitors came on day 3?")
            assert first.prompt_tokens_details.cached_tokens < MIN_TOKENS  # new documents: at most the template's head
        # A was held in DRAM when B came, then spilled to disk for C (one slot): A comes back from disk
        use = ask(server, lm, 0, "How many visitors came on day 5?")
        assert use.prompt_tokens_details.cached_from == "disk"
        assert use.prompt_tokens_details.cached_tokens >= prefix[0]
        # C went to DRAM for A (B spilled): C comes back from DRAM, the session's conversation stays
        use = ask(server, lm, 2, "How many visitors came on day 5?")
        assert use.prompt_tokens_details.cached_from == "dram"
        assert use.prompt_tokens_details.cached_tokens >= prefix[2]
        use = ask(server, lm, 2, "How many visitors came on day 6?")
        assert use.prompt_tokens_details.cached_from == "session"
        entries = cache_list(server)
        assert len(entries) == 3 and sorted(len(e["where"]) for e in entries.values()) == [1, 1, 2]
        assert sum("session" in e["where"] for e in entries.values()) == 1
        on_disk = {p.stem for p in tmp_path.glob("*.ktkv")}
        assert on_disk == {k for k, e in entries.items() if "disk" in e["where"]} and len(on_disk) == 2
        assert all(e["disk_bytes"] == (tmp_path / f"{k}.ktkv").stat().st_size for k, e in entries.items()
                   if k in on_disk)
        status, body = server.raw("GET", "/metrics")
        disk_line = next(line for line in body.decode().splitlines() if line.startswith('ktlong_kv_cache_bytes{tier="disk"}'))
        assert float(disk_line.split()[-1]) == sum(e["disk_bytes"] for e in entries.values())
    finally:
        server.stop()  # writes what DRAM held to disk
    assert len(list(tmp_path.glob("*.ktkv"))) == 3

    restarted = RunningServer(app_for(lm, tmp_path))
    try:
        entries = cache_list(restarted)
        assert len(entries) == 3 and all(e["where"] == ["disk"] for e in entries.values())
        use = ask(restarted, lm, 1, "How many visitors came on day 9?")
        assert use.prompt_tokens_details.cached_from == "disk"
        assert use.prompt_tokens_details.cached_tokens >= prefix[1]

        # the endpoints: restore one, save it, erase another; unknown ids are 404
        some = next(k for k, e in cache_list(restarted).items() if e["where"] == ["disk"])
        status, data = restarted.raw("POST", f"/cache/{some}/restore")
        assert status == 200 and json.loads(data)["where"][0] == "session"
        assert cache_list(restarted)[some]["where"][0] == "session"
        status, data = restarted.raw("POST", f"/cache/{some}/save")
        assert status == 200 and "disk" in json.loads(data)["where"]
        status, data = restarted.raw("POST", f"/cache/{some}/erase")  # erasing is DELETE's, not a POST's
        assert status == 404 and "No such endpoint" in json.loads(data)["error"]["message"]
        assert (tmp_path / f"{some}.ktkv").exists()
        status, _ = restarted.raw("DELETE", f"/cache/{some}")
        assert status == 200 and not (tmp_path / f"{some}.ktkv").exists() and some not in cache_list(restarted)
        for method, path in (("DELETE", "/cache/0123456789ab"), ("POST", "/cache/nothing/restore"),
                             ("POST", f"/cache/{some}/save")):
            status, data = restarted.raw(method, path)
            assert status == 404 and "GET /cache lists them" in json.loads(data)["error"]["message"]
    finally:
        restarted.stop()


def test_a_file_past_the_disk_budget_is_not_written(lm, tmp_path):
    lines = []
    st = started(lm, MODEL, mode="long_context", max_new_tokens=8, block_size=16, chunk_size=64,
                 local_windows_len=64, max_seq_len=2048, cache_min_tokens=MIN_TOKENS, cache_dir=str(tmp_path),
                 cache_dram_gb=0.0, cache_disk_gb=1e-6)
    app, _ = make_app(st, log=None)
    store = app.state.worker.store
    store.log = lines.append
    server = RunningServer(app)
    try:
        for i in range(2):
            ask(server, lm, i, "How many visitors came on day 1?")
        assert not list(tmp_path.glob("*.ktkv")) and "raise cache_disk_gb" in lines[0]
        assert len(cache_list(server)) == 1  # the session's; the first document could go nowhere
    finally:
        server.stop()


def test_cache_dir_is_refused_where_no_cache_can_be_kept(lm, tmp_path):
    with pytest.raises(ConfigError, match="add --mode long_context"):
        make_app(started(lm, MODEL, cache_dir=str(tmp_path)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="name another"):
        make_app(started(lm, MODEL, mode="long_context", max_seq_len=2048, cache_dir=str(tmp_path / "file")))


def test_a_conversation_brought_back_from_disk_is_never_evicted_by_the_one_it_replaces(lm, tmp_path):
    """No DRAM slots and disk room for one file: going back to document 0 parks document 1,
    whose spill needs room, and the only file it could take is document 0's, about to be
    loaded. Document 0 comes back; document 1 goes nowhere (logged)."""
    lines = []
    st = started(lm, MODEL, mode="long_context", max_new_tokens=8, block_size=16, chunk_size=64,
                 local_windows_len=64, max_seq_len=2048, cache_min_tokens=MIN_TOKENS, cache_dir=str(tmp_path),
                 cache_dram_gb=0.0)
    app, _ = make_app(st, log=None)
    store = app.state.worker.store
    store.log = lines.append
    server = RunningServer(app)
    try:
        ask(server, lm, 0, "How many visitors came on day 1?")
        ask(server, lm, 1, "How many visitors came on day 1?")  # document 0 spilled to its file
        (first,) = tmp_path.glob("*.ktkv")
        store.disk_budget = first.stat().st_size * 3 // 2  # room for one file, not two
        use = ask(server, lm, 0, "How many visitors came on day 2?")
        assert use.prompt_tokens_details.cached_from == "disk"
        assert [p.name for p in tmp_path.glob("*.ktkv")] == [first.name] or not list(tmp_path.glob("*.ktkv"))
        assert any("raise cache_disk_gb" in line for line in lines)  # document 1's spill, refused
        assert ask(server, lm, 0, "How many visitors came on day 3?").prompt_tokens_details.cached_from == "session"
    finally:
        server.stop()
