"""Notebook 04's tables of one run, and the statistics read from them.

Tidy long format (one value per row): :func:`tidy_history` (loss, gradient norm,
learning rate, seconds per step), :func:`tidy_evals` (validation loss, MRR@10),
:func:`g_statistics` (``g - 1`` per module and step); :func:`wide_loss` and
:func:`seconds_per_step` read them back.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .config import PATHS, PROFILE_WARMUP, RunSpec


def g_statistics(g_minus_1: dict[int, dict[str, np.ndarray]]) -> pd.DataFrame:
    """Per step and module (and ``all`` modules): mean, std, min, max, max |g-1|."""
    rows = []
    for step, mods in sorted(g_minus_1.items()):
        items = list(mods.items()) + [("all", np.concatenate(list(mods.values())))]
        for name, a in items:
            a = np.asarray(a, dtype=np.float64)
            for stat, v in (("mean", a.mean()), ("std", a.std()), ("min", a.min()), ("max", a.max()),
                            ("max_abs", np.abs(a).max())):
                rows.append({"step": step, "module": name, "statistic": stat, "value": float(v)})
    return pd.DataFrame(rows)


def tidy_history(res, spec: RunSpec, impl: str) -> pd.DataFrame:
    h = pd.DataFrame(res.history)
    long = h.melt(id_vars=["step"], value_vars=["loss", "grad_norm", "lr", "seconds"], var_name="metric")
    return long.assign(run=spec.name, path=spec.path, impl=impl, seed=spec.seed, repeat=spec.repeat,
                       perturbed=spec.perturbed)


def tidy_evals(res, spec: RunSpec, impl: str) -> pd.DataFrame:
    e = pd.DataFrame(res.evals)
    long = e.melt(id_vars=["step"], value_vars=["val_loss", "mrr10"], var_name="metric")
    return long.assign(run=spec.name, path=spec.path, impl=impl, seed=spec.seed, repeat=spec.repeat,
                       perturbed=spec.perturbed)


_ID = ["run", "path", "impl", "seed", "repeat", "perturbed", "step"]


def order(df: pd.DataFrame, extra: list[str]) -> pd.DataFrame:
    cols = _ID + extra
    return df[cols + [c for c in df.columns if c not in cols]]


def wide_loss(history: pd.DataFrame, metric: str = "loss") -> pd.DataFrame:
    """The tidy history's ``metric`` as a frame with columns path, seed, repeat,
    perturbed, step, ``metric``."""
    h = with_perturbed(history[history.metric == metric])
    return h.rename(columns={"value": metric})[["path", "seed", "repeat", "perturbed", "step", metric]]


def with_perturbed(df: pd.DataFrame) -> pd.DataFrame:
    """Tables recorded before the 1-ulp runs existed have no ``perturbed`` column: all False."""
    return df if "perturbed" in df.columns else df.assign(perturbed=False)


def seconds_per_step(rec, source: str = "runs") -> dict[str, float]:
    """Median time per step of each path.

    ``"runs"``: over every recorded step of the runs (first step of each run
    dropped; the 1-ulp runs left out, they ran in another wave).  On the H200 the
    runs were 3-4 processes sharing the GPU, which costs little here because the
    harness is bound by each process's own host (Python).
    ``"profile"``: the profiling phase (one process alone; first ``PROFILE_WARMUP``
    steps dropped), short, and eager runs first in it, so eager carries more
    warm-up (cuBLAS heuristics for new sequence lengths)."""
    if source == "profile":
        prof = rec.profile
        if not len(prof) or set(prof.path) != set(PATHS):
            raise ValueError(f"no profile of both paths in {rec.folder}")
        kept = prof[prof.step > PROFILE_WARMUP]
        return {p: float(g.seconds.median()) for p, g in kept.groupby("path")}
    if source != "runs":
        raise ValueError(f"source must be 'runs' or 'profile', got {source!r}")
    h = with_perturbed(rec.history)
    h = h[(h.metric == "seconds") & (h.step > 1) & ~h.perturbed.astype(bool)]  # 1-ulp runs: another wave
    return {p: float(g.value.median()) for p, g in h.groupby("path")}
