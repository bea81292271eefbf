"""Statistics of notebook 04: does fused DoRA training stay as close to eager as rounding alone does?

Data: per-step loss curves ``L_r(t)``, ``t = 1..n``, of runs ``r`` identified by
``(path, seed, repeat)`` and ``perturbed``: per seed eager, fused and eager runs with every ``m``
moved by one ulp (the same-batch floor), plus a repeat of one eager seed.  All runs of one seed see
the same adapter init and the same batches; runs of different seeds see different batches.

The method in full: docs/methods.md, studies/convergence/equivalence.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats

MARGIN_FRACTION = 0.25  # the signed-mean TOST's margin: this fraction of the different-batch seed-to-seed floor
ALPHA = 0.05  # level of every one-sided test
MIN_BLOCKS = 8  # fewer independent block means than this: no verdict
SOKAL_C = 5.0  # automatic window: the smallest W with W >= c * tau_int(W)
RUN_KEYS = ("path", "seed", "repeat")

# The paper's convergence numbers (docs/paper.md, Zelenin & Zhuravlyova 2026; Qwen3.5-9B,
# 2000 steps, 3 seeds) -- reported beside ours, never used in a computation.
PAPER = {
    "fused_vs_eager_mean_abs_delta": 7.1e-4,
    "fused_vs_eager_mean_abs_delta_per_seed": (7.2e-4, 6.9e-4, 7.1e-4),
    "fused_vs_eager_max_abs_delta": 1.1e-2,
    "fused_vs_eager_max_step": 398,
    "final_eval_abs_delta_mean": 8.9e-5,
    "final_eval_abs_delta_max": 1.5e-4,
    "seed_to_seed_mean_abs_delta_low": 7.6e-4,
    "seed_to_seed_mean_abs_delta_high": 8.5e-4,
    "wall_minutes_fused": 330.0,
    "wall_minutes_eager": 360.0,
}


# --------------------------------------------------------------------------
# Series helpers
# --------------------------------------------------------------------------

def _series(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        raise ValueError("series must not be empty")
    if not np.all(np.isfinite(a)):
        raise ValueError("series contains NaN or Inf")
    return a


def delta_summary(a, b, steps=None) -> dict:
    """``mean |a-b|``, ``max |a-b|`` and the step of the max (first on ties), the final
    ``|a-b|``, how many steps are bitwise equal and the first step that is not
    (``first_diff_step``, -1 if none: the two runs never part)."""
    a, b = _series(a), _series(b)
    if a.shape != b.shape:
        raise ValueError(f"series must have equal length, got {a.size} and {b.size}")
    steps = np.arange(1, a.size + 1) if steps is None else np.asarray(steps)
    d = np.abs(a - b)
    i = int(np.argmax(d))
    return {"mean_abs": float(d.mean()), "max_abs": float(d[i]), "step_of_max": int(steps[i]),
            "final_abs": float(d[-1]), "n": int(a.size), "bitwise_equal_steps": int(np.sum(a == b)),
            "first_diff_step": int(steps[np.argmax(a != b)]) if np.any(a != b) else -1}


def integrated_autocorr_time(x) -> float:
    """``tau_int = 1 + 2 sum_{k>=1} rho(k)`` with Sokal's automatic window.

    The window is the smallest ``W`` with ``W >= SOKAL_C * tau(W)``; a constant
    series has ``tau = 1`` (nothing to correct).  ``tau`` is the factor by which
    correlation inflates the variance of a mean: ``var(mean) = tau * var / n``.
    """
    x = _series(x)
    n = x.size
    x = x - x.mean()
    var = float(np.dot(x, x)) / n
    if n < 3 or var == 0.0:
        return 1.0
    f = np.fft.rfft(x, 2 * n)
    acov = np.fft.irfft(f * np.conj(f))[:n] / n
    rho = acov / acov[0]
    tau = 1.0
    for w in range(1, n):
        tau += 2.0 * rho[w]
        if w >= SOKAL_C * tau:
            break
    return max(float(tau), 1.0)


@dataclass
class Blocks:
    means: np.ndarray
    size: int
    tau_int: float
    lag1_corr: float  # of the block means (diagnostic: should be near 0)


def block_means(x, *, size: int | None = None) -> Blocks:
    """Non-overlapping block means, ``size = max(ceil(sqrt n), ceil(2 tau_int))`` by default.

    The leading ``n mod size`` steps are dropped (the start of training, where
    every difference series is smallest, so dropping it never helps a verdict).
    """
    x = _series(x)
    n = x.size
    tau = integrated_autocorr_time(x)
    if size is None:
        size = max(math.ceil(math.sqrt(n)), math.ceil(2.0 * tau))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    k = n // size
    if k == 0:
        return Blocks(np.empty(0), size, tau, float("nan"))
    m = x[n - k * size:].reshape(k, size).mean(axis=1)
    lag1 = float(np.corrcoef(m[:-1], m[1:])[0, 1]) if k > 2 and np.std(m) > 0 else float("nan")
    return Blocks(m, size, tau, lag1)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------

def _t_stats(m: np.ndarray) -> tuple[float, float, int]:
    k = m.size
    se = float(np.std(m, ddof=1) / math.sqrt(k)) if k > 1 else float("inf")
    return float(m.mean()), se, k - 1


def _one_sided_less(mean: float, se: float, df: int, bound: float) -> float:
    """p-value of ``H0: mu >= bound`` vs ``H1: mu < bound``."""
    if se == 0.0:
        return 0.0 if mean < bound else 1.0
    return float(stats.t.cdf((mean - bound) / se, df))


def tost(d, margin: float, *, alpha: float = ALPHA, block_size: int | None = None) -> dict:
    """Two one-sided t-tests of ``|mean d| < margin`` on the block means of ``d``."""
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"margin must be positive and finite, got {margin}")
    b = block_means(d, size=block_size)
    k = b.means.size
    if k < MIN_BLOCKS:
        return {"test": "tost", "equivalent": False, "p": 1.0, "reason": f"only {k} blocks (< {MIN_BLOCKS})",
                "blocks": k, "block_size": b.size, "tau_int": b.tau_int, "margin": margin}
    mean, se, df = _t_stats(b.means)
    p_upper = _one_sided_less(mean, se, df, margin)  # H0: mu >= +margin
    p_lower = _one_sided_less(-mean, se, df, margin)  # H0: mu <= -margin
    p = max(p_upper, p_lower)
    tq = float(stats.t.ppf(1 - alpha, df))
    return {"test": "tost", "equivalent": bool(p < alpha), "p": p, "mean": mean, "se": se, "df": df,
            "ci_low": mean - tq * se, "ci_high": mean + tq * se,  # the (1 - 2 alpha) interval
            "margin": margin, "blocks": k, "block_size": b.size, "tau_int": b.tau_int, "lag1_corr": b.lag1_corr}


# --------------------------------------------------------------------------
# Runs (tidy frames) -> comparisons
# --------------------------------------------------------------------------

def _check_frame(df: pd.DataFrame, value: str) -> None:
    missing = [c for c in (*RUN_KEYS, "step", value) if c not in df.columns]
    if missing:
        raise ValueError(f"frame lacks columns {missing} (has {list(df.columns)})")


def curves(df: pd.DataFrame, value: str = "loss") -> dict[tuple, pd.Series]:
    """``{(path, seed, repeat): series indexed by step}`` from a wide or tidy frame.

    A tidy frame (columns ``metric``, ``value``) is filtered to ``metric == value``.
    """
    if "metric" in df.columns and value not in df.columns:
        df = df[df["metric"] == value].rename(columns={"value": value})
    _check_frame(df, value)
    out = {}
    for key, g in df.groupby(list(RUN_KEYS), sort=True):
        s = g.set_index("step")[value].sort_index()
        if s.index.has_duplicates:
            raise ValueError(f"run {key} has duplicate steps")
        out[tuple(key)] = s
    return out


def _aligned(a: pd.Series, b: pd.Series, ka, kb) -> tuple[pd.Series, pd.Series]:
    if not a.index.equals(b.index):
        raise ValueError(f"runs {ka} and {kb} are not on the same steps ({len(a)} vs {len(b)} steps)")
    return a, b


def pairs(runs: dict[tuple, pd.Series]) -> dict[str, list[tuple[tuple, tuple]]]:
    """Run pairs by kind: ``fused_vs_eager`` (same seed, repeat 0), ``seed_to_seed``
    (same path, repeat 0, seeds i < j), ``repeat`` (same path and seed, repeat 0 vs k)."""
    keys = sorted(runs)
    first = [k for k in keys if k[2] == 0]
    out = {"fused_vs_eager": [], "seed_to_seed": [], "repeat": []}
    for k in first:
        if k[0] == "eager" and ("fused", k[1], 0) in runs:
            out["fused_vs_eager"].append((k, ("fused", k[1], 0)))
    for a, b in itertools.combinations(first, 2):
        if a[0] == b[0] and a[1] != b[1]:
            out["seed_to_seed"].append((a, b))
    for k in keys:
        if k[2] != 0 and (k[0], k[1], 0) in runs:
            out["repeat"].append(((k[0], k[1], 0), k))
    return out


def delta_table(df: pd.DataFrame, value: str = "loss", *, relative: bool = False) -> pd.DataFrame:
    """One row per run pair: kind, runs, mean/max |delta| and the step of the max.

    ``relative``: deltas divided by the mean of the first run's series (gradient norms).
    """
    runs = curves(_split_perturbed(df)[0], value)  # 1-ulp runs: perturbation_deltas
    return pd.DataFrame([_delta_row(kind, value, ka, kb, *_aligned(runs[ka], runs[kb], ka, kb), relative)
                         for kind, ps in pairs(runs).items() for ka, kb in ps])


def _label(key: tuple) -> str:
    return "/".join(map(str, key))


def _delta_row(kind: str, value: str, ka: tuple, kb: tuple, a: pd.Series, b: pd.Series,
               relative: bool = False) -> dict:
    """One row of :func:`delta_table` / :func:`perturbation_deltas` (``relative``: deltas
    divided by the mean of ``|a|``)."""
    scale = float(np.mean(np.abs(a.to_numpy()))) if relative else 1.0
    return {"kind": kind, "metric": value, "relative": relative, "run_a": _label(ka), "run_b": _label(kb),
            "path_a": ka[0], "seed_a": ka[1], "path_b": kb[0], "seed_b": kb[1],
            **delta_summary(a.to_numpy() / scale, b.to_numpy() / scale, a.index.to_numpy())}


def _split_perturbed(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    if "perturbed" not in df.columns:
        return df, df.iloc[:0]
    p = df["perturbed"].astype(bool)
    return df[~p].drop(columns="perturbed"), df[p].drop(columns="perturbed")


def perturbation_pairs(df: pd.DataFrame, value: str = "loss") -> list[tuple[tuple, tuple, pd.Series, pd.Series]]:
    """``(key, key, series, series)`` for each eager seed recorded twice: as is, and with
    every ``m`` moved by 1 ulp at init (rows with ``perturbed`` true)."""
    plain, pert = _split_perturbed(df)
    if not len(pert):
        return []
    base, moved = curves(plain, value), curves(pert, value)
    out = []
    for k in sorted(moved):
        ka = (k[0], k[1], 0)
        if k[0] == "eager" and ka in base:
            a, b = _aligned(base[ka], moved[k], ka, k)
            out.append((ka, (*k, "ulp"), a, b))
    return out


def perturbation_deltas(df: pd.DataFrame, value: str = "loss") -> pd.DataFrame:
    """:func:`delta_table`'s rows (kind ``ulp_perturbation``) for each eager seed against
    itself with every ``m`` moved by 1 ulp: the smallest possible difference between two
    runs on the same batches, and how far it grows."""
    return pd.DataFrame([_delta_row("ulp_perturbation", value, ka, kb, a, b)
                         for ka, kb, a, b in perturbation_pairs(df, value)])


def rolling_abs_deltas(df: pd.DataFrame, value: str = "loss", window: int = 50) -> pd.DataFrame:
    """Rolling mean of ``|delta|`` per step for every pair of :func:`pairs` (unperturbed
    runs) and of :func:`perturbation_pairs`: columns step, ``|delta VALUE|``, kind, pair."""
    plain, _ = _split_perturbed(df)
    runs = curves(plain, value)
    items = [(kind, a, b, runs[a], runs[b]) for kind, ps in pairs(runs).items() for a, b in ps]
    items += [("ulp_perturbation", ka, kb, sa, sb) for ka, kb, sa, sb in perturbation_pairs(df, value)]
    frames = []
    for kind, ka, kb, sa, sb in items:
        d = (sb - sa).abs()
        frames.append(pd.DataFrame({"step": d.index, f"|delta {value}|":
                                    d.rolling(min(window, len(d)), min_periods=1).mean().to_numpy(),
                                    "kind": kind, "pair": _label(ka) + " vs " + _label(kb)}))
    return pd.concat(frames, ignore_index=True)


@dataclass(frozen=True)
class Margin:
    floor: float  # eager seed-to-seed mean |delta| (mean over seed pairs)
    fraction: float
    margin: float
    pairs: int
    per_pair: tuple[float, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def margin_from_eager(df: pd.DataFrame, value: str = "loss") -> Margin:
    """The equivalence margin, from **eager** runs only (fused rows are refused).

    Fixed before the fused runs are analysed: ``floor`` = mean over eager seed
    pairs of the per-step mean ``|delta|``; ``margin = MARGIN_FRACTION * floor``.
    Runs with ``perturbed`` true (1-ulp baseline) never enter it.
    """
    paths = set(df["path"].unique())
    if paths != {"eager"}:
        raise ValueError(f"margin_from_eager takes eager runs only, got paths {sorted(paths)}: "
                         "select df[df.path == 'eager'] so the margin cannot depend on the fused runs")
    runs = curves(_split_perturbed(df)[0], value)  # 1-ulp runs: perturbation_deltas
    per_pair = []
    for ka, kb in pairs(runs)["seed_to_seed"]:
        a, b = _aligned(runs[ka], runs[kb], ka, kb)
        per_pair.append(float(np.mean(np.abs(a.to_numpy() - b.to_numpy()))))
    if not per_pair:
        raise ValueError("need eager runs of at least two seeds for the seed-to-seed floor")
    floor = float(np.mean(per_pair))
    if not floor > 0:
        raise ValueError("the eager seed-to-seed floor is 0: seeds did not change the runs")
    return Margin(floor, MARGIN_FRACTION, MARGIN_FRACTION * floor, len(per_pair), tuple(per_pair))


# --------------------------------------------------------------------------
# The same-batch floor: fused against eager runs with m moved by one ulp
# --------------------------------------------------------------------------

FLOOR_MARGIN = 0.25  # fused may move the loss at most (1 + this) times as far as moving m by one ulp does
POWER_BETA = 0.2  # the power reported: the ratio the test confirms with probability 1 - this


_NO_VERDICT = {"within": False, "p": 1.0, "se": float("nan"), "df": 0, "ratio_high": float("nan"),
               "power_at_1": float("nan"), "ratio_confirmed": float("nan"), "lag1_corr": float("nan")}


def ratio_test(d_abs, floor_abs, *, margin: float = FLOOR_MARGIN, alpha: float = ALPHA,
               block_size: int | None = None) -> dict:
    """Is ``R = mean |d| / mean floor`` below ``1 + margin``?  One-sided, on block means.

    ``d_abs`` and ``floor_abs`` are per-step ``|delta|`` series of one seed, on the same steps (paired:
    both see the same batches). ``R`` is the ratio of their block means; its standard error is the ratio
    estimator's, from the block means of ``z = d - R floor`` (blocks sized from ``z``'s autocorrelation,
    :func:`block_means`). ``H0: R >= 1 + margin`` is rejected (``within`` true) when the one-sided
    ``1 - alpha`` upper bound ``ratio_high`` is below ``1 + margin``. ``power_at_1``: the probability of
    that verdict if the true ratio were 1 (fused exactly as far from eager as a one-ulp move);
    ``ratio_confirmed``: the largest true ratio the test confirms with probability ``1 - POWER_BETA``.
    No verdict (``within`` false, with a ``reason``) under ``MIN_BLOCKS`` blocks or where the floor is 0
    at every step.
    """
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"margin must be positive and finite, got {margin}")
    d, f = np.abs(_series(d_abs)), np.abs(_series(floor_abs))
    if d.shape != f.shape:
        raise ValueError(f"series must have equal length, got {d.size} and {f.size}")
    bound = 1.0 + margin
    if not f.mean() > 0:  # the replicates never left the baseline: nothing to measure a ratio against
        return {"test": "ratio_to_floor", "margin": margin, "bound": bound, "blocks": 0, "block_size": 0,
                "mean_abs": float(d.mean()), "floor_mean_abs": 0.0, **_NO_VERDICT, "ratio": float("nan"),
                "reason": "the floor is 0 at every step (the 1-ulp runs equal the baseline)"}
    r0 = float(d.mean() / f.mean())
    size = block_means(d - r0 * f, size=block_size).size
    bd, bf = block_means(d, size=size).means, block_means(f, size=size).means
    k = bd.size
    base = {"test": "ratio_to_floor", "margin": margin, "bound": bound, "blocks": k, "block_size": size,
            "mean_abs": float(d.mean()), "floor_mean_abs": float(f.mean())}
    if k < MIN_BLOCKS:
        return {**base, **_NO_VERDICT, "ratio": r0, "reason": f"only {k} blocks (< {MIN_BLOCKS})"}
    r = float(bd.mean() / bf.mean())
    z = bd - r * bf
    se = float(np.std(z, ddof=1) / (math.sqrt(k) * bf.mean()))
    df = k - 1
    tq = float(stats.t.ppf(1 - alpha, df))
    p = 0.0 if se == 0 else float(stats.t.cdf((r - bound) / se, df))
    return {**base, "within": bool(p < alpha), "p": p, "ratio": r, "se": se, "df": df, "reason": "",
            "ratio_high": r + tq * se,
            "power_at_1": 1.0 if se == 0 else float(stats.t.cdf(margin / se - tq, df)),
            "ratio_confirmed": bound - (tq + float(stats.t.ppf(1 - POWER_BETA, df))) * se,
            "lag1_corr": block_means(z, size=size).lag1_corr}


def same_batch_runs(df: pd.DataFrame, value: str = "loss") -> dict[int, dict]:
    """Per seed that has 1-ulp replicates: ``{"eager": series, "fused": series or None, "replicates":
    [series, ...]}`` (replicates in repeat order), all on the eager run's steps."""
    plain, pert = _split_perturbed(df)
    base, moved = curves(plain, value), curves(pert, value) if len(pert) else {}
    out: dict[int, dict] = {}
    for k in sorted(moved):
        path, seed, _ = k
        ka = ("eager", seed, 0)
        if path != "eager" or ka not in base:
            continue
        run = out.setdefault(seed, {"eager": base[ka], "fused": None, "replicates": []})
        run["replicates"].append(_aligned(base[ka], moved[k], ka, k)[1])
        kf = ("fused", seed, 0)
        if kf in base:
            run["fused"] = _aligned(base[ka], base[kf], ka, kf)[1]
    return out


