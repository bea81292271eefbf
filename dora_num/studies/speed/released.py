"""The paper's released kernels against ours, like for like: one table from the interleaved record.

The record (:data:`~dora_num.studies.speed.datasets.DORAFACTORS`, written by
:mod:`~dora_num.studies.speed.record_dorafactors`, whose docstring says what every column is) timed their
kernels (``github.com/sockeye44/dorafactors`` v1.0) and ours on one GPU in one process, in rounds: each
round times every implementation once, in an order rotated each round, and stores each one's time over
ours *in that round* (``ratio_rounds``).  Here, per measurement (``op``), shape and rank:

- ``ratio``: the median over rounds of their time / ours (above 1: theirs took longer);
- ``ratio_lo``, ``ratio_hi``: the smallest and largest of those per-round ratios.  For ``n`` rounds that
  are independent draws of one distribution, ``[min, max]`` is a distribution-free confidence interval
  for that distribution's median with coverage ``1 - 2 * 2**-n`` (``coverage``: 98.4% at n = 7; the
  order-statistic interval, no bootstrap: seven values give a bootstrap too few distinct resamples to
  trust its tails).  A drift of the machine within the run makes the rounds dependent; the rotation
  spreads a drift over both sides, it does not remove it;
- each side's dtypes (its inputs and output, as the record names them) and each side's max relative
  error against float64 (``err_*``: the output's, and for the training rows the largest of the
  gradients', with the gradient it belongs to), so that a speed gained by a less exact contract is seen
  beside the speed.

Reads only; nothing is re-measured.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...repro.provenance import read_provenance
from .datasets import DORAFACTORS

THEIRS = "dorafactors_"  # the record names their implementations dorafactors_*
OPS = ("compose_fwd", "compose_train", "row_norm", "layer_fwd", "layer_fwd_bwd")
KEYS = ("op", "tokens", "d_in", "d_out", "rank")  # a configuration; absent ones are NaN in the record
# the output's error column of each op, and the gradients' where the op has a backward
OUTPUT_ERR = {"compose_fwd": "err_out", "compose_train": "err_out", "row_norm": "err_norm",
              "layer_fwd": "err_y", "layer_fwd_bwd": "err_y"}
GRAD_ERRS = {"compose_train": ("err_dbase", "err_dlora", "err_dg"),
             "layer_fwd_bwd": ("err_dx", "err_dA", "err_dB", "err_dm")}
# the dtype columns, in the order a side's dtypes are written, with their short names
DTYPE_COLS = {"act_dtype": "x", "w_dtype": "W", "ab_dtype": "A,B", "m_dtype": "m", "g_dtype": "g",
              "out_dtype": "out"}
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def load_bench(folder: str | Path | None = None) -> pd.DataFrame:
    """The recorded rows (``folder``: a recorder's output folder; default the committed ``data/gpu/``);
    a missing file is an error saying how to record it."""
    return pd.read_csv(DORAFACTORS.subset("bench").require(folder)[0])


def recorded_run(folder: str | Path | None = None) -> dict:
    """Where the record was measured, from its provenance sidecar: ``device`` (the GPU's name), ``release``
    (their repository, tag and commit), ``git_sha`` (ours, at measurement) and ``rounds``."""
    side = read_provenance(DORAFACTORS.subset("bench").require(folder)[0])
    release = side["extra"]["dorafactors"]
    return {"device": side["device"]["name"], "release": f"{release['repo']} {release['tag']} "
            f"(commit {release['commit'][:7]})", "git_sha": side["extra"].get("measured_at_git_sha", ""),
            "rounds": side["parameters"]["rounds"]}


def failed(bench: pd.DataFrame) -> pd.DataFrame:
    """The configurations the recorder could not measure (its ``error`` rows, with why)."""
    return bench[bench["impl"] == "error"] if "impl" in bench else bench.iloc[:0]


def rounds(cell: str) -> np.ndarray:
    """The per-round values of a ``;``-joined cell (``ratio_rounds``, ``rounds_ms``)."""
    if not isinstance(cell, str) or not cell.strip():
        raise ValueError(f"no per-round values in {cell!r}")
    return np.array([float(x) for x in cell.split(";")])


def round_ratios(theirs: str, ours: str) -> np.ndarray:
    """Round i of ``theirs`` over round i of ``ours`` (two ``rounds_ms`` cells of one interleaved run: each
    round timed both, so the ratio per round carries the machine's drift once, not twice)."""
    a, b = rounds(theirs), rounds(ours)
    if a.size != b.size:
        raise ValueError(f"interleaved rounds must pair up: {a.size} against {b.size}")
    return a / b


def coverage(n: int) -> float:
    """The coverage of ``[min, max]`` of ``n`` independent draws as an interval for their median."""
    if n < 2:
        raise ValueError(f"an interval needs at least 2 rounds, not {n}")
    return 1 - 2 * 0.5 ** n


def interval(ratios: np.ndarray) -> tuple[float, float, float]:
    """``(median, min, max)`` of the per-round ratios."""
    return float(np.median(ratios)), float(np.min(ratios)), float(np.max(ratios))


def dtypes(row: pd.Series) -> str:
    """One side's dtypes, e.g. ``x bf16, g fp32 -> bf16``: its inputs, then its output."""
    def short(col):
        return SHORT_DTYPE.get(row[col], row[col])

    ins = [f"{name} {short(c)}" for c, name in DTYPE_COLS.items()
           if c != "out_dtype" and c in row and isinstance(row[c], str)]
    out = short("out_dtype") if isinstance(row.get("out_dtype"), str) else "?"
    return f"{', '.join(ins)} -> {out}"


def shape_label(row) -> str:
    """``tokens x d_out`` for a compose, ``d_out x d_in r`` for a norm, ``d_in -> d_out r, T tokens`` for a layer."""
    def i(c):
        return int(row[c])

    if row["op"].startswith("compose"):
        return f"{i('tokens')}x{i('d_out')}"
    if row["op"] == "row_norm":
        return f"{i('d_out')}x{i('d_in')} r{i('rank')}"
    return f"{i('d_in')}->{i('d_out')} r{i('rank')} T{i('tokens')}"


def _grad_err(row: pd.Series, op: str) -> tuple[float, str]:
    cols = [c for c in GRAD_ERRS.get(op, ()) if c in row and pd.notna(row[c])]
    if not cols:
        return float("nan"), ""
    worst = max(cols, key=lambda c: row[c])
    return float(row[worst]), worst.removeprefix("err_")


def like_for_like(bench: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration their kernels ran at: their time / ours (median over rounds and the
    range over rounds) and each side's dtypes and errors against float64.  A configuration of theirs
    without exactly one row of ours beside it, or whose per-round ratios disagree with its count of rounds,
    is an error, by name."""
    ran = bench[bench["impl"] != "error"]
    keys = [k for k in KEYS if k in ran.columns]
    rows = []
    for cfg, group in ran.groupby(keys, dropna=False, sort=False):
        cfg = dict(zip(keys, cfg))
        op = cfg["op"]
        if op not in OUTPUT_ERR:
            raise ValueError(f"unknown measurement {op!r} in the record (known: {', '.join(OPS)})")
        for _, theirs in group[group["impl"].str.startswith(THEIRS)].iterrows():
            ours = group[group["impl"] == theirs["ours"]]
            if len(ours) != 1:
                raise ValueError(f"{op} {cfg}: {len(ours)} rows of ours ({theirs['ours']!r}) beside "
                                 f"{theirs['impl']!r}")
            ours = ours.iloc[0]
            r = rounds(theirs["ratio_rounds"])
            if len(r) != int(theirs["rounds"]):
                raise ValueError(f"{op} {cfg}: {len(r)} per-round ratios, the record says {theirs['rounds']} rounds")
            med, lo, hi = interval(r)
            g_t, g_o = _grad_err(theirs, op), _grad_err(ours, op)
            rows.append({**cfg, "shape": shape_label(theirs), "theirs": theirs["impl"], "ours": ours["impl"],
                         "theirs_ms": float(theirs["ms"]), "ours_ms": float(ours["ms"]),
                         "ratio": med, "ratio_lo": lo, "ratio_hi": hi, "rounds": len(r),
                         "coverage": coverage(len(r)),
                         "dtypes_theirs": dtypes(theirs), "dtypes_ours": dtypes(ours),
                         "err_theirs": float(theirs[OUTPUT_ERR[op]]), "err_ours": float(ours[OUTPUT_ERR[op]]),
                         "grad_err_theirs": g_t[0], "grad_err_theirs_of": g_t[1],
                         "grad_err_ours": g_o[0], "grad_err_ours_of": g_o[1]})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["op"] = pd.Categorical(out["op"], categories=[o for o in OPS if o in set(out["op"])], ordered=True)
    return out.sort_values(["op", "d_out", "rank", "tokens"], kind="stable").reset_index(drop=True)


def interval_side(t: pd.DataFrame) -> pd.Series:
    """Where each row's round interval lies: ``"theirs longer"`` (every round above 1), ``"ours longer"``
    (every round below 1) or ``"overlaps 1"``; what a sentence may say of a row's speed."""
    return pd.Series(np.where(t["ratio_lo"] > 1, "theirs longer", np.where(t["ratio_hi"] < 1, "ours longer",
                                                                           "overlaps 1")), index=t.index)
