"""Every recorded data set declared once (dora_num.studies.datasets): committed, complete, its sidecars
naming today's producer, ``cli.RECORDERS`` and every notebook's ``requires`` held to it, and no declared
file's name typed outside its declaration."""

from __future__ import annotations

import ast
import json
import re
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


def registry_problems(table, registry, tools=()) -> list[str]:
    """What the data sets ``table`` and the recorder registry ``registry`` disagree on: a subcommand no data
    set declares (``module=``, ``about=``) or more than one does, a recorder of no data set (``tools``
    aside), a data set naming another module than its subcommand's, a module that is not there."""
    import importlib.util

    record = [d for d in table if d.kind == "record"]
    subcommands = {d.subcommand for d in record}
    found = [f"{s}: named by a data set, declared by none (module=, about=)"
             for s in sorted(subcommands - set(registry))]
    found += [f"{s}: a recorder of no data set" for s in sorted(set(registry) - subcommands - set(tools))]
    for sub in sorted(subcommands):
        declaring = [d.name for d in record if d.subcommand == sub and d.about]
        found += [f"{sub}: declared by {declaring}, not by exactly one data set"] if len(declaring) > 1 else []
    found += [f"{d.name}: module {d.module} is not its recorder's" for d in record
              if d.module and d.subcommand in registry and d.module != registry[d.subcommand].module]
    return found + [f"{s}: no module {r.module}" for s, r in registry.items()
                    if importlib.util.find_spec(r.module) is None]


def test_recorders_and_data_sets_name_each_other():
    """The registry is derived: every subcommand a data set names is declared by exactly one data set
    (its module and help), and its module is a recorder of the package."""
    import importlib.util

    assert registry_problems([*datasets.DATASETS.values(), *datasets.UNRECORDED.values()], cli.RECORDERS,
                             cli.TOOLS) == []
    for d in datasets.DATASETS.values():
        assert d.recorder.split()[0] in d.how_to_record or d.kind == "notebook", d
        if d.kind == "script" and " -m dora_num." in d.recorder:  # a module of the package
            assert importlib.util.find_spec(d.recorder.split(" -m ")[1].split()[0]) is not None, d
        elif d.kind == "script":  # the device script exists (a data set whose recorder is gone is not declared)
            script = next(w for w in d.recorder.split() if w.startswith(".ci/"))
            assert (REPO_ROOT / script).is_file(), d


def test_an_unrecorded_data_set_is_not_committed():
    """A data set declared before its first recording (a study folder's ``UNRECORDED``) has its recorder
    registered and none of its files under data/: once they are committed it moves into ``DATASETS`` (and the
    first test above then holds it to its sidecars)."""
    for name, d in datasets.UNRECORDED.items():
        assert name not in datasets.DATASETS and d.kind == "record" and d.subcommand in cli.RECORDERS, d
        assert d.missing() == d.paths(), f"{name} is recorded now: move it from UNRECORDED into DATASETS"
        assert all(datasets.owner(f) is None for f in d.files), d


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


# ---------------------------------------------------------------------------------------------------------
# A declared file's name is typed once: in its DataSet(...) declaration
# ---------------------------------------------------------------------------------------------------------

# Names a file format owns (PEFT's adapter files, the machine description every recorder writes), not a
# data set: a data set that holds such a file names it too.
FORMAT_NAMES = {"adapter_config.json", "adapter_model.safetensors", "device.json"}
# Where the names are looked for: the package, the device scripts (notebooks: not yet, see below)
SCANNED = ("dora_num/**/*.py", ".ci/**/*.py")
# The raw record of one trained run is not a data set; its own names are declared once, there
RAW_NAMES = {("dora_num/studies/cancellation/runs.py", "RAW_FILES")}


def _declared_files() -> set[str]:
    return {f for d in (*datasets.DATASETS.values(), *datasets.UNRECORDED.values()) for f in d.files
            if Path(f).name not in FORMAT_NAMES}


def typed_names(src: str, files: set[str], allowed_assignments=()) -> list[tuple[int, str]]:
    """``(line, name)`` for each base name of the declared ``files`` that ``src`` types outside a ``DataSet(...)`` call: in a
    string constant, or an f-string that spells it (``f"model_{t}.csv"``).  Docstrings are documentation
    and are left out; so are the values of the module-level assignments ``allowed_assignments``."""
    tree = ast.parse(src)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "DataSet":
            skip |= {id(n) for n in ast.walk(node)}
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            skip.add(id(node.body[0].value))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in allowed_assignments for t in node.targets):
            skip |= {id(n) for n in ast.walk(node.value)}
    names = {Path(f).name for f in files}
    tails = {"/".join(f.split("/")[i:]): Path(f).name for f in files for i in range(f.count("/") + 1)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, b) for b in names
                      if re.search(r"(?<![\w.-])" + re.escape(b) + r"(?!\w)", node.value)]
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[-1], ast.Constant):
            last = node.values[-1].value
            lit = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if not re.search(r"\.[A-Za-z]\w*$", last) or len(lit) - len(re.search(r"\.[A-Za-z]\w*$", last)[0]) < 2:
                continue  # no extension of its own, or f"{name}.csv": names no file
            rx = re.compile("(?:.*/)?" + "".join(re.escape(v.value) if isinstance(v, ast.Constant) else "[^/]+"
                                                 for v in node.values))
            found += [(node.lineno, b) for t, b in tails.items() if rx.fullmatch(t)]
    return sorted(set(found))


