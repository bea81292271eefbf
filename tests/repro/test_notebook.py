"""``setup(name, globals())``: parameters declared once in the parameters cell, SMOKE values
beside them, and recorded data asked for in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (notebook tooling, absent on the GPU image)")

from dora_num.repro import notebook as N
from dora_num.repro import paths
from dora_num.repro.runner import list_notebooks

CELL = '''SMOKE: bool = False  # tiny sizes
N: int = 34000  # elements; smoke: 1000
SHAPE: list = [2048, 8192]  # the paper's shape; smoke: [64, 512]
NAME: str = "x"  # no smoke value
SEED: int = 3  # seed
'''


def test_parse_parameters_reads_names_defaults_and_smoke_values():
    ps = {p.name: p for p in N.parse_parameters(CELL)}
    assert list(ps) == ["SMOKE", "N", "SHAPE", "NAME", "SEED"]
    assert ps["N"].default == 34000 and ps["N"].has_smoke and ps["N"].smoke == 1000
    assert ps["SHAPE"].smoke == [64, 512] and not ps["NAME"].has_smoke


@pytest.mark.parametrize("bad, match", [
    ("N: int = 1 + 2  # computed", "not a literal"),
    ("N: int = 5  # smoke: five", "not a Python literal"),
    ("N: int = 5  # smoke: 5.0", "the smoke value of N is a float"),
    ("import os", "expected NAME"),
])
def test_parse_parameters_rejects_what_is_not_a_declaration(bad, match):
    with pytest.raises(ValueError, match=match):
        N.parse_parameters(bad)


def _notebook(folder, name, cell=CELL):
    nb = nbformat.v4.new_notebook()
    first = nbformat.v4.new_code_cell(cell)
    first.metadata["tags"] = ["parameters"]
    nb.cells = [first]
    nbformat.write(nb, folder / f"{name}.ipynb")


def test_setup_applies_smoke_values_unless_passed_explicitly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(paths.OUTPUT_ROOT_ENV, str(tmp_path / "out"))
    _notebook(tmp_path, "97_setup_selftest")
    ns = {}
    exec(CELL, ns)
    ns["SMOKE"] = True  # papermill's injected cell
    ns["SHAPE"] = [8, 8]  # passed explicitly: kept
    ctx = N.setup("97_setup_selftest", ns)
    assert ctx.smoke and ctx.seed == 3
    assert ns["N"] == 1000 and ns["SHAPE"] == [8, 8] and ns["NAME"] == "x"
    assert ctx.params == {"SMOKE": True, "N": 1000, "SHAPE": [8, 8], "NAME": "x", "SEED": 3}
    full = {}
    exec(CELL, full)
    assert N.setup("97_setup_selftest", full).params["N"] == 34000 and full["N"] == 34000


def test_setup_refuses_a_namespace_without_the_parameters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _notebook(tmp_path, "97_setup_selftest")
    with pytest.raises(NameError, match="not defined"):
        N.setup("97_setup_selftest", {"SMOKE": False})
    with pytest.raises(FileNotFoundError, match="96_absent"):
        N.setup("96_absent", {})


def test_recorded_names_the_missing_file_and_how_to_record_it(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.OUTPUT_ROOT_ENV, str(tmp_path))
    ctx = N.NotebookContext("97_x", smoke=False, seed=0)
    present = "gpu/device.json"
    assert ctx.recorded(present, how_to_record="record it") == [paths.committed_data("gpu", "device.json")]
    with pytest.raises(paths.RecordedDataMissing, match="no_such.csv.*record it with: run X"):
        ctx.recorded(present, "gpu/no_such.csv", how_to_record="run X")
    assert ctx.recorded("gpu/no_such.csv", how_to_record="run X", required=False) is None
    assert "no_such.csv" in ctx.skipped[-1]
    smoke = N.NotebookContext("97_x", smoke=True, seed=0)
    assert smoke.recorded("gpu/no_such.csv", how_to_record="run X", in_smoke=False) is None
    with pytest.raises(ValueError, match="how_to_record"):
        ctx.recorded(present)


@pytest.mark.parametrize("nb", list_notebooks(), ids=lambda p: p.stem)
def test_every_notebook_declares_its_parameters_once_and_its_recorded_inputs(nb):
    book = json.loads(nb.read_text())
    declared = [p.name for p in N.notebook_parameters(nb.stem)]
    assert declared[0] == "SMOKE"
    later = "\n".join("".join(c["source"]) for c in book["cells"][1:] if c["cell_type"] == "code")
    assert f'dn.setup("{nb.stem}", globals())' in later
    for name in declared:  # a parameter is never assigned again after the parameters cell
        assert f"\n{name} = " not in "\n" + later and f", {name} = " not in later, name
    requires = book["metadata"]["dora_num"]["requires"]
    assert all(r.startswith("data/") for r in requires), requires
    assert ("ctx.recorded(" in later) == bool(requires)
    # Every required file of a record that is committed is there (a typo or an incomplete record fails here); a
    # record not made yet (its folder absent altogether) means the full run waits for it: the runner skips the
    # notebook and names the missing files (tests/repro/test_runner.py).
    missing = [r for r in requires if not (paths.REPO_ROOT / r).is_file()]
    incomplete = [r for r in missing if (paths.REPO_ROOT / r).parent.exists()]
    assert not incomplete, f"required files missing from committed records: {incomplete}"
    if missing:
        pytest.skip(f"{nb.stem}: recorded inputs not committed yet, its full run waits for them: "
                    + ", ".join(sorted({str(Path(r).parent) for r in missing})))


def test_setup_writes_a_run_with_changed_parameters_under_build_and_says_where(tmp_path, monkeypatch, capsys):
    """Committed parameters: in place (as `make reproduce`); any parameter changed or SMOKE: under
    build/runs/, printed, so papermill -p never writes over the committed artifacts."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(paths.OUTPUT_ROOT_ENV, raising=False)
    _notebook(tmp_path, "97_setup_selftest")
    ns = {}
    exec(CELL, ns)
    ns["N"] = 7  # papermill -p N 7
    N.setup("97_setup_selftest", ns)
    root = paths.output_root()
    assert root.parent == paths.REPO_ROOT / "build" / "runs" and root.name.startswith("97_setup_selftest-")
    assert paths.data_dir("97_setup_selftest") == root / "data" / "97_setup_selftest"
    out = capsys.readouterr().out
    assert f"N=7; artifacts go to {root}/" in out and "committed data/ and figures/ are not touched" in out
    same = {}
    exec(CELL, same)
    N.setup("97_setup_selftest", same)  # the same kernel, the committed parameters again: in place
    assert paths.output_root() == paths.REPO_ROOT and capsys.readouterr().out == ""
    smoke = {}
    exec(CELL, smoke)
    smoke["SMOKE"] = True
    N.setup("97_setup_selftest", smoke)
    assert paths.output_root().parent == paths.REPO_ROOT / "build" / "runs" and "SMOKE=True" in capsys.readouterr().out
    monkeypatch.setenv(paths.OUTPUT_ROOT_ENV, str(tmp_path / "mine"))  # the caller's choice wins
    N.setup("97_setup_selftest", dict(ns))
    assert paths.output_root() == tmp_path / "mine" and capsys.readouterr().out == ""
    import shutil

    for d in (paths.REPO_ROOT / "build" / "runs").glob("97_setup_selftest-*"):
        shutil.rmtree(d)


