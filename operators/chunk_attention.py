"""Dense attention of one prefill chunk over a head-major KV history: torch or FlashInfer."""

from __future__ import annotations

import importlib.util

import torch

from operators.checks import expect

from operators.dense_attention import dense_attention


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    backend: str, window: int = 0) -> torch.Tensor:
    """q: [T, H, D]; k, v: [KV, N, D] head-major views (N >= T, the chunk is the last T keys).

    Returns [T, H, D]; causal, bottom-right aligned; with window > 0 each query sees only the
    last `window` keys up to itself.
    """
    expect("q", q, ndim=3)
    expect("k", k, ndim=3, dtype=q.dtype, device=q.device)
    expect("v", v, shape=tuple(k.shape), dtype=q.dtype, device=q.device)
    if k.shape[1] < q.shape[0] or q.shape[1] % k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be the last of the keys {tuple(k.shape)}, with whole kv groups")
    if backend == "torch":
        return dense_attention(q, k, v, scale, window)
    # fa3's single-request kernel dies (SIGFPE) on this strided HND view in FlashInfer 0.6.9:
    # full-history fa3 runs through the paged path (operators/flashinfer_paged.py), and the
    # windowed attention of sliding layers, which takes this path, runs on fa2.
    assert backend in ("fa2", "fa3"), backend
    backend = "fa2"
    import flashinfer

    # HND layout reads [KV, N, D]; the page tensor's head stride is honoured, so no copy.
    return flashinfer.single_prefill_with_kv_cache(
        q, k, v, causal=True, kv_layout="HND", sm_scale=scale, backend=backend,
        window_left=window - 1 if window else -1)
