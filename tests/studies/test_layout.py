"""Producers named as producers: in ``dora_num/studies`` only ``record_*.py`` / ``ingest_*.py`` modules
have a command line, put work on CUDA or write under ``data/``; each is a ``dora-num record`` subcommand
or imported by one; no reading module imports one; no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dora_num.repro.paths import REPO_ROOT
from dora_num.studies import cli
from test_imports import imports as module_imports  # tests/ is on the path, as for _report

STUDIES = REPO_ROOT / "dora_num" / "studies"
# The recorders' measurement toolkit (do_bench timing, the copy bandwidth, the allocator's peak): it
# synchronises and weighs CUDA work that producers start; only producers (and GPU tests) import it.
TOOLKIT = {"dora_num.studies.bench"}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(p): p for p in sorted(STUDIES.rglob("*.py"))}


def is_producer(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith(("record_", "ingest_"))


def imports(name: str) -> set[str]:
    """Every module of ``studies/`` that ``name`` imports, at the top or inside a function (the package-wide
    reader of tests/test_imports.py, which also holds the package to no import circle)."""
    return set(module_imports(name, MODULES[name], MODULES))


def cli_uses(src: str) -> list[str]:
    tree = ast.parse(src)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.name if isinstance(node, ast.Import) else node.module or "") == "argparse" for a in node.names):
            found.append(f"line {node.lineno}: imports argparse")
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "__name__":
            found.append(f"line {node.lineno}: a __main__ block")
    return found


def _cuda_literal(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] == "cuda"


def cuda_uses(src: str) -> list[str]:
    """Where ``src`` puts work on CUDA or asks the CUDA device: ``torch.cuda.*``, ``.cuda()``,
    ``device="cuda"`` in a call, ``torch.device("cuda")``."""
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            found.append(f"line {node.lineno}: torch.cuda")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "cuda":
                found.append(f"line {node.lineno}: .cuda()")
            if any(k.arg == "device" and _cuda_literal(k.value) for k in node.keywords):
                found.append(f"line {node.lineno}: device='cuda'")
            if isinstance(f, ast.Attribute) and f.attr == "device" and node.args and _cuda_literal(node.args[0]):
                found.append(f"line {node.lineno}: torch.device('cuda')")
    return found


def data_writes(src: str) -> list[str]:
    """Where ``src`` writes under ``data/``: ``data_dir(...)``, a data set's ``.dest()``, the ingest."""
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("data_dir", "dest", "ingest_folder") or (
                    name == "ingest" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and f.value.id in ("recording", "recorded")):
                found.append(f"line {node.lineno}: {name}(...)")
    return found


def test_the_rules_can_fail():
    assert sorted(cuda_uses("import torch\nx = torch.zeros(1, device='cuda:0')\ntorch.cuda.synchronize()\nx.cuda()\n")) \
        == ["line 2: device='cuda'", "line 3: torch.cuda", "line 4: .cuda()"]
    assert cuda_uses("def f(device: str = 'cuda'):\n    return device == 'cuda'\n") == []  # naming a device is no use
    assert cli_uses("import argparse\nif __name__ == '__main__':\n    pass\n") == [
        "line 1: imports argparse", "line 2: a __main__ block"]
    assert data_writes("p = data_dir('gpu')\nq = MEMORY.dest()\nrecording.ingest({}, p)\n") == [
        "line 1: data_dir(...)", "line 2: dest(...)", "line 3: ingest(...)"]


@pytest.mark.parametrize("name", [m for m in MODULES if not is_producer(m)])
def test_a_reading_module_has_no_cli_no_cuda_no_data_writes_and_imports_no_producer(name):
    src = MODULES[name].read_text()
    if name != "dora_num.studies.cli":  # the command itself
        assert cli_uses(src) == [], name
    if name not in TOOLKIT:
        assert cuda_uses(src) == [], name
    assert data_writes(src) == [], name
    assert sorted(m for m in imports(name) if is_producer(m)) == [], f"{name} imports a producer"


def test_the_toolkit_is_imported_by_producers_only():
    for name in MODULES:
        if TOOLKIT & imports(name):
            assert is_producer(name), f"{name} imports {TOOLKIT & imports(name)}"


def test_every_producer_is_a_subcommand_or_imported_by_one():
    modules = {r.module for r in cli.RECORDERS.values()}
    assert all(is_producer(m) and m in MODULES for m in modules), modules
    reached, todo = set(), list(modules)
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += [i for i in imports(m) if is_producer(i)]
    assert sorted(m for m in MODULES if is_producer(m) and m not in reached) == []


# The modules of studies/ that every folder may use: the input regimes and the recorders' toolkit. Every
# other top-level module (cli, datasets, record_suite, record_exhaustive) gathers the folders, so a folder
# importing it would point back up (the recorders' shared options live in dora_num.repro.recording).
SHARED = {"dora_num.studies.inputs", "dora_num.studies.bench"}


def test_no_study_folder_imports_a_module_that_gathers_the_folders():
    top = {m for m, p in MODULES.items() if p.parent == STUDIES} - {"dora_num.studies"}
    upward = {m: sorted(imports(m) & (top - SHARED)) for m, p in MODULES.items() if p.parent != STUDIES}
    assert {m: i for m, i in upward.items() if i} == {}


def test_every_notebook_has_one_study_folder_that_names_it():
    import importlib

    named = {}
    for d in sorted(p for p in STUDIES.iterdir() if (p / "__init__.py").is_file()):
        named.setdefault(importlib.import_module(f"dora_num.studies.{d.name}").NOTEBOOK, []).append(d.name)
    notebooks = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(named) == notebooks and all(len(v) == 1 for v in named.values()), named
