"""cpu_stored_weights: a CPU in one process keeps each matrix of a type with a Numba kernel as
the GGUF stores it (ktlong/gguf/stored_matrix.py); with float32 inputs to its products the
model's outputs are the dequantised model's within float32 summation, q and k rows reordered as
the loader reorders them. (Where the machine has AVX2 a few rows go in rounded to 8 bits:
test_gguf_matmul.py's test_stored_matrix_products bounds that rounding.)"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from dataclasses import fields

from cpu_ops import int8_runs
from ktlong.gguf.dequant import dequantize
from ktlong.gguf.held_bytes import held_bytes
from ktlong.gguf.model_config import ModelConfig
from ktlong.gguf.reader import GGUFFile
from ktlong.gguf.stored_matrix import StoredMatrix
from ktlong.gguf.stored_rows import StoredRows
from ktlong.gguf.model_config import unpermute_qk
from ktlong.gguf.weights import CpuWeights, load_weights
from ktlong.kv.dense_cache import DenseKVCache
from ktlong.models.llama import LlamaModel, linear
from tests.tiny_gguf import TinySpec, write_tiny_gguf

# the types the gguf package quantises (the kernels of the K types are tested in test_gguf_matmul.py)
TYPES = {"blk.0.ffn_up.weight": T.Q4_0, "blk.0.ffn_down.weight": T.Q5_0, "blk.0.attn_q.weight": T.Q4_1,
         "blk.0.attn_k.weight": T.Q5_1, "blk.1.attn_output.weight": T.F16}


@pytest.fixture
def float32_inputs(monkeypatch):
    """Products in place take float32 inputs, as on a machine without AVX2."""
    monkeypatch.setattr(int8_runs, "AVAILABLE", False)


def _load(path, cpu, shard=None):
    gf = GGUFFile(path)
    config = ModelConfig.from_gguf(gf)
    return config, load_weights(gf, config, torch.device("cpu"), torch.float32, shard, cpu)


@pytest.mark.parametrize("tied", [False, True])
def test_stored_model_gives_the_dequantised_models_logits(tmp_path, tied, float32_inputs):
    spec = TinySpec(hidden=256, intermediate=256, num_heads=4, head_dim=64, tied=tied)
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=4, tensor_types=TYPES)
    config, stored = _load(tmp_path / "m.gguf", CpuWeights(stored=True))
    _, plain = _load(tmp_path / "m.gguf", CpuWeights())
    layer0, layer1 = stored.layers
    assert isinstance(layer0.w_up, StoredMatrix) and isinstance(layer1.w_gate, StoredMatrix)  # Q8_0
    assert isinstance(layer1.wo, torch.Tensor)  # F16 has no kernel: dequantised
    # layer 1's q, k, v (gate, up) share Q8_0: one matrix each, multiplied once; layer 0's do not
    assert layer1.wqkv is not None and layer1.w_gate_up is not None and layer1.wv.blocks.ctypes.data > layer1.wq.blocks.ctypes.data
    assert layer0.wqkv is None and layer0.w_gate_up is None
    assert isinstance(stored.output, StoredMatrix) and isinstance(stored.embed, StoredRows)
    ids = torch.tensor([5, 17, 250, 3, 99, 42])
    outs = []
    for weights in (stored, plain):
        cache = DenseKVCache(config.num_layers, config.num_kv_heads, config.head_dim, 8, torch.device("cpu"), torch.float32)
        model = LlamaModel(config, weights)
        prefill = model.forward(ids[:-1], cache, 0)  # 5 rows: in place
        step = model.forward(ids[-1:], cache, 5)
        outs.append(torch.cat([prefill, step]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not int8_runs.AVAILABLE, reason="no AVX2: every product takes float32 inputs")
@pytest.mark.parametrize("tied", [False, True])
def test_a_prompts_logits_stay_float32_where_products_go_in_8_bits(tmp_path, tied):
    """Where products take 8-bit inputs, the output head takes a prompt's in float32
    (ktlong/gguf/stored_matrix.py): torch's logits of a row and the CPU engine's are the
    dequantised head's product to float32 sums; a decode step's (decoding) are within the
    rounding's bound, and not float32's."""
    from ktlong.models.cpu_llama import CpuLlama

    spec = TinySpec(hidden=256, intermediate=256, num_heads=4, head_dim=64, tied=tied)
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=4)  # Q8_0 throughout
    config, stored = _load(tmp_path / "m.gguf", CpuWeights(stored=True))
    gf = GGUFFile(tmp_path / "m.gguf")
    name = "token_embd.weight" if tied else "output.weight"
    head = dequantize(torch.from_numpy(np.array(gf.raw(name))), gf.tensors[name].ggml_type,
                      gf.tensors[name].shape).double()
    h = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    normed = (h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
              * stored.output_norm.double())
    exact = normed @ head.T
    bound = 1e-5 * (normed.abs() @ head.abs().T) + 1e-6
    model = LlamaModel(config, stored)
    for logits in (model.logits(h), torch.from_numpy(CpuLlama.from_gguf(gf, config).logits(normed.float().numpy()))):
        assert ((logits.double() - exact).abs() <= bound).all()
    half_step = normed.abs().reshape(1, -1, 32).amax(2) / 254  # an input's rounding, at most
    rounding = torch.einsum("mr,orj->mo", half_step, head.abs().reshape(head.shape[0], -1, 32))
    step = model.logits(h, decoding=True).double()
    assert ((step - exact).abs() <= 1.0001 * rounding + bound).all() and not ((step - exact).abs() <= bound).all()
    x = h.numpy()  # the layers' products round: not float32's
    assert not np.allclose(stored.layers[0].wo.product(x, eight_bit=True), x @ stored.layers[0].wo.float32().T,
                           rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int8_runs.AVAILABLE, reason="no AVX2: every product takes float32 inputs")
def test_a_prompts_rows_however_few_take_float32_inputs(tmp_path, monkeypatch):
    """A follow-up of a few tokens (the server's second asking of a question: its last token
    alone) is a prompt: both engines' layers take its rows in float32, its logits those of a
    machine without AVX2 to the bit; a decode step's rows go in 8 bits (not float32's). With
    8-bit layers SmolLM2-135M's answer to a question asked again turned from "The" to "L'"."""
    from ktlong.models.cpu_llama import CpuLlama
    from ktlong.kv.word_cache import WordCache

    write_tiny_gguf(tmp_path / "m.gguf", TinySpec(hidden=256, intermediate=256, num_heads=4, head_dim=64), seed=4)
    config, stored = _load(tmp_path / "m.gguf", CpuWeights(stored=True))
    model, cpu = LlamaModel(config, stored), CpuLlama.from_gguf(GGUFFile(tmp_path / "m.gguf"), config)
    ids = [5, 17, 250, 3, 99, 42]

    def run(int8: bool) -> list:
        monkeypatch.setattr(int8_runs, "AVAILABLE", int8)
        out = []
        for decoding in (False, True):
            cache = DenseKVCache(config.num_layers, config.num_kv_heads, config.head_dim, 8, torch.device("cpu"),
                                 torch.float32)
            model.forward(torch.tensor(ids[:4]), cache, 0)
            out.append(model.forward(torch.tensor(ids[4:]), cache, 4, decoding=decoding))  # 2 rows: in place
        words = WordCache.zeros(config.num_layers, config.num_kv_heads, config.head_dim, 8)
        cpu.forward(ids[:4], words, 0)
        out.append(torch.from_numpy(cpu.forward(ids[4:], words, 4)))
        return out

    (prompt, step, engine), (prompt32, step32, engine32) = run(True), run(False)
    assert torch.equal(prompt, prompt32) and torch.equal(engine, engine32)
    assert not torch.equal(step, step32)


