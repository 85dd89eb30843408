"""Several clients at once against the server, as they see it: total decode speed, time to the
first token and time between tokens, for each number of concurrent clients.

python -m ktlong.bench serve --model GGUF [--clients 1,2,4,8] [--chars 20000] [--tokens 64]
                             [--long_chars 0] [--shared_document] [--set key=value]

For 8B shapes without an 8B model: `python -m ktlong.bench random-gguf --out r8b.gguf` writes
random weights with a byte-level tokenizer (a character a token), then `--model r8b.gguf`.

A server (`python -m ktlong.server`, long-context mode, max_num_seqs the largest --clients, one
more with --long_chars, cache_dram_gb 1024 (every idle conversation kept while DRAM allows: eight
of 128K hold 73 GiB) and cache_min_tokens 64 unless --set gives them) runs in a process of its own
and is asked through the official `openai` client, streamed, greedy, on `/v1/completions`. Each
client has a document of its own (Python standard-library sources, --chars characters; a
continuation of source code rarely ends early). Every document is first sent alone with max_tokens
1 (cold: its prefill; the column "cold TTFT"), so that the measured requests find their
conversations in the cache and decode together from their first steps. Then, for each count N, N
clients ask at once for --tokens tokens each: the total decode speed is every client's tokens
after its first, over the time from the first client's first token to the last client's last; the
time between tokens pools every client's gaps between streamed chunks. With --long_chars, one more
row: N clients decoding while another client sends a new document of that many characters (its
prefill runs in slices between their steps): its time to the first token beside the same request
alone (compared without the time that one waited in the queue while the first one's DRAM was
freed, which the server's log gives), and the others' time between tokens while it prefills (they
ask for up to 8,192 tokens and leave when its first token comes; the summary says how many were
still decoding then). With --shared_document, every client asks about one document (a line of its
own after it): the document alone is the cold request, and the clients that join one that is
answering share its blocks in DRAM ("prompts cached from": each request's
usage.prompt_tokens_details.cached_from). The column "DRAM GiB" is the KV caches the server holds
after the row, as its /metrics counts them (shared blocks once).
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import tempfile
import threading
import time
from collections import Counter

from ktlong.bench.cache_hits import Server, documents, served_model
from ktlong.bench.common import median
from ktlong.cli import in_range, print_table
from ktlong.config import parse_set
from ktlong.errors import KtlongError

MAX_CLIENTS = 64
# what each client asks for in the --long_chars row, leaving when the new document's first token
# comes: enough to decode through a 1M prefill beside four clients, and bounded, since a new
# document that waits for DRAM waits for their answers to end
BESIDE_TOKENS = 8192


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (share 0.5: the median's upper neighbour, 0.99: the 99th)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(share * len(ordered) + 0.999999) - 1))] if ordered else float("nan")


def stream(client, model_id: str, prompt: str, tokens: int, on_first=lambda: None,
           until: threading.Event | None = None) -> dict:
    """One streamed completion -> its start, the time of each content chunk and its token count;
    on_first() once its first chunk came; until: the client leaves (closes the stream, which
    cancels the answer) at the first chunk after it is set."""
    start, times, usage, left = time.perf_counter(), [], None, False
    chunks = client.completions.create(model=model_id, prompt=prompt, max_tokens=tokens, stream=True,
                                       temperature=0, stream_options={"include_usage": True})
    for chunk in chunks:
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            if len(times) == 1:
                on_first()
        if until is not None and until.is_set():
            chunks.close()
            usage, left = None, True  # the chunks counted instead, and its cache's source unreported
            break
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"start": start, "times": times, "tokens": usage.completion_tokens if usage else len(times),
            "finished": not left,
            "from": (details.model_extra or {}).get("cached_from") if details is not None else None}


def together(client, model_id: str, prompts: list[str], tokens: int, beside=None) -> tuple[list[dict], dict | None]:
    """Every prompt at once, a thread each; beside: (prompt, tokens) sent once all of them stream,
    and the others leave when its first token comes (they decode while it prefills)."""
    results: list[dict | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    streaming = threading.Semaphore(0)
    came = threading.Event() if beside is not None else None

    def run(i):
        try:
            results[i] = stream(client, model_id, prompts[i], tokens, streaming.release, came)
        except BaseException as e:  # reported once the others are done
            errors.append(e)
            streaming.release()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    extra = None
    try:
        if beside is not None:
            for _ in threads:
                streaming.acquire()
            if not errors:
                extra = stream(client, model_id, *beside, on_first=came.set)
    finally:  # the others leave, whatever became of it
        if came is not None:
            came.set()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]  # the caller says what became of the server
    return results, extra


def dram_gib(port: int) -> str:
    """The server's KV caches in DRAM, from /metrics (GiB)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith('ktlong_kv_cache_bytes{tier="dram"}'):
            return f"{float(line.split()[-1]) / 2**30:.2f}"
    return "-"


