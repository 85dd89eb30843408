"""On the GPU: FlashInfer chunk attention over head-major pages and the offloading prefill
agree with the torch reference within bf16 noise."""

from collections import Counter

import pytest
import torch

from ktlong.kv.host_cache import HostKVCache
from ktlong.kv.layout import kv_layout
from ktlong.prefill import LayerMajorPrefill
from ktlong.models.random_model import random_model
from operators.chunk_attention import chunk_attention, flashinfer_available
from operators.dense_attention import dense_attention

pytestmark = pytest.mark.gpu


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.skipif(not flashinfer_available(), reason="FlashInfer is not installed")
@pytest.mark.parametrize("backend", ["fa2"])
@pytest.mark.parametrize("num_q,num_k", [(128, 128), (256, 1000), (1, 777)])
def test_flashinfer_on_strided_head_major_view_equals_reference(backend, num_q, num_k):
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = torch.randn(8, 2048, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(8, 2048, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(num_q, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = pages[:, :num_k], values[:, :num_k]  # strided: head stride is 2048 * 128
    got = chunk_attention(q, k, v, 128 ** -0.5, backend)
    expected = dense_attention(q.double(), k.double(), v.double(), 128 ** -0.5)
    assert rel(got, expected) < 2e-2


def run_prefill(model, ids, backend, hidden_on_device, chunk=512):
    c = model.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, len(ids), "bf16")
    host = HostKVCache(layout, pin=True)
    logits, stats = LayerMajorPrefill(model, layout, chunk, backend, hidden_on_device).run(ids, host)
    return logits, host, stats


def test_gpu_prefill_matches_float32_cpu_reference():
    ids = torch.randint(0, 1000, (1500,), generator=torch.Generator().manual_seed(1)).tolist()
    gpu_model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    cpu_model = random_model("tiny", torch.device("cuda"), torch.float32)
    for name in ("embed", "output", "output_norm"):
        setattr(cpu_model.weights, name, getattr(gpu_model.weights, name).float().cpu())
    for lw_cpu, lw_gpu in zip(cpu_model.weights.layers, gpu_model.weights.layers):
        for f in lw_cpu.__slots__:
            t = getattr(lw_gpu, f)
            setattr(lw_cpu, f, None if t is None else t.float().cpu())
    cpu_model.device, cpu_model.inv_freq = torch.device("cpu"), cpu_model.inv_freq.cpu()
    expected, _, _ = run_prefill(cpu_model, ids, "torch", True)
    backends = ["torch"] + (["fa2", "fa3"] if flashinfer_available() else [])
    for backend in backends:
        for on_device in (True, False):
            logits, host, stats = run_prefill(gpu_model, ids, backend, on_device)
            assert rel(logits.cpu(), expected) < 3e-2, (backend, on_device)
            assert host.num_tokens == 1500 and stats.bytes_to_host > 0
            if not on_device:
                assert stats.bytes_to_device == 2 * 1500 * 256 * 2  # hidden in, per layer


def triton_builds() -> dict[str, int]:
    """How many compiled variants each of the prefill's Triton kernels holds in this process."""
    import triton

    import operators.block_summary_kernel as summary
    import operators.observation_kernel as observation
    import operators.rms_norm_kernel as rms
    import operators.rope_kernel as rope
    import operators.topk_selection_kernel as topk

    counts = {}
    for module in (summary, observation, rms, rope, topk):
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                counts[f"{module.__name__}.{name}"] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return counts


def test_warm_up_builds_every_triton_variant_a_prefill_uses():
    """A prompt of any length after LayerMajorPrefill.warm_up compiles no Triton kernel inside
    the timed prefill: the kernels do not specialize on lengths (a fresh machine's first prompt
    otherwise pays each build, ~0.4 s apiece, inside its time to first token)."""
    from ktlong.prefill import resolve_backend
    from tests.settings import compact_settings

    model = random_model("tiny", torch.device("cuda"), torch.bfloat16, seed=4)
    c = model.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, 6000, "bf16", anchor_type="DYNAMIC",
                       anchor_num=1)
    backend = resolve_backend("auto", model.device, c.head_dim, torch.bfloat16)
    engine = LayerMajorPrefill(model, layout, 1024, backend, True, compact_settings(keep_blocks=4))
    host = HostKVCache(layout, pin=True)
    engine.warm_up(host)
    built = triton_builds()
    for length in (5001, 3333):  # lengths the warm-up never saw, not multiples of 16
        engine.run(torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(length)).tolist(), host)
        host.reset()
    assert triton_builds() == built


