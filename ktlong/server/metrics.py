"""The server's Prometheus metrics (prometheus_client, a registry of the app's own), served at
/metrics in the text exposition format: what an operator watches on a long-context server."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# time to first token of a long prompt runs from milliseconds (a cache hit) to minutes (1M tokens)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int], dram_bytes: Callable[[], int],
                 disk_bytes: Callable[[], int]):
        """queue_depth: requests waiting; running: requests prefilling or decoding; dram_bytes, disk_bytes: bytes of KV cache the server
        holds in DRAM (the session's and the conversations kept) and in its cache folder."""
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("ktlong_time_to_first_token_seconds", "Time from a request's start of prefill "
                              "to its first token", buckets=TTFT_BUCKETS, registry=r)
        self.prefill_rate = Gauge("ktlong_prefill_tokens_per_second", "Prefill speed of the last request "
                                  "that prefilled tokens", registry=r)
        self.decode_rate = Gauge("ktlong_decode_tokens_per_second", "Decode speed of the last request that "
                                 "decoded more than one token", registry=r)
        self.prompt_tokens = Counter("ktlong_prompt_tokens", "Prompt tokens, by where their K/V came from: "
                                     "prefilled now, or cached from an earlier request (kept by the session, "
                                     "in DRAM or on disk)", ["source"], registry=r)
        self.completion_tokens = Counter("ktlong_completion_tokens", "Tokens generated", registry=r)
        self.requests = Counter("ktlong_requests", "Requests, by how they ended", ["result"], registry=r)
        self.density = Gauge("ktlong_compact_density", "Fraction of history blocks CompactAttention kept in "
                             "the last long-context prefill (1 when it ran dense)", registry=r)
        Gauge("ktlong_queue_depth", "Requests waiting to start", registry=r).set_function(queue_depth)
        Gauge("ktlong_running", "Requests prefilling or decoding (up to max_num_seqs decode together)",
              registry=r).set_function(running)
        held = Gauge("ktlong_kv_cache_bytes", "Bytes of KV cache the server holds, by tier", ["tier"], registry=r)
        held.labels("dram").set_function(dram_bytes)
        held.labels("disk").set_function(disk_bytes)

    def finished(self, prefilled: int, cached: int, cached_from: str | None, generated: int, prefill_seconds: float,
                 decode_seconds: float, density: float | None):
        """A request's figures, once its answer is done."""
        self.prompt_tokens.labels("prefilled").inc(prefilled)
        if cached:
            self.prompt_tokens.labels(cached_from).inc(cached)
        self.completion_tokens.inc(generated)
        if generated:
            self.ttft.observe(prefill_seconds)
        if prefilled and prefill_seconds > 0:
            self.prefill_rate.set(prefilled / prefill_seconds)
        if generated > 1 and decode_seconds > 0:
            self.decode_rate.set((generated - 1) / decode_seconds)
        if density is not None:
            self.density.set(density)

    def render(self) -> bytes:
        return generate_latest(self.registry)
