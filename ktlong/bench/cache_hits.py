"""The server's cache of many documents, measured as a client sees it: the time to the first
token of a cache hit in DRAM against a cold prefill, a hit from disk after a restart, and the
answers against a server that prefills every prompt whole.

python -m ktlong.bench cache-hits --model GGUF [--docs 3] [--chars 520000] [--rounds 3]
                                  [--reference turns|whole|none] [--set key=value]

The documents are Python standard-library sources (the same on every machine with this Python),
--chars characters each, one sentence planted in the middle of each ("The secret code of
archive ALPHA is 5111."). A server (`python -m ktlong.server`, long-context mode, a cache folder
of its own, cache_dram_gb 16, 16 new tokens) is started in a process of its own and asked
through the official `openai` client at its defaults, streamed, greedy: each document once
(cold: nothing has tokenized it), then --rounds rounds of a new question about each in turn
(DRAM hits: the documents alternate). The server is restarted and asked once more about each
(disk hits). A fresh reference server with the same settings and no cache of other
conversations (cache_dram_gb 0, no cache_dir) answers the same questions:
- turns (the default): each document's questions one after another, so that each question
  reuses its own document's conversation, as a server that keeps one conversation does. The
  cached server's answers equal these only if swapping, spilling and restoring conversations
  changes no number.
- whole: in the cached server's order, so that every prompt is prefilled whole. A follow-up's
  prefill over a cached history sums in other chunks than one prefill of the whole prompt, and
  a greedy choice between two close logits can go the other way in bfloat16.
`--set prefill_attention=dense` compares dense runs. The table gives the time to the first content chunk, median and range, per phase; the lines under
it the ratio of medians, the disk load rate the server logs, and how many answers equal the
reference's word for word.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from ktlong.bench.common import median
from ktlong.cli import print_table
from ktlong.config import parse_set
from ktlong.errors import KtlongError

NAMES = ("ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT")
QUESTIONS = ["Tell me the secret code of archive {}.", "What is the secret code of archive {}?",
             "Please tell me the secret code of archive {}.", "Tell me the secret code of archive {}, please.",
             "What number is the secret code of archive {}?", "Which number is the secret code of archive {}?"]
STARTUP_SECONDS = 900  # a fresh machine compiles FlashInfer's kernels at the first start


def documents(count: int, chars: int) -> list[tuple[str, int, str]]:
    """(name, code, text) of each document: every count-th standard-library source, from the
    k-th, cut to chars characters, with its sentence planted in the middle. Past the six names,
    they repeat with a number (ALPHA-2, ...)."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    docs = []
    for k in range(count):
        text = "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files[k::count])[:chars]
        code = 4000 + 1111 * (k + 1)
        mid = len(text) // 2
        name = NAMES[k % len(NAMES)] + (f"-{k // len(NAMES) + 1}" if k >= len(NAMES) else "")
        docs.append((name, code, f"{text[:mid]}\n# The secret code of archive {name} is {code}.\n{text[mid:]}"))
    return docs


def served_model(name: str) -> str:
    """The GGUF file a bench's servers load (a path, or a packaged model's name), refused in one
    sentence before a server starts where there is none."""
    from ktlong.gguf.registry import resolve_model_path

    model = str(resolve_model_path(name))
    if not os.path.isfile(model):
        raise KtlongError(f"--model {name}: no such GGUF file; give a file, a packaged model's name, or random 8B "
                          f"weights written by `python -m ktlong.bench random-gguf --out r8b.gguf`.")
    return model