@pytest.mark.parametrize("hidden_on_device", [True, False])
def test_short_follow_ups_through_chunk_graphs_equal_eager_ones(hidden_on_device):
    """Follow-ups of a few tokens, their projections and MLP replayed from the chunk graphs
    (ktlong/models/chunk_graphs.py), give the logits and DRAM rows of the same follow-ups run
    eagerly: at the buckets' edges, past the last bucket (eager there too), and a short one after
    longer ones left their rows in the buckets."""
    from tests.settings import gpu_backend

    model = random_model("tiny", torch.device("cuda"), torch.bfloat16, seed=5)
    c = model.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1400, "bf16")
    engines = [LayerMajorPrefill(model, layout, 256, gpu_backend(model), hidden_on_device, use_cuda_graph=graphs)
               for graphs in (False, True)]
    assert engines[0].graphs is None and engines[1].graphs is not None
    engines[1].graphs.capture()
    g = torch.Generator().manual_seed(6)
    doc = torch.randint(0, 1000, (700,), generator=g).tolist()
    hosts = [HostKVCache(layout, pin=True) for _ in engines]
    for engine, host in zip(engines, hosts):
        engine.run(doc, host)
    for n in (1, 9, 16, 17, 40, 64, 65, 3):
        new = torch.randint(0, 1000, (n,), generator=g).tolist()
        results = []
        for engine, host in zip(engines, hosts):
            host.truncate(len(doc))
            logits, _ = engine.run(new, host, history=len(doc))
            rows = [host.tokens(layer, which, len(doc), len(doc) + n).clone()
                    for layer in range(c.num_layers) for which in "kv"]
            results.append((logits, rows))
        (eager, eager_rows), (graphed, graphed_rows) = results
        assert rel(graphed, eager) < 1e-2, n
        for a, b in zip(graphed_rows, eager_rows):
            assert rel(a, b) < 1e-2, n