def row(n: int, results: list[dict], first_rate: float | None, cold: float) -> list:
    first = min(r["times"][0] for r in results if r["times"])
    last = max(r["times"][-1] for r in results if r["times"])
    decoded = sum(max(r["tokens"] - 1, 0) for r in results)
    rate = decoded / (last - first) if last > first else float("nan")
    gaps = [(b - a) * 1000 for r in results for a, b in zip(r["times"], r["times"][1:])]
    ttft = median([r["times"][0] - r["start"] for r in results if r["times"]])
    sources = Counter(r["from"] or ("none" if r["finished"] else "unreported") for r in results)
    return [n, f"{rate:.1f}", f"{rate / n:.1f}", f"{rate / first_rate:.2f}x" if first_rate else "1.00x", f"{ttft:.3f}",
            f"{cold:.2f}", f"{percentile(gaps, 0.5):.1f}", f"{percentile(gaps, 0.99):.1f}",
            " ".join(f"{k} {v}" for k, v in sorted(sources.items()))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file or packaged model name")
    p.add_argument("--clients", default="1,2,4,8", help="concurrent clients per row, comma-separated (default 1,2,4,8)")
    p.add_argument("--chars", type=int, default=20_000, help="characters of each client's document (default 20000)")
    p.add_argument("--tokens", type=int, default=64, help="tokens each client asks for (default 64)")
    p.add_argument("--long_chars", type=int, default=0,
                   help="characters of a new document sent while the largest count of clients decodes (default 0: "
                        "no such row)")
    p.add_argument("--shared_document", action="store_true",
                   help="every client asks about one document of --chars characters, each with a line of its own")
    p.add_argument("--port", type=int, default=8102, help="the server's port (default 8102)")
    p.add_argument("--server_log", default="", help="keep the server's log in this file (default: a temporary one); "
                                                     "it has a line for each answer: its cache, prefill and first token")
    p.add_argument("--set", action="append", default=[], metavar="key=value", help="an option for the server")
    args = p.parse_args(argv)
    try:
        counts = sorted({int(c) for c in args.clients.split(",")})
    except ValueError:
        raise KtlongError("--clients takes counts separated by commas, such as 1,2,4,8.") from None
    if not counts or counts[0] < 1 or counts[-1] > MAX_CLIENTS:
        raise KtlongError(f"--clients counts must be 1 to {MAX_CLIENTS}.")
    if args.chars < 1000 or args.long_chars < 0:
        raise KtlongError("--chars must be at least 1000 and --long_chars at least 0.")
    in_range("--tokens", args.tokens, 2, BESIDE_TOKENS, "the tokens each client asks for")
    given = parse_set(args.set)  # refused here in one sentence, before the server starts
    if "max_num_seqs" in given or "mode" in given:
        raise KtlongError("The serve bench sets mode and max_num_seqs itself (from --clients); drop them "
                          "from --set.")
    model = served_model(args.model)
    try:
        import openai
    except ImportError:
        raise KtlongError("The serve bench asks through the official openai client; pip install openai.") from None
    model_id = os.path.basename(model).removesuffix(".gguf")
    docs = [text for _, _, text in documents(counts[-1] + 1, args.chars)]
    if args.shared_document:  # the first document, a line of each client's own after it
        docs = [docs[0]] + [f"{docs[0]}\n# Client {i} reads on from here.\n" for i in range(counts[-1])]
    seqs = counts[-1] + (1 if args.long_chars else 0)  # the new document runs beside the decoding clients
    options = ["--max_num_seqs", str(seqs), *([] if "cache_dram_gb" in given else ["--cache_dram_gb", "1024"]),
               *([] if "cache_min_tokens" in given else ["--set", "cache_min_tokens=64"]),
               *[item for s in args.set for item in ("--set", s)]]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ktlong-serve-") as folder:
        server = Server(model, args.port, args.server_log or os.path.join(folder, "server.log"), options)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", timeout=3600,
                                   max_retries=0)
            prompts = docs[1:] if args.shared_document else docs[:counts[-1]]
            cold = []
            for prompt in docs[:1] if args.shared_document else prompts:  # prefilled alone, then kept
                r = stream(client, model_id, prompt, 1)
                cold.append(r["times"][0] - r["start"] if r["times"] else float("nan"))
            one = None
            for n in counts:
                results, _ = together(client, model_id, prompts[:n], args.tokens)
                rows.append(row(n, results, one, median(cold[:n])) + [dram_gib(args.port)])
                one = one or float(rows[-1][1])
                print(f"[{n} clients: {rows[-1][1]} tok/s]", file=sys.stderr, flush=True)
            if args.long_chars:
                long_doc = documents(counts[-1] + 2, args.long_chars)[-1][2]
                results, extra = together(client, model_id, prompts, BESIDE_TOKENS, (long_doc, 1))
                rows.append(row(counts[-1], results, one, float("nan")) + [dram_gib(args.port)])
                rows[-1][0] = f"{counts[-1]} + a new {args.long_chars:,}-char document"
                beside = extra["times"][0] - extra["start"]
                through = sum(bool(r["times"]) and r["times"][-1] >= extra["times"][0] for r in results)
                alone = stream(client, model_id, "Again.\n" + long_doc, 1)
                alone_ttft = alone["times"][0] - alone["start"]
        except (openai.OpenAIError, OSError) as e:  # a client's request, or /metrics
            raise server.lost(e) from None
        finally:
            server.stop()
        account = beside_account(server.log_path) if args.long_chars else ""
        queued = alone_queued(server.log_path) if args.long_chars else 0.0
    which = "one shared document" if args.shared_document else "each client's document"
    print(f"{model_id}, {' '.join(args.set) or 'defaults'}; {which} {args.chars:,} characters, "
          f"{args.tokens} tokens asked; max_num_seqs {seqs}")
    print_table(["clients", "total decode tok/s", "per client", f"vs {counts[0]}", "TTFT s (cache hit)",
                 "cold TTFT s", "between tokens p50 ms", "p99 ms", "prompts cached from", "DRAM GiB"], rows)
    if args.long_chars:
        print(f"the new document's time to the first token: {beside:.2f} s beside {counts[-1]} decoding clients, "
              f"{alone_ttft:.2f} s alone, {queued:.2f} s of it in the queue while the first one's DRAM was freed "
              f"({beside / (alone_ttft - queued):.2f}x of the rest); {through} of the {counts[-1]} clients decoded "
              f"until it came")
        if account:
            print(f"the server's log of its prefill: {account}")
    return 0