def _abs_from(a: pd.Series, b: pd.Series) -> np.ndarray:
    return np.abs(b.to_numpy() - a.to_numpy())


def same_batch_verdict(df: pd.DataFrame, value: str = "loss", *, margin: float = FLOOR_MARGIN,
                       alpha: float = ALPHA) -> dict:
    """Fused against the same-batch floor, per seed, with the test's power shown on two controls.

    Per seed ``s``: the floor at each step is the mean over the 1-ulp replicates of ``|U_k - E|``
    (``E`` the eager run, ``U_k`` eager with every ``m`` moved by one ulp, random signs per replicate);
    the tested series is ``|F - E|`` (``F`` the fused run): :func:`ratio_test`. Controls, through the same
    test: **agree**, each replicate against the floor of the others (needs two or more replicates);
    **differ**, eager of another seed (different batches) against seed ``s``'s floor. The verdict holds
    when every seed's fused run is within and every control comes out as it must.
    """
    runs = same_batch_runs(df, value)
    if not runs:
        raise ValueError("no eager seed with 1-ulp replicates in the data: the same-batch floor needs them")
    plain = curves(_split_perturbed(df)[0], value)
    rows = []
    for seed, r in runs.items():
        E, U = r["eager"], r["replicates"]
        floor = np.mean([_abs_from(E, u) for u in U], axis=0)
        if r["fused"] is not None:
            rows.append({"seed": seed, "pair": "fused vs eager", "role": "tested", "replicates": len(U),
                         **ratio_test(_abs_from(E, r["fused"]), floor, margin=margin, alpha=alpha)})
        if len(U) >= 2:
            for k, u in enumerate(U):
                rest = np.mean([_abs_from(E, v) for j, v in enumerate(U) if j != k], axis=0)
                rows.append({"seed": seed, "pair": f"1-ulp replicate {k} vs eager", "role": "control: agree",
                             "replicates": len(U) - 1,
                             **ratio_test(_abs_from(E, u), rest, margin=margin, alpha=alpha)})
        other = next((k for k in sorted(plain) if k[0] == "eager" and k[1] != seed and k[2] == 0), None)
        if other is not None:
            o = _aligned(E, plain[other], ("eager", seed, 0), other)[1]
            rows.append({"seed": seed, "pair": f"eager seed {other[1]} vs eager (other batches)",
                         "role": "control: differ", "replicates": len(U),
                         **ratio_test(_abs_from(E, o), floor, margin=margin, alpha=alpha)})
    table = pd.DataFrame(rows)
    tested = table[table.role == "tested"]
    if tested.empty:
        raise ValueError("no fused run beside an eager seed with 1-ulp replicates")
    agree, differ = table[table.role == "control: agree"], table[table.role == "control: differ"]
    return {"equivalent": bool(tested.within.all()), "margin": margin, "alpha": alpha,
            "controls_as_expected": bool(agree.within.all() and not differ.within.any()),
            "fused_ratio_mean": float(tested.ratio.mean()), "seeds": sorted(int(s) for s in tested.seed),
            "table": table}