def test_hidden_states_in_dram_are_locked_for_the_call_only_and_a_stop_leaves_nothing_in_flight():
    """Hidden states in DRAM (a prompt too long for the device's room) give the logits and rows
    of hidden states on the device, exactly; they are page-locked for the call, a chunk's at a
    time at its own size (torch's pinned allocator is not used: it would round up and keep them)
    and unlocked so, a boundary after each, and a prefill stopped mid-way leaves the engine and a
    new cache whole."""
    from ktlong.errors import Cancelled
    from ktlong.kv import pinned
    from tests.settings import gpu_backend

    model = random_model("tiny", torch.device("cuda"), torch.bfloat16, seed=7)
    c = model.config
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1400, "bf16")
    doc = torch.randint(0, 1000, (900,), generator=torch.Generator().manual_seed(8)).tolist()
    results = []
    for on_device in (True, False):
        engine = LayerMajorPrefill(model, layout, 256, gpu_backend(model), on_device)
        host = HostKVCache(layout, pin=True)
        before = torch.cuda.host_memory_stats().get("allocated_bytes.all.peak", 0)
        locked = []
        lock = pinned.pin_in_place
        pinned.pin_in_place = lambda t: (locked.append(t.numel() * t.element_size()), lock(t))[1]
        try:
            logits, _ = engine.run(doc, host)
        finally:
            pinned.pin_in_place = lock
        # torch's pinned allocator never held them (whatever small buffers it holds for others)
        assert torch.cuda.host_memory_stats().get("allocated_bytes.all.peak", 0) - before < 900 * c.hidden_size * 2
        if not on_device:
            rows = [256, 256, 256, 132]  # the hidden states: each chunk's at its own size
            assert not Counter(n * c.hidden_size * 2 for n in rows) - Counter(locked)

            class Seen(list):  # the engine's progress: a boundary after each chunk's rows are made, then
                def update(self, n):  # each chunk, and after each chunk's rows are unlocked at the end
                    self.append(n)

                def pace(self):
                    self.append("unlocked")

            seen = Seen()
            assert torch.equal(engine.run(doc, HostKVCache(layout, pin=True), seen)[0], logits)
            assert seen == [0] * 4 + rows * c.num_layers + ["unlocked"] * 4
            stops = iter(range(5))

            class StopSoon:  # the engine's progress: a stop after a few chunks
                def update(self, n):
                    if next(stops) == 4:
                        raise Cancelled

                def pace(self):
                    pass

            stopped = HostKVCache(layout, pin=True)
            with pytest.raises(Cancelled):
                engine.run(doc, stopped, StopSoon())
            stopped.reset()
            logits_again, _ = engine.run(doc, stopped)
            assert torch.equal(logits_again, logits)
        rows = [host.tokens(layer, which, 0, 900).clone() for layer in range(c.num_layers) for which in "kv"]
        results.append((logits, rows))
    (device_logits, device_rows), (dram_logits, dram_rows) = results
    assert torch.equal(dram_logits, device_logits)
    assert all(torch.equal(a, b) for a, b in zip(dram_rows, device_rows))


@pytest.mark.skipif(not flashinfer_available(), reason="FlashInfer is not installed")
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_dense_attention_in_short_launches_equals_one_launch_a_chunk(backend, monkeypatch):
    """A chunk's dense attention in pieces of its queries (short_launches, LAUNCH_PAIRS made
    small: the paged route fa3 takes, the plain kernel fa2's) equals one launch a chunk within
    bf16 noise, and the same cache; a boundary between two pieces."""
    import ktlong.prefill as prefill_module

    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    c = model.config
    monkeypatch.setattr(prefill_module, "LAUNCH_PAIRS", 256 * 1500 * c.num_heads)
    ids = torch.randint(0, 1000, (1500,), generator=torch.Generator().manual_seed(3)).tolist()
    layout = kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, 128, len(ids), "bf16")
    paces, out = [], []
    for short in (False, True):
        progress = type("P", (), {"update": lambda self, n: None, "pace": lambda self: paces.append(short)})()
        host = HostKVCache(layout, pin=True)
        prefill = LayerMajorPrefill(model, layout, 512, backend, True)
        prefill.sms = 1  # a wave of one program: the tiny model's chunks go in pieces of a tile or more
        logits, _ = prefill.run(ids, host, progress, short_launches=short)
        out.append((logits, host.k[0].clone()))
    assert rel(out[1][0], out[0][0]) < 1e-2 and torch.equal(out[0][1], out[1][1])
    # chunks (0,512) (512,1024) (1024,1500): 512*512, 512*1024, 476*1500 rows x keys against
    # 256*1500: 1 piece, then pieces of the most whole tiles of 128 rows within it against all
    # keys of the chunk (2 against 1,024 or 1,500 keys: 256 rows, the last shorter)
    assert [prefill_module.launch_pieces(s, e, c.num_heads, prefill_module.LAUNCH_PAIRS, 128)
            for s, e in ((512, 1024), (1024, 1500))] == [[(512, 768), (768, 1024)], [(1024, 1280), (1280, 1500)]]
    assert paces == [True] * 2 * c.num_layers  # a boundary between two pieces
