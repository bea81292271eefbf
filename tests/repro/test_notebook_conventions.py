"""Papermill conventions: every parameter is listed by ``papermill --help-notebook`` with
its type and help; notebooks name the project kernel."""

import ast

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (notebook tooling, absent on the GPU image)")
papermill = pytest.importorskip("papermill", reason="papermill not installed (notebook tooling, absent on the GPU image)")

from dora_num.repro.kernel import KERNELSPEC
from dora_num.repro.runner import list_notebooks

NOTEBOOKS = list_notebooks()


def _parameters_cell(nb):
    return next(c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_help_notebook_lists_every_parameter(path):
    nb = nbformat.read(path, as_version=4)
    tree = ast.parse(_parameters_cell(nb).source)
    declared = [n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)]
    untyped = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
    assert not untyped, f"parameters without a type annotation: {untyped}"
    listed = papermill.inspect_notebook(str(path))
    assert list(listed) == declared, "papermill drops a parameter: a comment may not contain '='"
    for name, p in listed.items():
        assert p["inferred_type_name"] not in ("None", ""), name
        assert p["help"], f"{name} has no help comment"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_names_the_project_kernel(path):
    assert nbformat.read(path, as_version=4).metadata["kernelspec"] == KERNELSPEC
