"""Several answers at once (ktlong/server/worker.py), through the official `openai` client:
concurrent clients, some of which go away mid-answer, each get the answer the same request gets
alone; the decode steps really ran several conversations together; and a stream keeps
producing tokens while another request's long prompt prefills."""

import gc
import io
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from ktlong.gguf.text_cache import common_prefix
from ktlong.server.__main__ import make_app
from tests.http_server import RunningServer, started
from tests.test_server import MODEL, chat_ids, reference

pytestmark = pytest.mark.slow  # loads a real model

ANSWER_TOKENS = 12
PLACES = ("Vlatna", "Kessa", "Odrin", "Pellow", "Marsk", "Tiberon")


def messages(i: int, lines: int = 10) -> list[dict]:
    place = PLACES[i % len(PLACES)]
    notes = "\n".join(f"Day {n} in {place}: {n * 7 + i} visitors crossed bridge {n % 5}." for n in range(lines))
    return [{"role": "user", "content": f"{notes}\n\nHow many visitors came to {place} on day 3?"}]


@pytest.fixture(scope="module")
def lm(real_model):
    return real_model(MODEL)


@pytest.fixture(scope="module")
def server(lm):
    app, _ = make_app(started(lm, MODEL, mode="long_context", max_new_tokens=ANSWER_TOKENS, block_size=16,
                              chunk_size=64, local_windows_len=64, max_seq_len=4096, cache_min_tokens=64,
                              max_num_seqs=4, queue_size=8, prefill_slice_ms=20))
    rows = []  # how many conversations each decode step ran
    inside = []  # a prefill's slices run inside a step (while the device works on it)
    session = app.state.worker.session
    step_batch = session.step_batch

    def counted(conversations, tokens, beside=None):
        rows.append(len(conversations))

        def slice_inside(step_done):
            inside.append(len(conversations))
            beside(step_done)

        return step_batch(conversations, tokens, slice_inside if beside else None)

    session.step_batch = counted
    s = RunningServer(app)
    s.rows, s.inside, s.worker = rows, inside, app.state.worker
    yield s
    s.stop()


def settle(server) -> dict:
    """/health once nothing runs or waits (a cancel reaches the worker at its next step)."""
    deadline = time.time() + 60
    while (h := server.health())["running"] or h["waiting"]:
        assert time.time() < deadline, h
        time.sleep(0.05)
    return h


def test_concurrent_clients_with_cancels_get_the_answers_they_get_alone(server, lm):
    client = server.client()
    alone = [client.chat.completions.create(model=MODEL, messages=messages(i)).choices[0].message.content
             for i in range(len(PLACES))]
    assert len(set(alone)) > 1  # the documents lead to different answers
    before = settle(server)["requests"]
    server.rows.clear()

    # eight clients: the six documents (each held by the cache store from its run alone) and two
    # of them again at once (a conversation that decodes is not lent to another request)
    rng = random.Random(5)
    plan = [(i % len(PLACES), rng.choice([None, None, 1, 3])) for i in range(8)]
    assert {c is None for _, c in plan} == {True, False}  # some stay, some leave

    def run(doc, cancel_after):
        c = server.client()
        if cancel_after is None:
            return c.chat.completions.create(model=MODEL, messages=messages(doc)).choices[0].message.content
        pieces = []
        stream = c.chat.completions.create(model=MODEL, messages=messages(doc), stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) == cancel_after:
                    stream.close()  # the client goes away mid-answer
                    return None
        return "".join(pieces)  # the answer ended before the client meant to leave

    with ThreadPoolExecutor(len(plan)) as pool:
        results = list(pool.map(lambda p: run(*p), plan))

    for (doc, _), got in zip(plan, results):
        assert got is None or got == alone[doc], doc
    assert max(server.rows) > 1  # steps decoded several conversations together
    after = settle(server)["requests"]
    cancelled = after["cancelled"] - before["cancelled"]
    completed = after["completed"] - before["completed"]
    assert completed + cancelled == len(plan) and after["failed"] == before["failed"]
    assert completed >= sum(r is not None for r in results)
    # nothing lost: every document still gives its answer (its conversation kept by the cache)
    for i in (0, 5):
        assert client.chat.completions.create(model=MODEL, messages=messages(i)).choices[0].message.content == alone[i]


