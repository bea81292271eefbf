"""No import circle anywhere in ``dora_num``: every module's imports (at the top, inside functions and
methods, under ``try`` or ``if``) form a graph without a cycle, read from the source with ``ast``.

An edge ``a -> b`` is an import statement in ``a`` that runs module ``b``: ``import b``, ``from b
import name`` (``b`` a package: its ``__init__``), ``from pkg import b`` (``b`` a submodule).  Parent
packages are not edges (Python runs them first, and the package ``__init__`` files re-export their
children), and neither are imports under ``if TYPE_CHECKING:`` (never run) or ``importlib``
look-ups by a computed name (the CLI's recorder table, the package's lazy names).
A lazy import inside a function is an edge like any other: it hides a circle from the import
system, not from the reader, and each one has been a module in the wrong layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "dora_num"
ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """``{dotted name: path}`` of every module of ``package`` under ``root`` (``__init__`` as the package)."""
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the statements under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """``{imported module of the package: first line}`` for module ``name`` at ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = _type_checking_blocks(tree)
    out: dict[str, int] = {}

    def add(mod: str, line: int) -> None:
        if mod in modules and mod != name:
            out.setdefault(mod, line)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                add(sub if sub in modules else base, node.lineno)
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, int]]:
    modules = module_files(root, package)
    return {m: imports(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle ``[a, b, ..., a]`` of ``graph`` (depth-first, in sorted order), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert len(graph) > 50 and "dora_num.ops.norm" in graph  # the walk found the package
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail(f"import circle: {describe(cycle, graph)}")


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import f\n",
        "pkg/b.py": "def f():\n    from . import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.c": 2} and graph["pkg.d"] == {}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert describe(find_cycle(graph), graph).startswith("pkg.a (line 1) -> pkg.b (line 2)")


def test_subpackages_and_parents(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .sub.x import X\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/x.py": "from .. import y\nX = 1\n",  # y a submodule: no edge to pkg's __init__
        "pkg/y.py": "from .sub import x\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.sub.x": 1} and graph["pkg.sub.x"] == {"pkg.y": 1}
    assert find_cycle(graph) == ["pkg.sub.x", "pkg.y", "pkg.sub.x"]
