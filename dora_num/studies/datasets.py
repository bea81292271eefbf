"""Every recorded data set: what ``make reproduce`` reads but cannot make, declared once.

Each study folder declares its own in its ``datasets.py`` (:class:`~dora_num.repro.paths.DataSet`:
name, ``{role: file}`` under ``data/``, the recorder and its module, the notebooks that read it);
:func:`study_folders` finds them (a new folder with a ``datasets.py`` is found; nothing here is edited)
and :data:`DATASETS` collects them in notebook order.  The ``dora-num record`` registry,
:data:`RECORDERS`, is derived from the declarations.  ``dora-num record --list`` prints :func:`table`;
the tests hold every notebook's ``requires``, every sidecar's producer and the files under ``data/`` to it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import NamedTuple

from ..repro.durations import DURATIONS
from ..repro.paths import DataSet, committed_data

GPU_TESTS = DataSet("gpu-tests", {"log": "gpu/pytest_gpu.log"}, recorder="bash .ci/gpu/record.sh tests")


def study_folders(module: str, package: str = __package__) -> list:
    """The ``module`` (e.g. ``"datasets"``) of every study folder of ``package`` that has one, in the order
    of the notebooks the folders back (each folder's ``NOTEBOOK``).  ``package``: this one; another (a
    throwaway tree in a test, tests/test_extending.py) is searched the same way."""
    here = Path(importlib.import_module(package).__file__).parent
    found = []
    for d in sorted(p for p in here.iterdir() if (p / "__init__.py").is_file() and (p / f"{module}.py").is_file()):
        pkg = importlib.import_module(f"{package}.{d.name}")
        found.append((pkg.NOTEBOOK, importlib.import_module(f"{package}.{d.name}.{module}")))
    return [m for _, m in sorted(found, key=lambda t: t[0])]


def declared(package: str = __package__) -> tuple[DataSet, ...]:
    """The data sets the study folders of ``package`` declare (each ``datasets.py``'s ``DATASETS``), in
    notebook order."""
    return tuple(d for m in study_folders("datasets", package) for d in m.DATASETS)


DATASETS: dict[str, DataSet] = {d.name: d for d in (*declared(), GPU_TESTS, DURATIONS)}


# Data sets declared with their recorders but not recorded yet (a study folder's ``UNRECORDED``): their
# recorders run, nothing reads them, and the tests fail once their files are committed while still listed here
UNRECORDED: dict[str, DataSet] = {d.name: d for m in study_folders("datasets") for d in getattr(m, "UNRECORDED", ())}


class Recorder(NamedTuple):
    module: str
    help: str


def recorders(datasets) -> dict[str, Recorder]:
    """``dora-num record``'s subcommands: one per recorder the data sets name, its module and help from
    the data set that declares them (exactly one per subcommand; the tests hold every subcommand to one)."""
    out: dict[str, Recorder] = {}
    for d in datasets:
        if d.kind == "record" and d.about:
            if d.subcommand in out:
                raise ValueError(f"dora-num record {d.subcommand} is declared twice (data set {d.name})")
            out[d.subcommand] = Recorder(d.module, d.about)
    return out


# recorders of no data set: what a GPU run needs carried along
TOOLS = {"carry": Recorder("dora_num.studies.record_carry", "CPU: the bf16 copy of MiniLM carried to the GPU machine"),
         "carry-dorafactors": Recorder("dora_num.studies.speed.record_carry_dorafactors",
                                       "CPU: the released dorafactors kernels (v1.0) carried to the GPU machine")}
RECORDERS: dict[str, Recorder] = {**recorders([*DATASETS.values(), *UNRECORDED.values()]), **TOOLS}

NOT_RECORDED = ("corpus",)  # data/ folders that are inputs, not recordings (corpus: dora_num.adapters.corpus)


def requires(notebook: str, datasets=None) -> list[str]:
    """What notebook ``NN`` (or its stem) needs in a full run: the files of the data sets naming it
    (repository paths, the form of its metadata's ``requires``); ``datasets``: default :data:`DATASETS`."""
    nn = notebook[:2]
    return [f"data/{f}" for d in (DATASETS.values() if datasets is None else datasets) if nn in d.notebooks
            for f in d.files]


def owner(path: str) -> DataSet | None:
    """The data set a file (path under ``data/``) belongs to."""
    return next((d for d in DATASETS.values() if path in d.files), None)


def last_recorded(ds: DataSet) -> dict:
    """The newest sidecar of ``ds``: when, at which commit, on which machine."""
    import json

    best = {}
    for f in ds.files:
        side = committed_data(f + ".provenance.json")
        if not side.is_file():
            continue
        p = json.loads(side.read_text())
        if p.get("created_utc", "") >= best.get("created_utc", ""):
            best = p
    if not best:
        return {"created_utc": None, "commit": None, "machine": None}
    sha = (best.get("extra") or {}).get("measured_at_git_sha") or (best.get("git") or {}).get("sha")
    dev = best.get("device") or {}
    machine = dev.get("name") or ("CPU " + str((dev.get("cpu") or {}).get("model") or dev.get("host_cpu") or "?"))
    commit = ",".join(c[:12] for c in str(sha).split(",")) if sha else None  # records of several launches: each
    return {"created_utc": best.get("created_utc"), "commit": commit, "machine": machine}


def table():
    """One row per data set: name, files, recorder, notebooks, the last recording (commit, machine)."""
    import pandas as pd

    rows = []
    for d in DATASETS.values():
        last = last_recorded(d)
        nbs = ", ".join([*d.notebooks, *(f"({n})" for n in d.optional)])
        rows.append({"name": d.name, "files": len(d.files), "folder": _common_folder(d.files),
                     "recorder": d.recorder, "notebooks": nbs or "-", "commit": last["commit"],
                     "machine": last["machine"], "recorded": (last["created_utc"] or "")[:10]})
    return pd.DataFrame(rows)


def _common_folder(files) -> str:
    import os

    return os.path.commonpath([os.path.dirname(f) or "." for f in files]) + "/"