def tost_on_other_batches(df: pd.DataFrame, margin: Margin, value: str = "loss", *, alpha: float = ALPHA) -> dict:
    """The signed-mean TOST (:func:`tost`, at the seed-to-seed margin) applied to eager runs of the first two
    seeds: a pair known to differ (other batches at every step). It finds them "equivalent", since the mean
    of ``d`` is about 0 for any two unbiased runs: the row that shows why this test is not the verdict."""
    runs = curves(_split_perturbed(df)[0], value)
    eager = sorted(k for k in runs if k[0] == "eager" and k[2] == 0)
    if len(eager) < 2:
        raise ValueError("needs eager runs of two seeds")
    ka, kb = eager[:2]
    a, b = _aligned(runs[ka], runs[kb], ka, kb)
    t = tost(b.to_numpy() - a.to_numpy(), margin.margin, alpha=alpha)
    return {"seed": ka[1], "pair": f"eager seed {kb[1]} vs eager seed {ka[1]} (other batches)",
            "role": "dropped test: signed-mean TOST", "within": t["equivalent"], "p": t["p"],
            "bound": t["margin"], "mean_abs": float(np.mean(np.abs(b.to_numpy() - a.to_numpy()))),
            "blocks": t["blocks"], "block_size": t["block_size"]}


