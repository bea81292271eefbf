"""An operator under test is varied through a seam, never by assigning another module's globals: no test
assigns (or monkeypatches) an attribute of a ``dora_num`` module.  The seams: ``check_bounds(...,
operators={name: fn})`` and ``check_bounds(..., accumulation=CardProbes(...))`` (the card, its records, the
accumulation probe) for the reviewer's kit, ``DoRALinear(..., norm=, compose_fn=)``, ``layer(x, g=)``,
``with override(...)`` (``ops/config.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def module_assignments(src: str) -> list[str]:
    """Where ``src`` assigns, deletes or monkeypatches an attribute of a ``dora_num`` module it imported
    (``dn.dense_row_norm = f``, ``monkeypatch.setattr(norm, "x", f)``, ``setattr(dn, ...)``,
    ``monkeypatch.setattr("dora_num.ops.norm.x", f)``)."""
    tree = ast.parse(src)
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "dora_num"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dora_num":
            mods |= {a.asname or a.name for a in node.names if a.name[:1].islower()}  # modules, functions: lower case

    def rooted(node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in mods

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [f"line {node.lineno}: {ast.unparse(t)}" for t in targets
                  if isinstance(t, ast.Attribute) and isinstance(t.value, (ast.Name, ast.Attribute)) and rooted(t.value)
                  and _is_module_attr(t.value, mods)]
        if isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr in ("setattr", "delattr"))
                or (isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"))):
            first = node.args[0]
            if (rooted(first) and _is_module_attr(first, mods)) or (
                    isinstance(first, ast.Constant) and str(first.value).startswith("dora_num")):
                found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def _is_module_attr(node, mods) -> bool:
    """``node`` names a module of the package (``dn``, ``dn.ops.norm``), not an object built from one: a bare
    imported name, or a chain of lower-case attributes off it."""
    while isinstance(node, ast.Attribute):
        if not node.attr.islower() or not node.attr.replace("_", "").isalnum():
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id in mods


def test_the_rule_can_fail():
    src = ("import dora_num as dn\nfrom dora_num.ops import norm\nfrom dora_num import DoRALinear\n"
           "dn.dense_row_norm = f\nnorm.ops_x = 1\nmonkeypatch.setattr(norm, 'f', g)\n"
           "monkeypatch.setattr('dora_num.ops.norm.f', g)\nsetattr(dn, 'f', g)\n"
           "layer = DoRALinear(1, 1, 1)\nlayer.scale = 2\nx.y = 3\n")
    assert module_assignments(src) == ["line 4: dn.dense_row_norm", "line 5: norm.ops_x",
                                       "line 6: monkeypatch.setattr(norm, 'f', g)",
                                       "line 7: monkeypatch.setattr('dora_num.ops.norm.f', g)",
                                       "line 8: setattr(dn, 'f', g)"]


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")), ids=lambda p: p.relative_to(TESTS).as_posix())
def test_no_test_assigns_a_module_attribute_of_the_package(path):
    assert module_assignments(path.read_text()) == [], f"{path.name}: use the operator's seam instead"
