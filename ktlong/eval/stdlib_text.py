"""Real text for question answering, from what ships with Python: the docstrings of the standard
library's functions and classes, read from its sources with `ast` (nothing is imported or run,
nothing is downloaded). A passage is one documented name with its docstring;
the corpus is the same for one Python version (its standard library's text), in a fixed order.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

MIN_WORDS = 12  # a first sentence that says enough to be asked about
MIN_NAME = 6
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Passage:
    module: str
    name: str  # the function or class, or a class's method as Class.method
    text: str  # its docstring, its whitespace collapsed
    first_sentence: str


def _first_sentence(text: str) -> str:
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return match.group(1) if match else text


def _passages_of(path: Path, module: str) -> list[Passage]:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return []
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    found = []
    nodes = [(node, node.name) for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    nodes += [(method, f"{node.name}.{method.name}") for node, _ in list(nodes) if isinstance(node, ast.ClassDef)
              for method in node.body if isinstance(method, ast.FunctionDef)]
    for node, name in nodes:
        doc = ast.get_docstring(node)
        if not doc or any(part.startswith("_") for part in name.split(".")):
            continue
        text = " ".join(doc.split())
        found.append(Passage(module, name, text, _first_sentence(text)))
    return found


@functools.cache
def passages() -> tuple[Passage, ...]:
    """Every documented public function, class and method of the standard library's pure-Python
    modules (tests and private modules left out), in path order."""
    root = Path(os.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part.startswith(("_", "test", "idlelib", "site-packages", "lib2to3")) for part in rel.parts):
            continue
        found += _passages_of(path, ".".join(rel.with_suffix("").parts))
    return tuple(found)


@functools.cache
def askable() -> tuple[int, ...]:
    """Indices of passages a question can be asked about: a first sentence of at least MIN_WORDS
    words that no other passage has and that does not say the passage's name, whose name is
    long enough (MIN_NAME letters) not to turn up by chance in an answer."""
    all_passages = passages()
    counts: dict[str, int] = {}
    for p in all_passages:
        counts[p.first_sentence] = counts.get(p.first_sentence, 0) + 1
    return tuple(i for i, p in enumerate(all_passages)
                 if len(p.first_sentence.split()) >= MIN_WORDS and counts[p.first_sentence] == 1
                 and p.name.split(".")[-1].lower() not in p.first_sentence.lower()
                 and len(p.name.split(".")[-1]) >= MIN_NAME)
