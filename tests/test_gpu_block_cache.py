"""On the GPU: decode replayed from CUDA graphs with the block cache (the cached part captured
between segments) follows eager decode without it, bf16 and q8_0."""

import pytest
import torch

from ktlong.models.random_model import random_model
from tests.test_gpu_decode_graph import session

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_replayed_decode_with_the_block_cache_follows_eager_decode_without(kv_type):
    model = random_model("tiny", torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(7)).tolist()
    plain = session(model, False, kv_type, second_select_num=3, device_cache_blocks=0)
    # 2 slots for 3 selected blocks: the device attends to two, the CPU to the third
    cached = session(model, True, kv_type, second_select_num=3, device_cache_blocks=2)
    a, b = plain.prefill(ids), cached.prefill(ids)
    assert cached.decoder.cache is not None and len(cached.decoder.body.cached_graphs) == len(cached.decoder.global_layers)
    for i in range(100):  # past a window slide
        assert float((b - a).norm() / a.norm()) < 3e-2, i
        token = int(a.argmax())
        a, b = plain.step(token), cached.step(token)
    times = cached.decoder.times
    assert times.selected == plain.decoder.times.selected and 0 < times.cached < times.selected