class Server:
    """`python -m ktlong.server` in a process of its own, its output in a log file."""

    def __init__(self, model: str, port: int, log_path: str, extra: list[str]):
        self.port, self.log_path = port, log_path
        cmd = [sys.executable, "-m", "ktlong.server", "--gguf_path", model, "--mode", "long_context",
               "--port", str(port), "--max_new_tokens", "16", *extra]
        try:
            self.log = open(log_path, "a")
        except OSError as e:
            raise KtlongError(f"Cannot write the server's log {log_path} ({e.strerror or e}); name another file.") from None
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + STARTUP_SECONDS
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise KtlongError(f"The server exited while starting ({self._last_line()}); its log is {log_path}.")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise KtlongError(f"The server did not start in {STARTUP_SECONDS} s; its log is {log_path}.")

    def lost(self, error: Exception) -> KtlongError:
        """What to say when a request to the running server failed: how, and whether the server
        is gone (a SIGKILL is most often the machine running out of memory)."""
        code = self.process.poll()
        if code is None:
            gone = "it is still running"
        elif code == -signal.SIGKILL:
            gone = "it was killed (SIGKILL: most often the machine ran out of memory)"
        else:
            gone = f"it exited with code {code} ({self._last_line()})"
        return KtlongError(f"A request to the server failed ({str(error)[:200] or type(error).__name__}); {gone}; "
                           f"its log is {self.log_path}.")

    def _last_line(self) -> str:
        lines = [line.strip() for line in open(self.log_path, errors="replace") if line.strip()]
        return lines[-1][:300] if lines else "no output"

    def stop(self):
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def ask(client, model_id: str, text: str, question: str) -> dict:
    """One streamed question: the time to the first content chunk, the answer, the cached
    tokens and where they came from."""
    start = time.perf_counter()
    messages = [{"role": "user", "content": text + "\n\n" + question}]
    stream = client.chat.completions.create(model=model_id, messages=messages, stream=True,
                                            stream_options={"include_usage": True}, temperature=0)
    ttft, parts, usage = None, [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                parts.append(choice.delta.content)
    details = usage.prompt_tokens_details
    return {"ttft": ttft, "answer": "".join(parts), "cached": details.cached_tokens,
            "from": (details.model_extra or {}).get("cached_from")}


def run_phase(server: Server, model_id: str, docs, rounds: list[int], tag: str, results: list,
              by_document: bool = False):
    """Each of rounds' questions about each document: round by round (the documents alternate),
    or by_document (each document's questions in a row)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")
    order = ([(doc, q) for doc in docs for q in rounds] if by_document else [(doc, q) for q in rounds for doc in docs])
    for (name, _, text), q in order:
        r = ask(client, model_id, text, QUESTIONS[q].format(name))
        results.append({"tag": tag, "doc": name, "q": q, **r})
        print(f"[{tag} {name} q{q}: {r['ttft']:.3f} s, {r['cached']:,} cached from {r['from']}: {r['answer']!r}]",
              file=sys.stderr, flush=True)


def summary(results: list[dict]) -> tuple[list[list], float]:
    """The table's rows (phase, requests, median and range of the time to the first token) and
    the ratio of the cold median to the DRAM hits' median."""
    phases = [("cold", lambda r: r["tag"] == "cached" and r["q"] == 0),
              ("DRAM hit", lambda r: r["tag"] == "cached" and r["q"] > 0 and r["from"] == "dram"),
              ("disk hit after restart", lambda r: r["tag"] == "restarted" and r["from"] == "disk"),
              ("reference (fresh server)", lambda r: r["tag"] == "reference")]
    rows, medians = [], {}
    for name, chosen in phases:
        times = [r["ttft"] for r in results if chosen(r)]
        if times:
            medians[name] = median(times)
            rows.append([name, len(times), f"{medians[name]:.3f}", f"{min(times):.3f}-{max(times):.3f}"])
    ratio = medians["cold"] / medians["DRAM hit"] if "DRAM hit" in medians and "cold" in medians else float("nan")
    return rows, ratio


def equal_answers(results: list[dict]) -> tuple[int, int]:
    """(answers of the cached server equal to the reference's for the same question, answers)."""
    reference = {(r["doc"], r["q"]): r["answer"] for r in results if r["tag"] == "reference"}
    mine = [r for r in results if r["tag"] != "reference" and (r["doc"], r["q"]) in reference]
    return sum(r["answer"] == reference[(r["doc"], r["q"])] for r in mine), len(mine)


def load_rates(log_path: str) -> list[str]:
    """What the server logged of each load from disk: '1.42 GiB in 0.18 s (7.97 GiB/s)'."""
    pattern = re.compile(r"loaded from disk: [\d,]+ tokens, (.+\))")
    return [m.group(1) for m in map(pattern.search, open(log_path, errors="replace")) if m]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench cache-hits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file or packaged model name")
    p.add_argument("--docs", type=int, default=3, help=f"documents, 2 to {len(NAMES)} (default 3)")
    p.add_argument("--chars", type=int, default=520_000, help="characters per document (default 520000)")
    p.add_argument("--rounds", type=int, default=3, help=f"rounds of DRAM hits, 1 to {len(QUESTIONS) - 2} (default 3)")
    p.add_argument("--reference", choices=["turns", "whole", "none"], default="turns",
                   help="how a fresh server with the same settings and no cache answers the same questions, to "
                        "compare: each document's in a row (turns), in the same order, every prompt prefilled "
                        "whole (whole), or not at all (default turns)")
    p.add_argument("--port", type=int, default=8101, help="the servers' port (default 8101)")
    p.add_argument("--set", action="append", default=[], metavar="key=value", help="an option for every server")
    args = p.parse_args(argv)
    if not 2 <= args.docs <= len(NAMES) or not 1 <= args.rounds <= len(QUESTIONS) - 2 or args.chars < 1000:
        raise KtlongError(f"--docs must be 2 to {len(NAMES)}, --rounds 1 to {len(QUESTIONS) - 2} and --chars at "
                          "least 1000.")
    parse_set(args.set)  # refused here in one sentence, before any server starts
    model = served_model(args.model)
    try:
        import openai
    except ImportError:
        raise KtlongError("The cache-hits bench asks through the official openai client; pip install openai.") from None
    model_id = os.path.basename(model).removesuffix(".gguf")
    options = [item for pair in (("--set", s) for s in args.set) for item in pair]
    docs, results = documents(args.docs, args.chars), []
    with tempfile.TemporaryDirectory(prefix="ktlong-cache-hits-") as folder:
        log = os.path.join(folder, "server.log")
        cache = ["--cache_dir", os.path.join(folder, "kv"), "--cache_dram_gb", "16", *options]
        for tag, rounds, extra in (("cached", list(range(args.rounds + 1)), cache),
                                   ("restarted", [args.rounds + 1], cache),
                                   ("reference", list(range(args.rounds + 2)), ["--cache_dram_gb", "0", *options])):
            if tag == "reference" and args.reference == "none":
                continue
            server = Server(model, args.port, log, extra)
            try:
                run_phase(server, model_id, docs, rounds, tag, results,
                          by_document=tag == "reference" and args.reference == "turns")
            except openai.OpenAIError as e:
                raise server.lost(e) from None
            finally:
                server.stop()
        rates = load_rates(log)
    rows, ratio = summary(results)
    print(f"{args.docs} documents of {args.chars:,} characters, {model_id}, {' '.join(args.set) or 'defaults'}; "
          "time to the first token, seconds")
    print_table(["phase", "requests", "median", "range"], rows)
    print(f"DRAM hit vs cold: {ratio:.1f}x; disk loads: {', '.join(rates) or 'none'}")
    if args.reference != "none":
        same, total = equal_answers(results)
        print(f"answers equal to a fresh server's without a cache ({args.reference}): {same} of {total}")
    return 0