# --------------------------------------------------------------------------
# What the ratio test can see: the steps before two same-batch runs decorrelate
# --------------------------------------------------------------------------

SATURATION_WINDOW = 10  # steps of the trailing mean: one step's |delta| alone scatters about as widely as its mean
SATURATION_FRACTION = 0.9  # saturated: the trailing mean at this fraction of the late-run level


def late_level(abs_delta) -> float:
    """The late-run level of a per-step ``|delta|`` series: its mean over the second half of the steps
    (the later ``ceil(n / 2)``), where two runs that parted have long decorrelated."""
    x = np.abs(_series(abs_delta))
    return float(x[x.size // 2:].mean())


def saturation_step(abs_delta, steps=None, *, window: int = SATURATION_WINDOW,
                    fraction: float = SATURATION_FRACTION) -> int:
    """The first step at which the mean of ``abs_delta`` over the trailing ``window`` steps (that step and the
    ``window - 1`` before it) reaches ``fraction`` of :func:`late_level`: the step by which two runs have
    decorrelated into the regime they keep to the end. -1 when it never does (a series that stays 0, so has
    level 0, or one shorter than ``window``)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    x = np.abs(_series(abs_delta))
    steps = np.arange(1, x.size + 1) if steps is None else np.asarray(steps)
    if steps.shape != x.shape:
        raise ValueError(f"steps must match the series, got {steps.size} and {x.size}")
    level = late_level(x)
    if x.size < window or not level > 0:
        return -1
    trailing = np.convolve(x, np.ones(window), "valid") / window  # trailing[i]: steps i .. i + window - 1
    hit = np.flatnonzero(trailing >= fraction * level)
    return int(steps[hit[0] + window - 1]) if hit.size else -1


def _ratio(a: np.ndarray, b: np.ndarray) -> float:
    return float(a.mean() / b.mean()) if a.size and b.mean() > 0 else float("nan")


def early_window(df: pd.DataFrame, value: str = "loss", *, window: int = SATURATION_WINDOW,
                 fraction: float = SATURATION_FRACTION) -> pd.DataFrame:
    """Per seed with 1-ulp replicates and a fused run: where the ratio test's ``R`` comes from.

    Two runs on the same batches are bitwise equal until a rounding difference first changes a loss
    (``*_first_diff_step``, :func:`delta_summary`); within a few steps their ``|delta|`` then reaches the
    level it keeps to the end (:func:`saturation_step`, of the fused series ``|F - E|`` and of the floor,
    the mean over replicates of ``|U_k - E|``, as :func:`same_batch_verdict` takes it). The **early window**
    is steps 1 to ``window_end``, the later of the two saturation steps (the whole run where either never
    saturates): only there can the two series differ in level. ``early_ratio`` is the fused mean ``|delta|``
    over the floor's mean within it, ``late_ratio`` the same after it, where any two same-batch runs that
    have decorrelated sit at about 1 whatever parted them; ``early_share`` is the window's share of the steps.
    """
    rows = []
    for seed, r in same_batch_runs(df, value).items():
        if r["fused"] is None:
            continue
        E, F, U = r["eager"], r["fused"], r["replicates"]
        steps = E.index.to_numpy()
        d, f = _abs_from(E, F), np.mean([_abs_from(E, u) for u in U], axis=0)
        parted = [delta_summary(E.to_numpy(), u.to_numpy(), steps)["first_diff_step"] for u in U]
        sat_f, sat_d = (saturation_step(x, steps, window=window, fraction=fraction) for x in (f, d))
        n = steps.size
        end = n if -1 in (sat_f, sat_d) else int(np.searchsorted(steps, max(sat_f, sat_d)) + 1)  # steps in the window
        rows.append({"seed": seed, "replicates": len(U), "steps": n,
                     "fused_first_diff_step": delta_summary(E.to_numpy(), F.to_numpy(), steps)["first_diff_step"],
                     "floor_first_diff_step": min((p for p in parted if p > 0), default=-1),
                     "floor_saturation_step": sat_f, "fused_saturation_step": sat_d,
                     "floor_late_level": late_level(f), "fused_late_level": late_level(d),
                     "window_end": int(steps[end - 1]), "early_share": end / n,
                     "early_fused_mean_abs": float(d[:end].mean()), "early_floor_mean_abs": float(f[:end].mean()),
                     "early_ratio": _ratio(d[:end], f[:end]), "late_ratio": _ratio(d[end:], f[end:]),
                     "saturation_window": window, "saturation_fraction": fraction})
    if not rows:
        raise ValueError("no fused run beside an eager seed with 1-ulp replicates")
    return pd.DataFrame(rows)


def paper_comparison(losses: pd.DataFrame, evals: pd.DataFrame | None, verdict: dict,
                     seconds_per_step: dict[str, float] | None = None) -> pd.DataFrame:
    """Our numbers beside the paper's (docs/paper.md), one row per quantity, like for like.

    ``verdict``: :func:`same_batch_verdict`'s. The paper's seeds keep the batch order (its six logs have
    bit-identical first losses), so its seed-to-seed spread is a same-batch floor: set beside ours, the
    1-ulp replicates; our seeds change the batches, and that floor has no counterpart in the paper."""
    ulp = perturbation_deltas(losses, "loss")
    losses = _split_perturbed(losses)[0]
    evals = _split_perturbed(evals)[0] if evals is not None else None
    dt = delta_table(losses, "loss")
    fe, ss, rp = (dt[dt.kind == k] for k in ("fused_vs_eager", "seed_to_seed", "repeat"))
    tested = verdict["table"][verdict["table"].role == "tested"]
    floor_by_seed = ulp.groupby("seed_a").mean_abs.mean() if len(ulp) else pd.Series(dtype=float)
    # the paper's ratio: its mean over seeds over the midpoint of its floor's range (all it reports); ours the
    # same way, beside the ratio test's R (per seed, on block means), which the paper has no counterpart of
    paper_floor = np.mean([PAPER["seed_to_seed_mean_abs_delta_low"], PAPER["seed_to_seed_mean_abs_delta_high"]])
    floor_mid = np.mean([floor_by_seed.min(), floor_by_seed.max()]) if len(floor_by_seed) else np.nan
    rows = [
        ("fused vs eager mean |delta loss|", fe.mean_abs.mean(), PAPER["fused_vs_eager_mean_abs_delta"]),
        ("fused vs eager max |delta loss|", fe.max_abs.max(), PAPER["fused_vs_eager_max_abs_delta"]),
        ("same-batch floor mean |delta loss| (ours: eager with m moved 1 ulp; paper: seed to seed, batch order "
         "kept), min over seeds", floor_by_seed.min() if len(ulp) else np.nan, PAPER["seed_to_seed_mean_abs_delta_low"]),
        ("same-batch floor mean |delta loss|, max over seeds", floor_by_seed.max() if len(ulp) else np.nan,
         PAPER["seed_to_seed_mean_abs_delta_high"]),
        ("ratio fused-vs-eager / same-batch floor, the paper's way: fused vs eager mean |delta loss| over the "
         "midpoint of the floor's range over seeds", fe.mean_abs.mean() / floor_mid,
         PAPER["fused_vs_eager_mean_abs_delta"] / paper_floor),
        ("ratio fused-vs-eager / same-batch floor, the ratio test's R: per seed on block means, mean over seeds "
         "(no counterpart in the paper)", tested.ratio.mean(), np.nan),
        ("seed-to-seed mean |delta loss|, different batches (no counterpart in the paper)", ss.mean_abs.mean(),
         np.nan),
        ("same-seed repeat mean |delta loss|", rp.mean_abs.mean() if len(rp) else np.nan, np.nan),
        ("equivalence verdict against the same-batch floor (1 = equivalent)", float(verdict["equivalent"]),
         np.nan),
    ]
    if evals is not None and len(evals):
        ev = delta_table(evals, "val_loss")
        last = ev[ev.kind == "fused_vs_eager"].final_abs
        rows.append(("final eval |delta val loss| (mean over seeds)", last.mean(), PAPER["final_eval_abs_delta_mean"]))
    if seconds_per_step:
        rows.append(("time per step fused / eager", seconds_per_step["fused"] / seconds_per_step["eager"],
                     PAPER["wall_minutes_fused"] / PAPER["wall_minutes_eager"]))
    return pd.DataFrame(rows, columns=["quantity", "ours", "paper"])