def test_a_stream_keeps_going_while_a_long_prompt_prefills(server, lm):
    client = server.client()
    long_messages = messages(1, lines=70)
    assert len(chat_ids(lm, long_messages)) > 1200
    story = "The ferry log of Pellow, one line a day:\nDay 1: 14 crossings.\nDay 2: 17 crossings.\n"
    alone = client.completions.create(model=MODEL, prompt=story, max_tokens=64).choices[0].text
    settle(server)
    times, texts, progress = [], [], []

    def short():
        for chunk in client.completions.create(model=MODEL, prompt=story, max_tokens=64, stream=True):
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
                texts.append(chunk.choices[0].text)

    log, server.worker.log = server.worker.log, io.StringIO()
    t = threading.Thread(target=short)
    t.start()
    deadline = time.time() + 60
    while len(times) < 2:  # the short answer is decoding
        assert time.time() < deadline and t.is_alive()
        time.sleep(0.01)
    for chunk in client.chat.completions.create(model=MODEL, messages=long_messages, max_tokens=4, stream=True,
                                                extra_body={"return_progress": True}):
        if not chunk.choices and chunk.model_extra.get("prompt_progress"):
            progress.append((time.perf_counter(), chunk.model_extra["prompt_progress"]))
    t.join()
    assert "".join(texts) == alone and len(texts) > 40
    started_at = progress[0][0]
    ended_at = next(at for at, p in progress if p["done"] == p["total"])
    during = [at for at in times if started_at < at < ended_at]
    assert ended_at - started_at > 0.5  # a prefill long enough to see
    assert len(during) >= 3, (len(during), len(times), ended_at - started_at)
    assert server.inside  # its slices ran while the device worked on the short answer's steps
    settle(server)
    # the log says how its time went: the steps beside it, and its slices in them
    written, server.worker.log = server.worker.log.getvalue(), log
    line = next(line for line in written.splitlines() if line.startswith("[answer: ") and "beside " in line)
    steps = int(line.split("beside ")[1].split(" decode steps")[0])
    assert steps >= len(during)
    # and its own thread's time: at work and waiting, within the prefill's
    prefill = float(line.split(" prefill ")[1].split(" s")[0])
    work = float(line.split("its thread ")[1].split(" s at work")[0])
    waiting = float(line.split(" s at work, ")[1].split(" s waiting")[0])
    assert 0 < work and work + waiting <= prefill + 0.05
    # and its longest steps, each at least its slice, which holds the thread's time in it; none
    # longer than the longest wait the client saw between two tokens (a token is sent after its step)
    longest = re.findall(r"(\d+) ms \(slice (\d+): (\d+) at work, (\d+) waiting; at chunk ([\d,]+)\)",
                         line.split("the longest steps ")[1])
    assert 1 <= len(longest) <= 3
    gaps = [b - a for a, b in zip(times, times[1:])]
    for step in longest:
        seconds, in_slice, at_work, waits = (int(x) / 1000 for x in step[:4])
        assert in_slice <= seconds + 0.001 and at_work + waits <= in_slice + 0.002
        assert seconds <= max(gaps) + 0.05
    # and how many steps went over 100 ms, by what most of each was: as many as its parts, and at
    # least the longest ones named over 100 ms
    over = re.search(r"; (\d+) over 100 ms((?:, \d+ mostly [a-z' ]+)*);", line)
    parts = [int(n) for n in re.findall(r", (\d+) mostly", over[2])]
    assert sum(parts) == int(over[1]) <= steps
    assert int(over[1]) >= sum(int(step[0]) > 100 for step in longest)
    # and the garbage collector's full passes meanwhile (their count: the next test)
    passes = re.search(r"; the garbage collector's full passes (\d+), (\d+) ms in all\)", line)
    assert int(passes[2]) <= prefill * 1000


