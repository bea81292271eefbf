"""Every recorded data set declared once (dora_num.studies.datasets): committed, complete, its sidecars
naming today's producer, ``cli.RECORDERS`` (derived from them) and every notebook's ``requires`` held to it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dora_num.repro.paths import COMMITTED_DATA_DIR, NOTEBOOKS_DIR, REPO_ROOT, DataSet
from dora_num.studies import cli, datasets

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
SIDE = ".provenance.json"


@pytest.mark.parametrize("name", list(datasets.DATASETS))
def test_every_data_set_is_committed_with_sidecars_naming_its_producer(name):
    d = datasets.DATASETS[name]
    assert d.missing() == [] and len(d.require()) == len(d.files)
    for p in d.paths():
        side = json.loads((p.parent / (p.name + SIDE)).read_text())
        assert side["producer"] == d.producer, (p, side["producer"])


def test_the_table_holds_every_recorded_file_once():
    """Every file under data/ belongs to exactly one data set, except the notebooks' own outputs
    (data/NN_topic/, a notebook's artifacts) and the corpus (an input the package extracts)."""
    owners: dict[str, list[str]] = {}
    for d in datasets.DATASETS.values():
        for f in d.files:
            owners.setdefault(f, []).append(d.name)
    assert {f: n for f, n in owners.items() if len(n) > 1} == {}
    committed = {p.relative_to(COMMITTED_DATA_DIR).as_posix() for p in COMMITTED_DATA_DIR.rglob("*")
                 if p.is_file() and not p.name.endswith((SIDE, ".md"))}
    recorded = {f for f in committed
                if not f[:2].isdigit() and f.split("/")[0] not in datasets.NOT_RECORDED}
    assert sorted(recorded - set(owners)) == []
    assert sorted(set(owners) - committed) == []


def test_recorders_and_data_sets_name_each_other():
    """The registry is derived: every subcommand a data set names is declared by exactly one data set
    (its module and help), and its module is a recorder of the package."""
    import importlib.util

    record = [d for d in datasets.DATASETS.values() if d.kind == "record"]
    subcommands = {d.subcommand for d in record}
    assert sorted(subcommands - set(cli.RECORDERS)) == []
    assert sorted(set(cli.RECORDERS) - subcommands - set(cli.TOOLS)) == []
    for sub in subcommands:
        declaring = [d.name for d in record if d.subcommand == sub and d.about]
        assert len(declaring) == 1, (sub, declaring)
    assert all(not d.module or d.module == cli.RECORDERS[d.subcommand].module for d in record)
    assert all(importlib.util.find_spec(r.module) is not None for r in cli.RECORDERS.values())
    for d in datasets.DATASETS.values():
        assert d.recorder.split()[0] in d.how_to_record or d.kind == "notebook", d
        if d.kind == "script" and " -m dora_num." in d.recorder:  # a module of the package
            assert importlib.util.find_spec(d.recorder.split(" -m ")[1].split()[0]) is not None, d
        elif d.kind == "script":  # the device script exists (a data set whose recorder is gone is not declared)
            script = next(w for w in d.recorder.split() if w.startswith(".ci/"))
            assert (REPO_ROOT / script).is_file(), d


def test_how_to_record_follows_the_recorder():
    gpu = DataSet("x", ("gpu/x.csv",), recorder="exhaustive --only census")
    assert gpu.how_to_record == ("on the H200: dora-num record exhaustive --out DIR --only census; then here: "
                                 "dora-num record exhaustive --ingest DIR --git-sha SHA")
    assert gpu.producer == "dora-num record exhaustive"
    cpu = DataSet("y", ("exhaustive/y.csv",), recorder="sqrt-census", where="the CPU", ingest=False)
    assert cpu.how_to_record == "here (the CPU): dora-num record sqrt-census" and cpu.folder == "exhaustive"
    roles = DataSet("z", {"table": "gpu/z/t.csv", "log": "gpu/z/run.log"}, recorder="z")
    assert roles.files == ("gpu/z/t.csv", "gpu/z/run.log") and roles.roles == ("table", "log")
    assert roles.path("log") == COMMITTED_DATA_DIR / "gpu/z/run.log" and roles.filename("table") == "t.csv"
    assert roles.path("log", "/tmp/out") == Path("/tmp/out/run.log") and roles.relpath("table") == "t.csv"
    assert roles.subset("log").files == ("gpu/z/run.log",) and gpu.path() == COMMITTED_DATA_DIR / "gpu/x.csv"
    with pytest.raises(ValueError, match="no file 'zz'"):
        roles.subset("zz")
    with pytest.raises(ValueError, match="name one by its role"):
        roles.path()


def _reads(nb_path) -> dict[str, bool]:
    """The data sets a notebook asks for with ``ctx.recorded(...)`` (evaluated in the notebook's
    imports, at its parameters' defaults): name -> required in a full run."""
    book = json.loads(nb_path.read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    ns: dict = {}
    params = next(c for c in book["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    exec("".join(params["source"]), ns)
    for src in cells:
        for node in ast.parse(src).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and (
                    isinstance(node, ast.Import) or (node.module or "").startswith("dora_num")):
                exec(compile(ast.Module([node], []), nb_path.name, "exec"), ns)
    out: dict[str, bool] = {}
    for src in cells:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "recorded":
                kw = {k.arg: k.value for k in node.keywords}
                required = bool(eval(ast.unparse(kw["required"]), ns)) if "required" in kw else True
                for a in node.args:
                    a = a.value if isinstance(a, ast.Starred) else a
                    val = eval(ast.unparse(a), ns)
                    for item in (val if isinstance(val, tuple) else (val,)):
                        d = datasets.owner(item) if isinstance(item, str) else datasets.DATASETS[item.name]
                        assert d is not None, (nb_path.name, item)
                        out[d.name] = out.get(d.name, False) or required
    return out


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_requires_what_it_reads(nb):
    nn = nb.stem[:2]
    reads = _reads(nb)
    assert sorted(n for n, req in reads.items() if req) == sorted(
        d.name for d in datasets.DATASETS.values() if nn in d.notebooks)
    assert sorted(n for n, req in reads.items() if not req) == sorted(
        d.name for d in datasets.DATASETS.values() if nn in d.optional)
    assert json.loads(nb.read_text())["metadata"]["dora_num"]["requires"] == datasets.requires(nb.stem)