def test_frontend_attached_outside_a_kernel_and_by_the_variable(monkeypatch):
    monkeypatch.delenv(N.WIDGETS_ENV, raising=False)
    assert N.frontend_attached() is False  # no kernel here (pytest)
    monkeypatch.setenv(N.WIDGETS_ENV, "1")
    assert N.frontend_attached() is True
    monkeypatch.setenv(N.WIDGETS_ENV, "yes")
    with pytest.raises(ValueError, match="DORA_NUM_WIDGETS must be 0 or 1"):
        N.frontend_attached()


def test_frontend_attached_in_a_kernel_follows_the_request(monkeypatch):
    """An interactive frontend's request (allow_stdin, as JupyterLab sends it) vs a headless one
    (nbclient/papermill send allow_stdin=False)."""
    from jupyter_client.manager import start_new_kernel

    monkeypatch.delenv(N.WIDGETS_ENV, raising=False)
    km, kc = start_new_kernel(kernel_name="dora-num", extra_arguments=["--IPKernelApp.log_level=ERROR"])
    try:
        seen = {}
        for allow in (True, False):
            out = []
            kc.execute_interactive("from dora_num.repro.notebook import frontend_attached\n"
                                   "print(frontend_attached())", allow_stdin=allow, timeout=120,
                                   output_hook=lambda m: out.append(m["content"].get("text", "")))
            seen[allow] = "".join(out).strip()
        assert seen == {True: "True", False: "False"}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