def test_each_answer_keeps_its_own_options_inside_a_batch(server, lm):
    """Stop strings, logprobs, a seeded sample and a JSON schema, requests decoding at once: each
    gives what it gives alone (the same text and finish reason, the same log-probabilities)."""
    schema = {"type": "object", "properties": {"day": {"type": "integer"}, "visitors": {"type": "integer"}},
              "required": ["day", "visitors"], "additionalProperties": False}
    requests = [
        ("chat", dict(messages=messages(0), stop=[" visitors"])),
        ("chat", dict(messages=messages(1), logprobs=True, top_logprobs=3)),
        ("chat", dict(messages=messages(2), temperature=0.9, seed=11)),
        ("chat", dict(messages=messages(3), max_tokens=30, response_format={
            "type": "json_schema", "json_schema": {"name": "visit", "schema": schema, "strict": True}})),
        ("completion", dict(prompt="Day 1: 14 crossings.\nDay 2:", logprobs=2, max_tokens=10)),
    ]

    def ask(kind, kw):
        """-> text, finish reason, every log-probability the answer carries (in order)."""
        c = server.client()
        if kind == "completion":
            out = c.completions.create(model=MODEL, **kw).choices[0]
            return out.text, out.finish_reason, out.logprobs.token_logprobs
        out = c.chat.completions.create(model=MODEL, **kw).choices[0]
        numbers = [x for t in out.logprobs.content for x in [t.logprob] + [a.logprob for a in t.top_logprobs]] \
            if out.logprobs else []
        return out.message.content, out.finish_reason, numbers

    alone = [ask(*r) for r in requests]
    settle(server)
    server.rows.clear()
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: ask(*r), requests))
    assert max(server.rows) > 1
    for (text, finish, numbers), (text2, finish2, numbers2) in zip(alone, together):
        assert (text2, finish2) == (text, finish)
        assert len(numbers) == len(numbers2)
        # float32 on the CPU: a batch's rows sum their products in another order
        assert all(abs(a - b) < 1e-3 for a, b in zip(numbers, numbers2))
    assert alone[0] == ("Day 3 in Vlatna: 7", "stop", [])
    assert len(alone[1][2]) == 4 * 12 and len(alone[4][2]) == 10
    assert json.loads(alone[3][0]).keys() == {"day", "visitors"} and alone[3][1] == "stop"


def test_a_conversation_that_is_answering_cannot_be_erased_or_displaced(server, lm):
    """While an answer decodes, DELETE /cache/ID of its conversation and restoring another into
    the session are refused with a 409 (the answer goes on, and ends as it would alone)."""
    client = server.client()
    story = "The ferry log of Quell, one line a day:\nDay 1: 9 crossings.\nDay 2: 11 crossings.\n" * 8
    alone = client.completions.create(model=MODEL, prompt=story, max_tokens=40).choices[0].text
    other = client.completions.create(model=MODEL, prompt="Another log. " * 40, max_tokens=2)
    settle(server)
    pieces = []
    stream = client.completions.create(model=MODEL, prompt=story, max_tokens=40, stream=True)
    for chunk in stream:
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if len(pieces) == 3:
            entries = json.loads(server.raw("GET", "/cache")[1])["data"]
            live = next(e for e in entries if "session" in e["where"])
            idle = next(e for e in entries if e["id"] != live["id"])
            status, body = server.raw("DELETE", f"/cache/{live['id']}")
            assert status == 409 and b"answering" in body
            status, body = server.raw("POST", f"/cache/{idle['id']}/restore")
            assert status == 409 and b"answering" in body
    assert "".join(pieces) == alone
    assert other.choices[0].text is not None


