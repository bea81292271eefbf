"""Collapse with seeds: fractions at the best and last checkpoint with intervals, their sensitivity to the
learning-rate integral, and a scaling model of ``|g - 1|`` carried to the paper's 7B adapter.

Design (pre-registered before the seeds were recorded: docs/methods.md, "Collapse with seeds"):

* **Fractions** (:func:`fraction_table`): per configuration (rank, lr, variant), format, zone and checkpoint
  (``best``: the capture at the best evaluation; ``final``: the last), the pooled fraction ``sum_sj k_sj /
  sum_sj n_sj`` over seeds ``s`` and modules ``j`` (``k``: rows in the zone).  Interval (:func:`bootstrap_fraction`):
  ``scipy.stats.bootstrap``, percentile, 95 %, resampling **seeds and modules independently** (two samples:
  the pigeonhole bootstrap of a crossed seed x module design, Owen 2007, Ann. Appl. Stat. 1(2)); rows are never
  resampled (rows of one module share its training signal).  With one seed it resamples modules only and says
  so (``interval_over = "modules (1 seed)"``): the seed-to-seed spread is then not in it.
* **Sensitivity** (:func:`sensitivity_table`): the fraction at every kept capture against the learning-rate
  integral ``L(t) = sum_{k<t} lr_k`` (:func:`cumulative_lr`: lr x steps with the warmup counted as run).
* **Scaling model** (:func:`fit_scaling`): per (run, capture, module, ||W_j|| tercile), least squares of
  ``log rms(g - 1) = b0 + b_L log L + b_t log t + b_W log ||W_j|| + b_r log r`` on the standard runs (s = 1),
  captures at ``t >= MIN_STEP``.  Held out, stated before fitting: each learning rate in turn (fit on the other;
  the tenfold extrapolation in lr the paper's 1e-5 needs); the out-of-sample error is the log ratio of predicted to
  observed pooled RMS per held-out (run, capture) (:func:`held_out`).  The 90 % prediction interval of a new
  adapter's pooled std(g) is the point prediction times the 5 % and 95 % quantiles of those ratios.
* **The paper's adapter** (:func:`predict_paper`): Qwen2-VL-7B, r = 128; its lr and steps are not stated, so the
  paper's own recipe (lr 1e-5, cosine, warmup 0.1, 2000 steps: docs/paper.md) is assumed, and ``||W_j||``
  (not loadable here) spans :data:`PAPER_W_RANGE`; the prediction is compared with the measured std 0.0015.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ...numerics.formats import NARROW_FORMATS
from .datasets import TRAINED_SEEDS
from .seed_stats import ALL_ROWS, count_column, read_stats

CONFIDENCE = 0.95  # the fractions' intervals
PI_LEVEL = 0.90  # the paper prediction's interval
N_RESAMPLES = 9999
MIN_STEP = 10  # captures fitted: step 0 is g = 1 up to the init's fp32 ulps (nothing to scale)
# The paper's training recipe (docs/paper.md: Qwen3.5-9B, r = 384, rsLoRA, AdamW lr 1e-5, cosine, warmup 0.1,
# 2000 steps) assumed for its Qwen2-VL-7B adapter (r = 128), whose lr and steps the paper does not state.
PAPER_SETTING = {"rank": 128, "lr": 1e-5, "steps": 2000, "warmup_frac": 0.1, "schedule": "cosine", "g_std": 0.0015}
# ||W_j|| of Qwen2-VL-7B's rows cannot be measured here (no model above MiniLM loads): 0.02 sqrt(d_in) at its
# initialisation std 0.02 is 1.2 (d_in 3584) to 2.8 (18944); the range allows a factor 2 either way of trained drift.
PAPER_W_RANGE = (0.6, 5.6)


def cumulative_lr(lr: float, steps, warmup_steps: int) -> np.ndarray:
    """``L(t) = sum_{k=0}^{t-1} lr min(1, (k+1)/warmup)``: the learning rate the optimizer applied over ``t``
    steps under :func:`dora_num.adapters.train.train`'s schedule (LambdaLR's factor at update ``k``)."""
    t = np.asarray(steps, dtype=np.float64)
    w = max(int(warmup_steps), 1)
    ramp = np.minimum(t, w)
    return lr * (ramp * (ramp + 1) / 2 / w + np.maximum(t - w, 0))


def cumulative_lr_cosine(lr: float, steps: int, warmup_frac: float) -> float:
    """``L`` of linear warmup over ``warmup_frac`` of ``steps`` then cosine decay to 0 (transformers'
    ``get_cosine_schedule_with_warmup``: factor ``k / W`` below ``W``, then ``(1 + cos(pi p)) / 2``)."""
    k = np.arange(steps, dtype=np.float64)
    w = int(round(warmup_frac * steps))
    f = np.where(k < w, k / max(w, 1), 0.5 * (1 + np.cos(np.pi * (k - w) / max(steps - w, 1))))
    return float(lr * f.sum())


# --------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------

@dataclass
class Seeds:
    stats: pd.DataFrame  # seed_stats rows with run labels (with_labels)
    evals: pd.DataFrame
    manifest: dict


def load_seeds(folder=None) -> Seeds:
    """The seeds record (default ``data/adapters/trained_seeds``, :data:`TRAINED_SEEDS`)."""
    TRAINED_SEEDS.require(folder)
    folder = Path(folder) if folder is not None else TRAINED_SEEDS.paths()[0].parent
    manifest = json.loads(TRAINED_SEEDS.path("manifest", folder).read_text())
    return Seeds(with_labels(read_stats(TRAINED_SEEDS.path("stats", folder)), manifest),
                 pd.read_csv(TRAINED_SEEDS.path("evals", folder)), manifest)


def with_labels(stats: pd.DataFrame, manifest: dict) -> pd.DataFrame:
    """The stats table with each run's labels (``manifest.json: runs.*.labels``: config, seed, rank, lr, ...)."""
    lab = pd.DataFrame([r["labels"] for r in manifest["runs"].values()])
    missing = sorted(set(stats["run"]) - set(lab["run"]))
    if missing:
        raise ValueError(f"runs {missing[:3]} of the stats table have no labels in the manifest")
    return stats.merge(lab, on="run", how="left")


