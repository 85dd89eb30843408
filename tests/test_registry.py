"""A model packaged in parts is joined into the cache once, whole and verified, beside other
processes doing the same."""

import errno
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ktlong.errors import ModelNotFoundError
from ktlong.gguf.registry import PackagedModel, _join_parts, cache_dir

ROOT = Path(__file__).resolve().parent.parent
PARTS = (b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 5)


def parts_model(tmp_path, monkeypatch, sha256: str) -> PackagedModel:
    """Two packages of one part each on the import path, and an empty cache folder."""
    for i, data in enumerate(PARTS):
        package = tmp_path / "site" / f"ktlong_test_part{i}"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "part.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return PackagedModel(name="parts", file_name="parts.gguf", install="pip install parts",
                         packages=("ktlong_test_part0", "ktlong_test_part1"), parts=("part.bin", "part.bin"),
                         sha256=sha256)


JOIN = """
import sys
from pathlib import Path
from ktlong.gguf import registry
package_file = registry._package_file  # the second part is read from a pipe: the join waits for it
registry._package_file = lambda model, package, part: (Path(sys.argv[2]) if package == "ktlong_test_part1"
                                                       else package_file(model, package, part))
model = registry.PackagedModel(name="parts", file_name="parts.gguf", install="pip install parts",
                               packages=("ktlong_test_part0", "ktlong_test_part1"), parts=("part.bin", "part.bin"),
                               sha256=sys.argv[1])
print(registry._join_parts(model))
"""


def test_two_processes_joining_at_once_both_publish_the_whole_file(tmp_path, monkeypatch):
    """One process is held half way (it reads its second part from a pipe no one has written yet)
    while another joins the same model and publishes it; the first then finishes and publishes too."""
    whole = b"".join(PARTS)
    digest = hashlib.sha256(whole).hexdigest()
    model = parts_model(tmp_path, monkeypatch, digest)
    fifo = tmp_path / "part1.pipe"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    first = subprocess.Popen([sys.executable, "-c", JOIN, digest, str(fifo)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not list(cache_dir().glob("*.partial")):  # it has written its first part
            assert first.poll() is None and time.time() < deadline, f"the first join ended ({first.poll()})"
            time.sleep(0.05)
        path = _join_parts(model)
        assert path.read_bytes() == whole
        while True:  # the pipe opens once the first join reads it
            try:
                pipe = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                assert e.errno == errno.ENXIO and first.poll() is None and time.time() < deadline, e
                time.sleep(0.05)
        os.write(pipe, PARTS[1])  # fits the pipe's buffer
        os.close(pipe)
        out, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 0, err
    assert out.strip() == str(path) and path.read_bytes() == whole
    assert [p.name for p in cache_dir().iterdir()] == ["parts.gguf"]


def test_parts_that_do_not_match_their_digest_publish_nothing(tmp_path, monkeypatch):
    model = parts_model(tmp_path, monkeypatch, "0" * 64)
    with pytest.raises(ModelNotFoundError, match="reinstall them: pip install parts"):
        _join_parts(model)
    assert list(cache_dir().iterdir()) == []
