"""Shared fixtures: real packaged models and the transformers references, built once per session."""

import os
from contextlib import contextmanager
from functools import cache

import pytest

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # workers of `pytest -n 2` share the cores: a thread each (torch, Numba, and the processes the
    # tests start), where two threads each would contend for them
    import numba

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    numba.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on the CPU; it reads this once, when triton is
    # first imported, so it is set before any test imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _model_path(name):
    from ktlong.errors import ModelNotFoundError
    from ktlong.gguf.registry import resolve_model_path

    try:
        return resolve_model_path(name)
    except ModelNotFoundError as e:
        pytest.fail(str(e))  # a missing test model is a broken install, not a skip


@pytest.fixture(scope="session")
def smollm2_path():
    return _model_path("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_path():
    return _model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path():
    return _model_path("gemma3-270m")


@cache
def _loaded(name):
    from ktlong.models.loader import load_model

    return load_model(str(_model_path(name)))


@pytest.fixture(scope="session")
def real_model():
    """A packaged model's name -> its LoadedModel on the CPU, loaded once per test session.
    Tests must not change it."""
    return _loaded


_gguf_readers = {}  # path -> the gguf package's reader of a packaged model's file


@contextmanager
def _one_parse_per_file():
    """transformers parses a GGUF's metadata with the gguf package for the config, again for the
    weights and again for the tokenizer: 20 s each for a vocabulary of 150K to 260K tokens on the
    2-core machine. The packaged models' files are read-only, so while transformers loads one,
    each file is parsed once per test session and the reader shared."""
    import gguf

    real = gguf.GGUFReader

    def shared(path, mode="r"):
        if mode != "r":
            return real(path, mode)
        if str(path) not in _gguf_readers:
            _gguf_readers[str(path)] = real(path)
        return _gguf_readers[str(path)]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


@cache
def _hf_tokenizer(path):
    """transformers' tokenizer made from the GGUF file, as its converter makes it (half a minute
    for a large vocabulary), then saved, so that the test files of one run that each ask for it
    (in other worker processes too) load it from its tokenizer.json instead."""
    import os
    import shutil
    import tempfile

    import transformers
    from transformers import AutoTokenizer

    st = path.stat()  # the file and the converter that made it
    saved = os.path.join(tempfile.gettempdir(), "ktlong-tests-hf-tokenizers",
                         f"{path.name}-{st.st_size}-{st.st_mtime_ns}-{transformers.__version__}")
    if os.path.isfile(os.path.join(saved, "complete")):
        return AutoTokenizer.from_pretrained(saved)
    with _one_parse_per_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(saved))
    tokenizer.save_pretrained(partial)
    open(os.path.join(partial, "complete"), "w").close()
    try:
        os.rename(partial, saved)  # whole or not at all
    except OSError:  # another worker saved it first
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


@cache
def _hf_model(path):
    import torch
    from transformers import AutoModelForCausalLM

    with _one_parse_per_file():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    return _hf_tokenizer


@pytest.fixture(scope="session")
def hf_model():
    return _hf_model


@pytest.fixture
def piped_input(monkeypatch):
    """piped_input(lines): input() returns each line, then raises EOFError, as piped standard
    input ends."""
    def pipe(lines):
        remaining = iter(lines)

        def read(prompt=""):
            line = next(remaining, None)
            if line is None:
                raise EOFError
            return line

        monkeypatch.setattr("builtins.input", read)
    return pipe


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