# --------------------------------------------------------------------------
# Fractions with intervals
# --------------------------------------------------------------------------

def bootstrap_fraction(k: np.ndarray, n: np.ndarray, *, confidence: float = CONFIDENCE,
                       n_resamples: int = N_RESAMPLES, rng=0) -> dict:
    """Pooled fraction ``sum k / sum n`` of a seeds x modules table of counts (``k``, ``n``: ``[S, J]``) and its
    percentile interval from ``scipy.stats.bootstrap`` resampling seeds and modules independently (one seed:
    modules only)."""
    from scipy.stats import bootstrap

    k, n = np.atleast_2d(np.asarray(k, dtype=np.float64)), np.atleast_2d(np.asarray(n, dtype=np.float64))
    if k.shape != n.shape or k.ndim != 2 or (n <= 0).any() or (k < 0).any() or (k > n).any():
        raise ValueError(f"k and n must be [seeds, modules] counts with 0 <= k <= n, n > 0; got {k.shape}, {n.shape}")
    S, J = k.shape
    est = float(k.sum() / n.sum())

    def stat(si, mj, axis=-1):  # si [..., S], mj [..., J]: the pooled fraction over the resampled cells
        si, mj = si.astype(np.int64), mj.astype(np.int64)
        num = k[si[..., :, None], mj[..., None, :]].sum(axis=(-2, -1))
        den = n[si[..., :, None], mj[..., None, :]].sum(axis=(-2, -1))
        return num / den

    if S == 1:
        res = bootstrap((np.arange(J),), lambda mj, axis=-1: stat(np.zeros(mj.shape[:-1] + (1,), int), mj),
                        confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                        vectorized=True, random_state=np.random.default_rng(rng))
        over = "modules (1 seed)"
    else:
        res = bootstrap((np.arange(S), np.arange(J)), stat, paired=False, confidence_level=confidence,
                        n_resamples=n_resamples, method="percentile", vectorized=True,
                        random_state=np.random.default_rng(rng))
        over = f"seeds x modules ({S} seeds)"
    lo, hi = res.confidence_interval
    return {"fraction": est, "lo": float(lo), "hi": float(hi), "n_seeds": S, "n_modules": J,
            "interval_over": over}