def test_the_name_rule_can_fail():
    names = {"gpu/norm_bench.csv", "gpu/model_probe.csv", "gpu/convergence/history.csv.gz"}
    src = ('"""Writes norm_bench.csv."""\nA = DataSet("n", {"bench": "gpu/norm_bench.csv"}, recorder="n")\n'
           'p = out / "norm_bench.csv"\nq = f"gpu/model_{t}.csv"\nr = f"{name}.csv"\nRAW = {"h": "history.csv.gz"}\n')
    assert typed_names(src, names) == [(3, "norm_bench.csv"), (4, "model_probe.csv"), (6, "history.csv.gz")]
    assert typed_names(src, names, ("RAW",)) == [(3, "norm_bench.csv"), (4, "model_probe.csv")]


@pytest.mark.parametrize("pattern", SCANNED)
def test_no_declared_file_name_is_typed_outside_its_declaration(pattern):
    """Writers and readers take a file from its declaration (``DataSet.path(role, folder)``,
    ``.filename(role)``): renaming a file is one edit, in its study folder's ``datasets.py``."""
    names = _declared_files()
    typed = {}
    for p in sorted(REPO_ROOT.glob(pattern)):
        rel = p.relative_to(REPO_ROOT).as_posix()
        allowed = {a for f, a in RAW_NAMES if f == rel}
        for line, name in typed_names(p.read_text(), names, allowed):
            typed.setdefault(name, []).append(f"{rel}:{line}")
    assert typed == {}, "declared file names typed outside their declarations (use DataSet.path / .filename)"


def test_record_list_prints_every_data_set(capsys):
    from dora_num.__main__ import main

    assert main(["record", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in datasets.DATASETS)
    assert "NVIDIA H200" in out and datasets.last_recorded(datasets.DATASETS["memory"])["commit"] in out
    wide = [line for line in out.splitlines() if len(line) > 100]
    assert not wide, f"{len(wide)} lines wider than 100 columns, e.g. {wide[0]!r}"
    assert "Legend." in out


def test_notebooks_print_the_declared_recording_command():
    """A notebook says how to record what it lacks with its data set's own ``how_to_record`` (or
    ``ctx.recorded``), never a command typed in a cell, which drifts from the recorder and its producer."""
    typed = []
    for nb in NOTEBOOKS:
        cells = ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        for node in ast.walk(ast.parse("\n".join(cells))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                    r"dora-num record|dora_num gpu-suite|dora-num gpu-suite|--ingest", node.value):
                typed.append(f"{nb.name}: {node.value[:60]!r}")
    assert typed == []


def _reads(nb_path, table: dict[str, DataSet], package: str = "dora_num") -> dict[str, bool]:
    """The data sets of ``table`` a notebook asks for with ``ctx.recorded(...)`` (evaluated in the notebook's
    imports of ``package``, at its parameters' defaults): name -> required in a full run."""
    book = json.loads(nb_path.read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    ns: dict = {}
    params = next(c for c in book["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    exec("".join(params["source"]), ns)
    for src in cells:
        for node in ast.parse(src).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and (
                    isinstance(node, ast.Import) or (node.module or "").startswith(package)):
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
                        d = (next((d for d in table.values() if item in d.files), None) if isinstance(item, str)
                             else table.get(item.name))
                        assert d is not None, (nb_path.name, item)
                        out[d.name] = out.get(d.name, False) or required
    return out


def read_problems(nb, table: dict[str, DataSet] | None = None, package: str = "dora_num") -> list[str]:
    """Where notebook ``nb`` disagrees with the data sets ``table`` (default: the package's) about what it
    reads: a ``ctx.recorded`` call against the data set's ``notebooks`` / ``optional``, and its metadata's
    ``requires`` against :func:`dora_num.studies.datasets.requires`."""
    table = datasets.DATASETS if table is None else table
    nn, reads = nb.stem[:2], _reads(nb, table, package)
    found = []
    for required, field in ((True, "notebooks"), (False, "optional")):
        got = sorted(n for n, req in reads.items() if req == required)
        want = sorted(d.name for d in table.values() if nn in getattr(d, field))
        if got != want:
            found.append(f"reads {got} with required={required}; the data sets naming {nn} in {field}: {want}")
    meta = json.loads(nb.read_text())["metadata"].get("dora_num", {}).get("requires")
    want = datasets.requires(nb.stem, table.values())
    return found + ([f"metadata dora_num.requires is {meta}, not {want}"] if meta != want else [])


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_requires_what_it_reads(nb):
    assert read_problems(nb) == []
