"""The package's layers: every import (inside functions too) goes downward, as the contracts
of ``[tool.importlinter]`` in pyproject.toml say (checked with import-linter); no import
cycles at module level, and the library never imports the applications (``qkv.apps``) when
it is imported."""

import ast
import os
from pathlib import Path

import pytest

import qkv

ROOT = Path(qkv.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, name: str) -> set[str]:
    """qkv modules imported when ``name`` is imported (not inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in tree.body:  # module level only: imports inside functions are lazy by design
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {
        name: {m for m in _top_level_imports(path, name) if m in files and m != name}
        for name, path in files.items()
    }


def test_graph_sees_the_package():
    g = _graph()
    assert "qkv.functional" in g and "qkv.apps.cli" in g
    assert "qkv.functional" in g["qkv.attention"]  # the parser finds real edges


def test_no_import_cycles():
    g = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(g[n]):
            if state.get(m) == 1:
                cycles.append([*path[path.index(m) :], m])
            elif m not in state:
                visit(m, [*path, m])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    # a package importing its own submodules (qkv.x -> qkv.x.y -> qkv.x) is how packages work:
    # a cycle that stays inside one of its members' package, whichever member it starts at
    def inside_one_package(c: list[str]) -> bool:
        return any(all(m == p or m.startswith(p + ".") for m in c) for p in c)

    real = [c for c in cycles if not inside_one_package(c)]
    assert real == []


def test_library_does_not_import_the_apps():
    g = _graph()
    bad = {n: sorted(m for m in deps if m.startswith("qkv.apps")) for n, deps in g.items()}
    assert {
        n: d for n, d in bad.items() if d and not n.startswith(("qkv.apps", "qkv.__main__"))
    } == {}


def test_imports_follow_the_layers(capsys):
    """import-linter over the whole import graph (function-level imports included): a new
    upward import (or one of the core modules importing an application dependency) fails
    here, naming the import and its line."""
    cli = pytest.importorskip("importlinter.cli", reason="import-linter (the dev extra)")
    config = ROOT.parents[1] / "pyproject.toml"
    if not config.exists():
        pytest.skip("no source checkout (installed package)")
    old = os.getcwd()
    os.chdir(ROOT.parent)  # the package's parent directory: import-linter finds qkv there
    try:
        code = cli.lint_imports(config_filenames=(str(config),), no_cache=True)
    finally:
        os.chdir(old)
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    assert "qkv's layers import only downward KEPT" in out, out[-2000:]