def checkpoint_rows(stats: pd.DataFrame, at: str) -> pd.DataFrame:
    """The whole-module rows at each run's ``best`` or ``final`` capture."""
    if at not in ("best", "final"):
        raise ValueError(f"at must be 'best' or 'final', got {at!r}")
    return stats[(stats["wbin"] == ALL_ROWS) & stats[at].astype(bool)]


def fraction_table(stats: pd.DataFrame, *, formats=NARROW_FORMATS, zones=("one", "sym"),
                   n_resamples: int = N_RESAMPLES) -> pd.DataFrame:
    """Per configuration, checkpoint (best, final), format and zone: the pooled fraction over seeds and modules
    with :func:`bootstrap_fraction`'s interval, the seeds it rests on and the steps of those checkpoints."""
    rows = []
    for at in ("best", "final"):
        sub = checkpoint_rows(stats, at)
        for (cfg, variant, rank, lr), g in sub.groupby(["config", "variant", "rank", "lr"]):
            seeds = sorted(g["seed"].unique())
            for fmt in formats:
                for zone in zones:
                    col = count_column(zone, fmt)
                    k = g.pivot_table(index="seed", columns="module", values=col).loc[seeds].to_numpy()
                    n = g.pivot_table(index="seed", columns="module", values="rows").loc[seeds].to_numpy()
                    b = bootstrap_fraction(k, n, n_resamples=n_resamples)
                    rows.append({"config": cfg, "variant": variant, "rank": rank, "lr": lr, "checkpoint": at,
                                 "format": fmt, "zone": zone, **b, "seeds": seeds,
                                 "steps": sorted(g.drop_duplicates("seed")["step"].tolist())})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# Sensitivity to lr x steps
# --------------------------------------------------------------------------

def with_lr_integral(stats: pd.DataFrame) -> pd.DataFrame:
    return stats.assign(L=cumulative_lr_per_row(stats))


def cumulative_lr_per_row(stats: pd.DataFrame) -> np.ndarray:
    return np.array([float(cumulative_lr(lr, s, w)) for lr, s, w in
                     zip(stats["lr"], stats["step"], stats["warmup_steps"])])


def sensitivity_table(stats: pd.DataFrame, fmt: str = "bf16", zone: str = "one") -> pd.DataFrame:
    """Per run and kept capture: the pooled fraction (over its modules) in ``zone`` of ``fmt``, pooled RMS of
    ``g - 1``, and ``L`` (lr x steps, warmup counted as run)."""
    s = with_lr_integral(stats[stats["wbin"] == ALL_ROWS])
    col = count_column(zone, fmt)
    g = s.assign(_k=s[col], _ss=s["rows"] * s["gm1_rms"] ** 2).groupby(
        ["run", "config", "seed", "variant", "rank", "lr", "step", "best", "final", "L"], as_index=False)[
        ["_k", "rows", "_ss"]].sum()
    return g.assign(fraction=g["_k"] / g["rows"], rms=np.sqrt(g["_ss"] / g["rows"]), format=fmt, zone=zone).drop(
        columns=["_k", "_ss"])


# --------------------------------------------------------------------------
# Scaling model of |g - 1|
# --------------------------------------------------------------------------

FEATURES = ("log_L", "log_t", "log_w", "log_r")


def design(stats: pd.DataFrame) -> pd.DataFrame:
    """The fitted rows: standard runs (s = 1), ||W_j|| terciles, captures at ``t >= MIN_STEP`` with ``g != 1``
    somewhere in the tercile; ``y = log rms(g - 1)`` and :data:`FEATURES`."""
    s = stats[(stats["wbin"] != ALL_ROWS) & (stats["step"] >= MIN_STEP) & (stats["gm1_rms"] > 0)]
    s = s[s["variant"] == "standard"]
    s = with_lr_integral(s)
    return s.assign(y=np.log(s["gm1_rms"]), log_L=np.log(s["L"]), log_t=np.log(s["step"].astype(float)),
                    log_w=np.log(s["w_median"]), log_r=np.log(s["rank"].astype(float)))


