"""On the GPU, as the chat and the server run it (CUDA graphs, the device selecting and reading
q8_0 blocks from DRAM): a saved cache loaded into a fresh session answers as the session that
saved it, bit for bit, for the follow-up's prefill and the decode steps after it."""

import pytest
import torch

from ktlong.models.loader import load_model
from ktlong.session.saved_cache import fingerprint, load_cache, save_cache
from tests.http_server import started
from tests.tiny_gguf import TinySpec, write_tiny_gguf

pytestmark = pytest.mark.gpu

TURNS = [("what is in the document?", "a passkey")]


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("kv_type", ["q8_0", "bf16"])
def test_a_loaded_cache_continues_as_the_saved_session_on_the_gpu(tmp_path, monkeypatch, kv_type):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=2, hidden=256, intermediate=512, head_dim=64, context=4096), seed=3)
    lm = load_model(str(path), "cuda", torch.bfloat16)
    # 1,600 tokens in blocks of 64 past a window of 256: 4 selected blocks of about 21 are sparse
    options = dict(mode="long_context", block_size=64, chunk_size=256, local_windows_len=256, kv_type=kv_type,
                   second_select_num=4, preselect_block_count=4, max_seq_len=4096)
    saved = started(lm, path, **options)
    session = saved.session
    assert session.use_cuda_graph
    session.prefill(tokens(1600, 1))
    for t in (4, 5, 6):
        session.step(t)
    fp = fingerprint(path, session, saved.config)
    file = tmp_path / "doc.kv"
    save_cache(file, session, fp, TURNS)

    fresh = started(lm, path, **options).session
    assert load_cache(file, fresh, fp) == TURNS
    assert fresh.ids == session.ids and fresh.host.num_tokens == 1603
    follow = session.ids + tokens(100, 2)
    a, b = session.prefill(follow), fresh.prefill(follow)
    assert fresh.last_prefill_tokens == 100  # only the new tokens
    assert torch.equal(a, b)
    for t in (9, 10, 11, 12):
        assert torch.equal(session.step(t), fresh.step(t))
    decoder = fresh.decoder
    assert decoder.selection is not None and decoder.times.device_read > 0  # the device selected and read
