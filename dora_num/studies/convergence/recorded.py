"""Notebook 04's recorded runs (``data/gpu/convergence``, :data:`.datasets.CONVERGENCE`), or a live
study's result read the same way (:func:`from_study`); the ingest that wrote them:
:mod:`.ingest_convergence`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ...repro.paths import committed_data
from .datasets import CONVERGENCE, SAMEBATCH  # noqa: F401 - SAMEBATCH: what notebook 04 asks for
from .tidy import with_perturbed

@dataclass
class Recorded:
    history: pd.DataFrame  # tidy: run, path, impl, seed, repeat, step, metric, value
    evals: pd.DataFrame
    g_stats: pd.DataFrame
    profile: pd.DataFrame
    summary: dict
    folder: Path


def load_recorded(folder: str | Path | None = None) -> Recorded:
    """The recorded runs under ``folder`` (default ``data/gpu/convergence``); a clear
    error naming the command that records them when they are missing."""
    CONVERGENCE.require(folder)
    folder = Path(folder) if folder is not None else committed_data(CONVERGENCE.folder)
    def path(role):
        return CONVERGENCE.path(role, folder)

    return Recorded(read_history(path("history")), with_perturbed(pd.read_csv(path("evals"))),
                    with_perturbed(pd.read_csv(path("g_stats"))), pd.read_csv(path("profile")),
                    json.loads(path("summary").read_text()), folder)


def load_samebatch(folder: str | Path | None = None) -> tuple[pd.DataFrame, dict]:
    """The same-batch wave (``data/gpu/convergence_samebatch``, :data:`.datasets.SAMEBATCH`): its per-step
    losses (tidy) and summary; a clear error naming the command that records it when missing."""
    SAMEBATCH.require(folder)
    return (read_history(SAMEBATCH.path("history", folder)),
            json.loads(SAMEBATCH.path("summary", folder).read_text()))


def measured_at(history: str | Path) -> str:
    """Where and at which commit the recorded runs ran, from the provenance sidecar of their ``history``
    file: the GPU, and the commit of every process (one when the runs were recorded at one commit)."""
    from ...repro.provenance import read_provenance

    side = read_provenance(Path(history))
    extra = side.get("extra") or {}
    gpu = (side.get("device") or {}).get("name") or (side.get("device") or {}).get("device", {}).get("name")
    sha = extra.get("measured_at_git_sha") or (side.get("parameters") or {}).get("git_sha") or side["git"]["sha"]
    return f"{gpu or 'unknown device'}; {sha}"


def read_history(path: Path) -> pd.DataFrame:
    """The tidy history, loss and gradient norm back to their exact float32 values
    (written with ``HISTORY_FLOAT_FORMAT``: the decimal string identifies the float32)."""
    h = with_perturbed(pd.read_csv(path))
    exact = h.metric.isin(["loss", "grad_norm"])
    h.loc[exact, "value"] = h.loc[exact, "value"].to_numpy(np.float32).astype(np.float64)
    return h


def from_study(res, folder: Path) -> Recorded:
    """A live study's result (:class:`~dora_num.studies.convergence.record_convergence.StudyResult`) read as recorded runs."""
    return Recorded(res.history, res.evals, res.g_stats, res.profile, res.summary, Path(folder))