@dataclass
class ScalingFit:
    coef: dict  # intercept and one slope per feature
    se: dict  # ordinary least-squares standard errors (rows are not independent: a lower bound)
    resid_sd: float
    n: int
    features: tuple

    def predict_log(self, X: pd.DataFrame) -> np.ndarray:
        return self.coef["intercept"] + sum(self.coef[f] * X[f].to_numpy() for f in self.features)


def fit_scaling(d: pd.DataFrame, features=FEATURES) -> ScalingFit:
    """Least squares of ``y`` on ``[1, features]`` (numpy ``lstsq``)."""
    features = tuple(features)
    X = np.column_stack([np.ones(len(d))] + [d[f].to_numpy(dtype=np.float64) for f in features])
    y = d["y"].to_numpy(dtype=np.float64)
    if len(y) <= X.shape[1]:
        raise ValueError(f"{len(y)} rows cannot fit {X.shape[1]} coefficients")
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    r = y - X @ beta
    dof = len(y) - X.shape[1]
    s2 = float(r @ r / dof)
    cov = s2 * np.linalg.pinv(X.T @ X)
    names = ("intercept",) + features
    return ScalingFit(dict(zip(names, map(float, beta))), dict(zip(names, map(float, np.sqrt(np.diag(cov))))),
                      math.sqrt(s2), len(y), features)


def pooled_rms(d: pd.DataFrame, log_rms: np.ndarray) -> pd.Series:
    """Per (run, step): ``sqrt(sum rows rms^2 / sum rows)`` of per-tercile RMS values ``exp(log_rms)``."""
    t = d.assign(_ss=d["rows"] * np.exp(2 * np.asarray(log_rms)))
    g = t.groupby(["run", "step"])[["_ss", "rows"]].sum()
    return np.sqrt(g["_ss"] / g["rows"])


def held_out(d: pd.DataFrame, by: str = "lr", features=FEATURES) -> pd.DataFrame:
    """For each value of ``by`` (pre-registered: ``lr``; ``rank`` a second check): fit on the other values and
    predict the held-out runs' pooled RMS per capture; ``log_ratio = log(predicted / observed)``."""
    frames = []
    for v in sorted(d[by].unique()):
        train, test = d[d[by] != v], d[d[by] == v]
        fit = fit_scaling(train, features)
        pred, obs = pooled_rms(test, fit.predict_log(test)), pooled_rms(test, test["y"].to_numpy())
        frames.append(pd.DataFrame({"held_out": f"{by}={v:g}", "predicted": pred, "observed": obs,
                                    "log_ratio": np.log(pred / obs)}).reset_index())
    return pd.concat(frames, ignore_index=True)


def held_out_summary(errors: pd.DataFrame, level: float = PI_LEVEL) -> dict:
    e = errors["log_ratio"].to_numpy()
    a = (1 - level) / 2
    return {"n": int(e.size), "rmse_log": float(np.sqrt(np.mean(e**2))), "bias_log": float(e.mean()),
            "q_lo": float(np.quantile(e, a)), "q_hi": float(np.quantile(e, 1 - a)), "level": level}


def predict_paper(fit: ScalingFit, errors: pd.DataFrame, *, setting=None, w_range=PAPER_W_RANGE,
                  level: float = PI_LEVEL) -> dict:
    """Predicted pooled std(g) of the paper's adapter (``setting``: :data:`PAPER_SETTING`) at the ends and the
    geometric middle of ``w_range``, with the held-out interval (point / exp(q_hi) .. point / exp(q_lo): a model
    that over-predicted held-out runs by ``e`` is corrected by it) and the bf16/fp16 symmetric-zone fractions a
    normal g of that std would have, beside the paper's measured std."""
    from .trained import normal_zone_fraction

    p = {**PAPER_SETTING, **(setting or {})}
    L = cumulative_lr_cosine(p["lr"], p["steps"], p["warmup_frac"])
    q = held_out_summary(errors, level)
    out = {"setting": p, "L": L, "level": level, "held_out": q, "measured_g_std": p["g_std"], "by_w": []}
    for w in (w_range[0], math.sqrt(w_range[0] * w_range[1]), w_range[1]):
        X = pd.DataFrame({"log_L": [math.log(L)], "log_t": [math.log(p["steps"])], "log_w": [math.log(w)],
                          "log_r": [math.log(p["rank"])]})
        point = float(np.exp(fit.predict_log(X))[0])
        lo, hi = point / math.exp(q["q_hi"]), point / math.exp(q["q_lo"])
        out["by_w"].append({"w": w, "g_std": point, "lo": lo, "hi": hi,
                            "measured_inside": bool(lo <= p["g_std"] <= hi),
                            "bf16_sym_normal": normal_zone_fraction(point, "bf16"),
                            "fp16_sym_normal": normal_zone_fraction(point, "fp16")})
    out["lo"] = min(b["lo"] for b in out["by_w"])
    out["hi"] = max(b["hi"] for b in out["by_w"])
    out["measured_inside"] = bool(out["lo"] <= p["g_std"] <= out["hi"])
    return out


