"""Every recorded data set: what ``make reproduce`` reads but cannot make, declared once.

Each study folder declares its own in its ``datasets.py`` (:class:`~dora_num.repro.paths.DataSet`:
name, files under ``data/``, the recorder, the notebooks that read it); :data:`DATASETS` collects
them.  ``dora-num record --list`` prints :func:`table`; the tests hold ``cli.RECORDERS``, every
notebook's ``requires``, every sidecar's producer and the files under ``data/`` to it.
"""

from __future__ import annotations

from ..repro.paths import DataSet, committed_data
from .bounds import datasets as _bounds
from .cancellation import datasets as _cancellation
from .convergence import datasets as _convergence
from .fma import datasets as _fma
from .gradient import datasets as _gradient
from .speed import datasets as _speed

GPU_TESTS = DataSet("gpu-tests", ("gpu/pytest_gpu.log",), recorder="bash .ci/gpu/record.sh tests")
# The README's commands timed on a fresh clone (read by the README, not by a notebook).
DURATIONS = DataSet("durations", ("setup/durations.json",), recorder="python3 -m dora_num.repro.durations",
                    where="the CPU, a fresh clone: about 35 min on 2 cores", ingest=False)

DATASETS: dict[str, DataSet] = {d.name: d for d in (
    *_cancellation.DATASETS, *_fma.DATASETS, *_bounds.DATASETS, *_convergence.DATASETS, *_speed.DATASETS,
    *_gradient.DATASETS, GPU_TESTS, DURATIONS)}

NOT_RECORDED = ("corpus",)  # data/ folders that are inputs, not recordings (corpus: dora_num.adapters.corpus)


def requires(notebook: str) -> list[str]:
    """What notebook ``NN`` (or its stem) needs in a full run: the files of the data sets naming it
    (repository paths, the form of its metadata's ``requires``)."""
    nn = notebook[:2]
    return [f"data/{f}" for d in DATASETS.values() if nn in d.notebooks for f in d.files]


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
    return {"created_utc": best.get("created_utc"), "commit": str(sha)[:12] if sha else None, "machine": machine}


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