def test_q_and_k_rows_reorder_as_stored_bytes(tmp_path, float32_inputs):
    """The loader undoes llama.cpp's q/k row permutation on the stored rows: the product is the
    unreordered matrix's product, reordered, to the bit."""
    raw = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (64, 4 * 20), dtype=np.uint8))
    raw.view(64, 4, 20)[:, :, :4] = torch.tensor([0, 0x20, 0, 0x24], dtype=torch.uint8)  # d, m: small normal halves
    plain = StoredMatrix(raw.numpy(), T.Q4_1, (64, 128))
    reordered = StoredMatrix(np.ascontiguousarray(unpermute_qk(raw.numpy(), 4)), T.Q4_1, (64, 128))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    assert torch.equal(linear(x, reordered), unpermute_qk(linear(x, plain).t(), 4).t())
    w = dequantize(raw.reshape(-1), T.Q4_1, (64, 128))
    torch.testing.assert_close(linear(x, plain), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_a_ranks_share_and_the_option_off_are_dequantised(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", TinySpec(num_layers=2), seed=1, tensor_types=TYPES)
    _, shared = _load(tmp_path / "m.gguf", CpuWeights(stored=True), (0, 2))
    _, off = _load(tmp_path / "m.gguf", CpuWeights())
    for weights in (shared, off):
        assert isinstance(weights.layers[0].w_up, torch.Tensor) and isinstance(weights.output, torch.Tensor)


def _bytes_in_memory(weights) -> int:
    """What loaded weights hold, by their memory: the union of the address ranges of every
    tensor's storage and stored array (views of one buffer, such as fused q/k/v, counted once)."""
    spans = []

    def add(x):
        if isinstance(x, torch.Tensor):
            start = x.untyped_storage().data_ptr()
            spans.append((start, start + x.untyped_storage().nbytes()))
        elif isinstance(x, StoredMatrix):
            assert x.blocks.flags.c_contiguous
            spans.append((x.blocks.ctypes.data, x.blocks.ctypes.data + x.blocks.nbytes))
        elif isinstance(x, StoredRows):
            add(x.rows)

    for layer in weights.layers:
        for f in fields(layer):
            add(getattr(layer, f.name))
    for x in (weights.embed, weights.output, weights.output_norm, weights.rope_freq_factors):
        add(x)
    total, end = 0, 0
    for lo, hi in sorted(spans):
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("stored,shard", [(True, None), (False, None), (True, (1, 2))])
def test_the_plans_weight_bytes_are_what_the_loaded_weights_hold(tmp_path, tied, stored, shard):
    """held_bytes, from the file's header alone, is the memory the loaded weights take: stored
    matrices and a row-read embedding at the file's bytes, F16 and the rest in float32, a rank's
    share where sharded."""
    spec = TinySpec(hidden=256, intermediate=256, num_heads=4, head_dim=64, tied=tied)
    write_tiny_gguf(tmp_path / "m.gguf", spec, seed=4, tensor_types=TYPES)
    config, weights = _load(tmp_path / "m.gguf", CpuWeights(stored=stored), shard)
    world = shard[1] if shard else 1
    planned = held_bytes(GGUFFile(tmp_path / "m.gguf"), config, 4, world, compact=True, stored=stored)
    assert planned == _bytes_in_memory(weights)


@pytest.mark.slow
def test_smollm2_stored_answers_as_with_float_weights(float32_inputs):
    """SmolLM2-135M (Q4_1 layers, a Q8_0 tied embedding read in place as its head): the logits of
    a prompt are the dequantised model's within float32 summation, the same token first."""
    from ktlong.models.loader import load_model

    logits = []
    for cpu in (CpuWeights(), CpuWeights(stored=True)):
        lm = load_model("smollm2-135m", "cpu", torch.float32, cpu=cpu)
        ids = torch.tensor(lm.tokenizer.encode("The capital of France is"))
        c = lm.config
        cache = DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), torch.device("cpu"), torch.float32)
        logits.append(lm.model.forward(ids, cache, 0, last_only=True)[0])
    assert isinstance(lm.model.weights.layers[0].wq, StoredMatrix)
    assert int(logits[0].argmax()) == int(logits[1].argmax())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-3, atol=1e-3)