# --------------------------------------------------------------------------
# What notebook 01 records of it
# --------------------------------------------------------------------------

def _joined(values) -> str:
    return ";".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def fractions_for_table(frac: pd.DataFrame) -> pd.DataFrame:
    """:func:`fraction_table` with its list columns (seeds, steps) ``;``-joined, as a CSV keeps them."""
    return frac.assign(seeds=frac["seeds"].map(_joined), steps=frac["steps"].map(_joined))


def scaling_record(stats: pd.DataFrame, *, level: float = PI_LEVEL) -> dict:
    """The scaling model as pre-registered: the fit on every standard capture, the held-out errors by learning
    rate (the pre-registered check) and by rank (the second), and :func:`predict_paper` from the lr hold-out."""
    d = design(stats)
    fit = fit_scaling(d)
    by_lr, by_rank = held_out(d, "lr"), held_out(d, "rank")
    return {"fit": {"coef": fit.coef, "se": fit.se, "resid_sd": fit.resid_sd, "n": fit.n,
                    "features": list(fit.features)},
            "held_out_lr": held_out_summary(by_lr, level), "held_out_rank": held_out_summary(by_rank, level),
            "held_out_lr_by_value": {k: held_out_summary(g, level) for k, g in by_lr.groupby("held_out")},
            "paper": predict_paper(fit, by_lr, level=level)}


def scaling_markdown(rec: dict) -> str:
    """The scaling model's result in words, every number from ``rec`` (:func:`scaling_record`)."""
    c, lr, rk, p = rec["fit"]["coef"], rec["held_out_lr"], rec["held_out_rank"], rec["paper"]
    mid = p["by_w"][1]
    inside = [b["w"] for b in p["by_w"] if b["measured_inside"]]
    where = ("at none of the three" if not inside else
             "at every one" if len(inside) == len(p["by_w"]) else
             "only at ||W_j|| = " + ", ".join(f"{w:.2g}" for w in inside))
    return (f"Fitted on {rec['fit']['n']:,} (run, capture, module, ||W_j|| tercile) rows: rms(g - 1) ~ "
            f"L^{c['log_L']:.2f} t^{c['log_t']:.2f} ||W_j||^{c['log_w']:.2f} r^{c['log_r']:.2f}. "
            f"Held out by learning rate (fit on one, predict the other: the tenfold extrapolation the paper's "
            f"lr asks for) its pooled RMS per held-out capture is off by a factor {math.exp(lr['rmse_log']):.2g} "
            f"(rms of the log ratio {lr['rmse_log']:.2f}, {lr['n']} captures; {lr['level']:.0%} of the ratios "
            f"within {math.exp(lr['q_lo']):.2g}x to {math.exp(lr['q_hi']):.2g}x); held out by rank by a factor "
            f"{math.exp(rk['rmse_log']):.2g}. For the paper's adapter (r = {p['setting']['rank']}, its recipe "
            f"assumed: lr {p['setting']['lr']:g}, {p['setting']['steps']} steps, cosine) it predicts std(g) "
            f"{mid['g_std']:.2g} ({p['level']:.0%}: {mid['lo']:.2g} to {mid['hi']:.2g}) at ||W_j|| = "
            f"{mid['w']:.2g}, {p['lo']:.2g} to {p['hi']:.2g} over ||W_j|| in {p['by_w'][0]['w']:.2g} to "
            f"{p['by_w'][-1]['w']:.2g}; the measured {p['measured_g_std']:g} lies inside the interval {where}.")