def _answer_lines(log_path: str) -> list[str]:
    try:
        with open(log_path, errors="replace") as f:
            return [line.strip() for line in f if line.startswith("[answer: ")]
    except OSError:
        return []


def _prompt_tokens(line: str) -> int:
    words = line.split(" prompt tokens")[0].split()
    return int(words[-1].replace(",", "")) if words and words[-1].replace(",", "").isdigit() else -1


def beside_account(log_path: str) -> str:
    """The server's line for the longest prompt's prefill that ran beside decoding answers (its
    steps, their time and its slices', its decoder's setup: ktlong/server/worker.py), or "" if
    none. The longest: the clients' own answers end after it, and their prompts prefilled beside
    each other too."""
    lines = [line for line in _answer_lines(log_path) if " decode steps of " in line]
    return max(reversed(lines), key=_prompt_tokens) if lines else ""


def alone_queued(log_path: str) -> float:
    """Seconds the last prefill of the longest prompt with nothing beside it waited in the queue
    (the new document sent again alone: it waits while the first one's DRAM is freed); 0 if the
    log has none."""
    lines = [line for line in _answer_lines(log_path) if " decode steps of " not in line]
    if not lines:
        return 0.0
    line = max(reversed(lines), key=_prompt_tokens)
    words = line.split(" queued ")
    try:
        return float(words[1].split(" s")[0]) if len(words) > 1 else 0.0
    except ValueError:
        return 0.0