def test_a_question_over_a_document_being_answered_shares_its_blocks(server, lm):
    """A second question over a document whose first question is being answered starts a
    conversation of its own that shares the document's leading blocks (one copy in DRAM, counted
    once in /cache and /metrics) and copies the rest of what the two prompts have in common,
    prefills only its question, and both answers are what they are alone
    (the second: a fresh dense run's)."""
    client = server.client()
    notes = "\n".join(f"Entry {n} of the lock-keeper's book at Sarn: {n * 13 % 97} barges passed the weir."
                      for n in range(24))
    first = [{"role": "user", "content": f"{notes}\n\nHow many barges passed on entry 4?"}]
    second = [{"role": "user", "content": f"{notes}\n\nWhat does entry 9 say?"}]
    assert len(chat_ids(lm, second)) > 512
    alone = client.chat.completions.create(model=MODEL, messages=first, max_tokens=40).choices[0].message.content
    expected = reference(lm, chat_ids(lm, second), 8).text
    settle(server)
    pieces, during = [], {}
    for chunk in client.chat.completions.create(model=MODEL, messages=first, max_tokens=40, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 2:  # the first answer decodes: the second question arrives
                out = client.chat.completions.create(model=MODEL, messages=second, max_tokens=8)
                during["answer"], during["usage"] = out.choices[0].message.content, out.usage
                entries = json.loads(server.raw("GET", "/cache")[1])["data"]
                during["metrics"] = server.raw("GET", "/metrics")[1].decode()
                during["entries"] = entries
    assert "".join(pieces) == alone
    assert during["answer"] == expected
    details = during["usage"].prompt_tokens_details
    common = common_prefix(chat_ids(lm, first), chat_ids(lm, second))
    assert details.cached_from == "shared" and details.cached_tokens == common > 512
    sharing = [e for e in during["entries"] if e["shared_bytes"]]
    assert len(sharing) == 2 and sharing[0]["shared_bytes"] == sharing[1]["shared_bytes"]
    dram = next(float(line.split()[-1]) for line in during["metrics"].splitlines()
                if line.startswith('ktlong_kv_cache_bytes{tier="dram"}'))
    whole = sharing[0]["dram_bytes"] + sharing[0]["shared_bytes"]  # one cache's size
    # every cache whole, less the second copy of the shared part that DRAM does not hold
    assert (dram + sharing[0]["shared_bytes"]) % whole == 0
    settle(server)


def counted_server(lm, **options):
    """A long-context server for four answers at once whose session counts the conversations of
    each decode step -> (started, app, the counts, the running server)."""
    st = started(lm, MODEL, mode="long_context", max_new_tokens=ANSWER_TOKENS, block_size=16, chunk_size=64,
                 local_windows_len=64, max_seq_len=1024, cache_min_tokens=64, max_num_seqs=4, queue_size=8, **options)
    app, _ = make_app(st)
    rows = []
    session = app.state.worker.session
    step_batch = session.step_batch
    session.step_batch = lambda conversations, tokens, *beside: (rows.append(len(conversations)),
                                                        step_batch(conversations, tokens, *beside))[1]
    return st, app, rows, RunningServer(app)


def test_a_request_waits_for_dram_while_another_answers_and_the_log_says_how_each_went(lm, capfd):
    """With DRAM for one conversation's cache at a time (the store's dram_limit), a second request
    waits until the first answer ends instead of running out of memory: no step ever runs two, and
    both answers are what they are alone. The server's log has a line for each answer."""
    st, app, rows, server = counted_server(lm)
    try:
        client = server.client()
        alone = [client.chat.completions.create(model=MODEL, messages=messages(i)).choices[0].message.content
                 for i in range(2)]
        app.state.worker.store.dram_limit = int(1.5 * st.session.cache_bytes)
        capfd.readouterr()
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda i: server.client().chat.completions.create(model=MODEL, messages=messages(i)),
                                 range(2)))
        assert [o.choices[0].message.content for o in outs] == alone
        assert not rows or max(rows) == 1  # never together: the second waited
        log = capfd.readouterr().err
        lines = [line for line in log.splitlines() if line.startswith("[answer: ")]
        assert len(lines) == 2 and all(" cached" in line and " tok/s]" in line for line in lines)
        waited = sorted(float(line.split("queued ")[1].split(" s")[0]) for line in lines)
        assert waited[1] > 0.05  # the second sat in the queue while the first answered
    finally:
        server.stop()


def test_admission_counts_a_prefills_hidden_states_in_dram_beside_its_cache(lm):
    """Where a prefill keeps its hidden states in DRAM (a GPU's long prompts: 8 GiB at 1M tokens
    and 8B shapes), a request is admitted only when they fit beside its cache: a 1M prefill beside
    four 120K conversations once ran the machine out of memory for want of this count."""
    from ktlong.kv.host_cache import cache_bytes_for

    st = started(lm, MODEL, mode="long_context", block_size=16, chunk_size=64, local_windows_len=64,
                 max_seq_len=1024, cache_min_tokens=64, max_num_seqs=4)
    app, _ = make_app(st)
    store, session = app.state.worker.store, st.session
    try:
        prompt = list(range(500))
        cache = cache_bytes_for(session.layout, 600)
        store.dram_limit = store._held() + cache + 1000
        assert store.admit(prompt, 600, alone=False)  # hidden states on the device (the CPU's case)
        session.engine.dram_bytes = lambda n: n * 4096 * 2  # bf16 rows of hidden size 4096, in DRAM
        assert not store.admit(prompt, 600, alone=False)
        store.dram_limit += 500 * 4096 * 2
        assert store.admit(prompt, 600, alone=False)
    finally:
        app.state.worker.close()


