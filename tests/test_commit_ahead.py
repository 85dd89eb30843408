"""A prefill's DRAM is committed a layer ahead of it on a helper thread (ktlong/kv/commit_ahead.py):
the prefill's own thread grows no table, each global layer grows once, whole, before the prefill
writes it, the helper keeps at most one layer ahead, and what it raises reaches the prefill."""

import threading
import time

import numpy as np
import pytest
import torch

from ktlong.errors import KtlongError
from ktlong.kv.commit_ahead import DEPTH, CommitAhead
from ktlong.kv.host_cache import HostKVCache, reserved_blocks
from ktlong.kv.layout import kv_layout
from ktlong.prefill import LayerMajorPrefill
from tests.tiny_gguf import TinySpec, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m"), TinySpec(num_layers=3), seed=11)


def test_the_prefills_thread_grows_no_table_and_each_layer_grows_once_whole(tiny, monkeypatch):
    c = tiny.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 16, 4096, "fp32")
    grown, written = [], []  # (layer, blocks, thread) per growth; (layer, committed then) per chunk written
    grow, offload = HostKVCache._grow, LayerMajorPrefill._offload

    def recording_grow(self, layer, blocks, pace):
        grown.append((layer, blocks, threading.current_thread().name))
        time.sleep(0.02)  # a slow commit: the prefill must still wait for it
        grow(self, layer, blocks, pace)

    def recording_offload(self, layer, q, s, e, run):
        written.append((layer, e, run.host.committed[layer]))
        return offload(self, layer, q, s, e, run)

    monkeypatch.setattr(HostKVCache, "_grow", recording_grow)
    monkeypatch.setattr(LayerMajorPrefill, "_offload", recording_offload)
    ids = list(np.random.default_rng(0).integers(0, 300, size=700))
    host = HostKVCache(layout, pin=False)
    engine = LayerMajorPrefill(tiny.model, layout, 64, "torch", hidden_on_device=True)
    logits, _ = engine.run(ids, host)
    whole = reserved_blocks(layout, 700, 0, 700)
    assert sorted((layer, blocks) for layer, blocks, _ in grown) == [(layer, whole) for layer in range(c.num_layers)]
    assert {name for _, _, name in grown} == {"ktlong-commit"}
    assert len(written) == c.num_layers * 11  # 11 chunks of 64 a layer
    assert all(committed * 16 >= 700 for _, _, committed in written)  # whole before the first chunk was written
    assert not any(t.name == "ktlong-commit" for t in threading.enumerate())
    # and the cache is the one a prefill that grew it itself wrote
    monkeypatch.setattr(HostKVCache, "_grow", grow)
    other = HostKVCache(layout, pin=False)
    again, _ = LayerMajorPrefill(tiny.model, layout, 64, "torch", hidden_on_device=True).run(ids, other)
    torch.testing.assert_close(logits, again, rtol=0, atol=0)
    for layer in range(c.num_layers):
        assert torch.equal(host.k[layer][:, :44], other.k[layer][:, :44])
        assert torch.equal(host.v[layer][:, :44], other.v[layer][:, :44])


class FakeHost:
    """A cache of `layers` global layers whose reserve records which layer the prefill was in."""

    def __init__(self, layers: int, fail_at: int | None = None):
        self.committed = {layer: 0 for layer in range(layers)}
        self.layout = type("Layout", (), {"block_size": 16})()
        self.prefill_in, self.calls, self.fail_at = 0, [], fail_at

    def reserve(self, tokens, layers, ahead=None, pace=None):
        (layer,) = layers
        self.calls.append((layer, self.prefill_in))
        if layer == self.fail_at:
            raise KtlongError("could not page-lock 2.2 GiB of DRAM for the KV cache; lower max_seq_len.")
        time.sleep(0.005)
        self.committed[layer] = -(-tokens // 16)


def test_the_helper_keeps_at_most_one_layer_ahead_of_the_prefill():
    host = FakeHost(8)
    with CommitAhead(host, 1000) as ahead:
        for layer in range(8):
            host.prefill_in = layer
            ahead.wait(layer)
            assert host.committed[layer] == 63
            time.sleep(0.02)  # the layer's work: the helper could run far ahead meanwhile
    assert [layer for layer, _ in host.calls] == list(range(8))
    assert all(layer <= prefill_in + DEPTH for layer, prefill_in in host.calls), host.calls
    assert any(layer == prefill_in + DEPTH for layer, prefill_in in host.calls)  # it does go ahead


def test_what_the_helper_raises_reaches_the_prefill_and_close_stops_it():
    host = FakeHost(6, fail_at=2)
    ahead = CommitAhead(host, 1000)
    ahead.wait(0)
    ahead.wait(1)
    with pytest.raises(KtlongError, match="lower max_seq_len"):
        ahead.wait(2)
    ahead.close()
    assert [layer for layer, _ in host.calls] == [0, 1, 2]
    host = FakeHost(6)  # a prefill stopped after its first layer: nothing more is committed
    ahead = CommitAhead(host, 1000)
    ahead.wait(0)
    ahead.close()
    assert not ahead._thread.is_alive() and [layer for layer, _ in host.calls] == [0, 1]


def test_nothing_to_commit_starts_no_thread():
    host = FakeHost(3)
    host.committed = {layer: 63 for layer in range(3)}
    with CommitAhead(host, 1000) as ahead:
        assert ahead._thread is None
        ahead.wait(1)
    assert host.calls == []
