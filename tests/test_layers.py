"""The package's layers: each folder of ktlong/ imports only from layers below it (imports under
TYPE_CHECKING, which never run, are types only), and operators/ and cpu_ops/ import nothing of
ktlong. Read from the sources with ast, so that an import inside a function counts too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# lowest first; a unit is a folder of ktlong/ or a module at its top
LAYERS = [
    {"errors"},
    {"regular_file"},
    {"options"},
    {"config", "device", "parallel"},
    {"gguf"},
    {"kv"},
    {"models"},
    {"decode", "prefill"},
    {"session"},
    {"chat", "cli"},
    {"eval", "server", "perplexity", "config_command"},
    {"bench"},
]
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def imports(path: Path) -> list[str]:
    """The absolute module names a file imports, outside `if TYPE_CHECKING:` blocks (types only)
    and `if __name__ == "__main__":` blocks (a module's command, which sits above it)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and
               ("TYPE_CHECKING" in ast.unparse(node.test) or "__main__" in ast.unparse(node.test))
               for n in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def unit_of(path: Path) -> str:
    rel = path.relative_to(ROOT / "ktlong")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_unit_has_a_layer():
    units = {unit_of(p) for p in (ROOT / "ktlong").rglob("*.py") if unit_of(p) != "__init__"}
    assert units == set(LEVEL), f"add to LAYERS: {units - set(LEVEL)}; gone: {set(LEVEL) - units}"


def test_no_folder_imports_from_its_own_layer_or_above():
    upward = []
    for path in (ROOT / "ktlong").rglob("*.py"):
        src = unit_of(path)
        if src == "__init__":
            continue
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "ktlong" and len(parts) > 1 and parts[1] != src and LEVEL[parts[1]] >= LEVEL[src]:
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward


def test_operators_and_cpu_ops_import_nothing_of_ktlong():
    found = [f"{p.relative_to(ROOT)} imports {name}" for folder in ("operators", "cpu_ops")
             for p in (ROOT / folder).rglob("*.py") for name in imports(p) if name.split(".")[0] == "ktlong"]
    assert not found, found