def test_admission_frees_the_sessions_own_idle_conversation_when_a_new_prompt_needs_its_dram(lm):
    """The conversation the session holds, idle and not continued by a new prompt, counts as
    memory that can be freed: a request whose cache fits only without it is admitted (beside
    other answers too) and the old conversation is dropped (no disk tier), where before it was
    parked beside the new prefill and two 1M caches filled the machine's DRAM."""
    from ktlong.kv.host_cache import cache_bytes_for

    st = started(lm, MODEL, mode="long_context", block_size=16, chunk_size=64, local_windows_len=64,
                 max_seq_len=1024, cache_min_tokens=64, max_num_seqs=4, max_new_tokens=4)
    app, _ = make_app(st)
    store, session = app.state.worker.store, st.session
    server = RunningServer(app)
    try:
        first = server.client().completions.create(model=MODEL, prompt="alpha beta gamma " * 150, max_tokens=4)
        assert first.usage.prompt_tokens > 400 and len(session.ids) > 400
        old = session.host.dram_bytes
        assert old > 0 and store.live is not None and not store.live.busy
        prompt = [7] * 500  # shares nothing with it
        need = cache_bytes_for(session.layout, 600)
        store.dram_limit = store._held() - old + need + 1000  # the new cache fits only in the old one's place
        assert store.admit(prompt, 600, alone=False)
        assert store._held() + need <= store.dram_limit
        assert session.ids == [] and store.listing() == []  # the old conversation is gone, nothing spilled
        store.prepare(prompt)
        assert store.live is not None and session.ids == []
    finally:
        server.stop()


def test_a_request_waits_while_its_decoders_anchors_do_not_fit_beside_the_running_answers(lm):
    """The device anchors of the decoders decoding together share one pool (ktlong/session/
    anchors_pool.py): with room for one conversation's at a time, the second request waits until
    the first answer ends (no step runs both), and both answers are what they are alone."""
    st, app, rows, server = counted_server(lm, block_scoring="device")
    session = st.session
    try:
        client = server.client()
        for i in range(2):  # two conversations' decoders, parked
            client.chat.completions.create(model=MODEL, messages=messages(i))
        reach = session.decoder.reach_tokens  # the last prompt and its answer: about as long as the first
        assert reach == len(session.ids) + 1 < 1024 and session.decoder.anchor_bytes == session.anchors.bytes_for(reach)
        session.anchors.pool_bytes = session.anchors.bytes_for(reach + reach // 2)  # one such conversation, not two
        rows.clear()
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda i: server.client().chat.completions.create(
                model=MODEL, messages=messages(i + 2)), range(2)))
        alone = [client.chat.completions.create(model=MODEL, messages=messages(i + 2)).choices[0].message.content
                 for i in range(2)]
        assert [o.choices[0].message.content for o in outs] == alone
        assert rows and max(rows) == 1  # never together: the second waited for the first's decoder to go
    finally:
        server.stop()


def test_a_long_step_beside_a_prefill_is_counted_by_its_largest_part():
    """The account's steps over 100 ms: each by the largest of the prefill thread's work, its waits,
    the parts of the step the worker tells apart, and the rest of the step; and the garbage
    collector's full passes while it ran."""
    from types import SimpleNamespace

    from ktlong.server.gc_passes import FullPasses
    from ktlong.server.worker import Prefilling

    gc.disable()  # only the pass the test makes
    passes = FullPasses()
    try:
        gc.collect()  # before it: not its
        p = Prefilling(None, SimpleNamespace(boundaries=7, work_seconds=1.0, wait_seconds=0.5), None, 0.0, 0.0,
                       passes, (passes.count, passes.seconds))
        gc.collect()  # while it prefills
        p.count(0.30, 0.05, 0.04, 0.01, {"the blocks its answers filled": 0.20, "its answers' tokens": 0.01})
        p.count(0.30, 0.25, 0.20, 0.05, {"the blocks its answers filled": 0.0, "its answers' tokens": 0.01})
        p.count(0.30, 0.05, 0.04, 0.00, {"a new batch's graphs": 0.10, "its answers' tokens": 0.01})  # 0.14 the rest
        p.count(0.09, 0.05, 0.05, 0.00, {"its answers' tokens": 0.01})  # under 100 ms
        assert p.long_steps == {"the blocks its answers filled": 1, "its thread's work": 1, "the step's own": 1}
        assert p.steps == 4 and abs(p.slice_seconds - 0.40) < 1e-9 and abs(p.step_seconds - 0.59) < 1e-9
        assert "; 3 over 100 ms, " in p.account() and "1 mostly the blocks its answers filled" in p.account()
        assert "; the garbage collector's full passes 1, " in p.account()
        # the parts told apart, summed over every step, the largest first
        assert ("beside 4 decode steps of 147.5 ms each (in all: the blocks its answers filled 0.20 s, a new batch's "
                "graphs 0.10 s, its answers' tokens 0.04 s), its slices 100.0 ms a step;") in p.account()
    finally:
        passes.close()
        gc.enable()
