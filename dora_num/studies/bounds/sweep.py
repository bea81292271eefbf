"""Notebook 03: measured error vs a-priori bound, ground-truth throughput, and the
conditioning of the factored norm.

Everything here *uses* :mod:`dora_num.numerics` (formulas, emulated arithmetics,
ground truth, bounds); it defines no formula of its own.

The method in full: docs/methods.md, studies/bounds/sweep.py.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch

from ...numerics import formulas as F
from ...numerics.bounds import (assembly_bound, assembly_condition, compose_bound, dense_norm_bound,
                               factored_norm_bound, factored_norm_posterior, lora_row_magnitudes)
from ...numerics.emulate import VARIANTS, emulate
from ...numerics.formats import FORMATS, STUDIED_FORMATS, get_format, ulp_distance
from ...numerics.ground_truth import assembly_exact, compose_exact, mp_dense_row_norm, mp_factored_terms
from ...ops.guard import CANCELLATION_REL
from ...ops.norm import base_row_norm_sq, dense_row_norm, factored_row_norm
from .. import inputs
from ..inputs import REGIMES

COMBOS = [("per_op", "storage"), ("fp32", "fp32"), ("fp32", "storage"), ("fp32_fma", "fp32"), ("fp32_fma", "storage")]


def _errors(out, truth, bound, out_fmt) -> dict:
    """Per-element error metrics; non-finite outputs count as infinite errors."""
    err = np.abs(out - truth.value)
    err = np.where(np.isfinite(out), err, np.inf)
    both = np.isfinite(out) & np.isfinite(truth.rounded)
    ulps = np.full(out.shape, np.nan)
    if both.any():
        ulps[both] = np.abs(ulp_distance(out[both], truth.rounded[both], out_fmt))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(truth.value != 0, err / np.abs(truth.value), np.where(err == 0, 0.0, np.inf))
        ratio = np.where(bound > 0, err / bound, np.where(err == 0, 0.0, np.inf))
    finite_b = np.isfinite(bound)
    return {"err": err, "bound": bound, "ulps": ulps, "rel": rel, "ratio": np.where(finite_b, ratio, np.nan),
            "violation": finite_b & ~(err <= bound)}


def _summary(m: dict) -> dict:
    fb = np.isfinite(m["bound"])
    ulps, rel = m["ulps"][fb], m["rel"][fb]
    return {
        "n": int(m["err"].size),
        "n_no_bound": int((~fb).sum()),  # overflow possible: no finite bound exists
        "violations": int(m["violation"].sum()),
        "tightness": float(np.nanmax(m["ratio"])) if fb.any() else np.nan,
        "ratio_p50": float(np.nanmedian(m["ratio"])) if fb.any() else np.nan,
        "max_err": float(m["err"][fb].max()) if fb.any() else np.nan,
        "max_rel_err": float(rel[np.isfinite(rel)].max()) if np.isfinite(rel).any() else np.nan,
        "max_rel_bound": float(np.nanmax(np.where(m["err"][fb] >= 0, m["bound"][fb], np.nan)
                                         / np.maximum(np.abs(m["err"][fb] * 0 + 1), 1))) if fb.any() else np.nan,
        "max_ulps": float(np.nanmax(ulps)) if np.isfinite(ulps).any() else np.nan,
        "frac_exact": float(np.nanmean(ulps == 0)) if np.isfinite(ulps).any() else np.nan,
    }


def sweep(n: int, *, seed: int = 0, formats=STUDIED_FORMATS, regimes=REGIMES, sample: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measured error vs bound for every formula, format, arithmetic and regime.

    Returns ``(summary, samples)``: one summary row per (formula, format, variant,
    g_in, regime) and, if ``sample > 0``, that many per-element rows per
    combination (error, bound, |g-1|, kappa) for plots.
    """
    rows, samp = [], []
    for fname in formats:
        fmt = get_format(fname)
        for regime in regimes:
            ci = inputs.compose(fmt, regime, n, seed)
            truth = compose_exact(ci["base"], ci["lora"], ci["g"], ci["s"], fmt)
            for formula in ("compose_naive", "compose_stable"):
                for variant, g_in in COMBOS:
                    out = emulate(formula, ci, fmt, variant, g_in)
                    bound = compose_bound(formula, ci["base"], ci["lora"], ci["g"], ci["s"], fmt, variant, g_in)
                    m = _errors(out, truth, bound, fmt)
                    rows.append({"formula": formula, "format": fmt.name, "variant": variant, "g_in": g_in,
                                 "regime": regime, "n_fallback": truth.n_fallback, **_summary(m)})
                    if sample:
                        idx = np.random.default_rng(seed).choice(n, min(sample, n), replace=False)
                        samp.append(pd.DataFrame({"formula": formula, "format": fmt.name, "variant": variant,
                                                  "g_in": g_in, "regime": regime, "abs_gm1": np.abs(ci["g"][idx] - 1),
                                                  "err": m["err"][idx], "bound": m["bound"][idx],
                                                  "rel": m["rel"][idx], "ulps": m["ulps"][idx]}))
            ai = inputs.assembly(fmt, regime, n, seed)
            kappa = assembly_condition(ai["base_sq"], ai["cross"], ai["ba"], ai["s"])
            for variant in VARIANTS:
                out_fmt = fmt if variant == "per_op" else FORMATS["fp32"]
                truth = assembly_exact(ai["base_sq"], ai["cross"], ai["ba"], ai["s"], out_fmt)
                out = emulate("norm_assembly", ai, fmt, variant)
                bound = assembly_bound(ai["base_sq"], ai["cross"], ai["ba"], ai["s"], fmt, variant)
                m = _errors(out, truth, bound, out_fmt)
                rows.append({"formula": "norm_assembly", "format": fmt.name, "variant": variant, "g_in": "-",
                             "regime": regime, "n_fallback": truth.n_fallback, **_summary(m)})
                if sample:
                    idx = np.random.default_rng(seed).choice(n, min(sample, n), replace=False)
                    samp.append(pd.DataFrame({"formula": "norm_assembly", "format": fmt.name, "variant": variant,
                                              "g_in": "-", "regime": regime, "kappa": kappa[idx],
                                              "err": m["err"][idx], "bound": m["bound"][idx],
                                              "rel": m["rel"][idx], "ulps": m["ulps"][idx]}))
    summary = pd.DataFrame(rows).drop(columns=["max_rel_bound"])
    return summary, (pd.concat(samp, ignore_index=True) if samp else pd.DataFrame())


# --------------------------------------------------------------------------
# Conditioning: factored vs dense row norms.
# --------------------------------------------------------------------------

def conditioning(rows: int = 64, d_in: int = 256, r: int = 8, *, seed: int = 0, tau_min: float = 1e-6,
                 tau_max: float = 1.0, scale: float = inputs.BOUNDS_SCALE) -> pd.DataFrame:
    """Relative error of the factored and dense fp32 row norms (``dora_num.ops``) against
    the exact norm, with the condition number and both a-priori bounds, one row per row.

    Columns: ``kappa`` (exact terms), ``log10_kappa``, ``exact``, ``factored`` (the bare factored
    norm, ``on_cancellation="off"``), ``guarded`` (the default: rows whose guaranteed bound
    exceeds ``2^-6`` recomputed in float64, :mod:`dora_num.ops.guard`), ``dense``,
    ``bound_factored``, ``bound_dense`` (absolute), ``err_*``, ``rel_*``, ``ulps_*``;
    ``kappa_post`` and ``rel_bound_post``: the a-posteriori condition and relative bound
    computed from the fp32 terms alone (:func:`~dora_num.numerics.bounds.factored_norm_posterior`,
    what the cancellation guard evaluates), ``err_factored <= rel_bound_post * factored``;
    ``recomputed``: the rows the guard flags (``rel_bound_post > 2^-6``)."""
    W, A, B, s = inputs.conditioning_rows(rows, d_in, r, seed=seed, tau_min=tau_min, tau_max=tau_max, scale=scale)
    exact = mp_dense_row_norm(W, A, B, s)
    terms = mp_factored_terms(W, A, B)
    _, two_s, s_sq = F.scale_constants(s)
    S = np.abs(terms["base"].value) + np.abs(two_s * terms["cross"].value) + s * s * np.abs(terms["ba"].value)
    with np.errstate(divide="ignore"):
        kappa = S / exact.value**2
    t = lambda x: torch.from_numpy(x.astype(np.float32))  # noqa: E731
    Wt, At, Bt = t(W), t(A), t(B)
    fac = factored_row_norm(Wt, At, Bt, s, on_cancellation="off").double().numpy()
    guarded = factored_row_norm(Wt, At, Bt, s).double().numpy()
    den = dense_row_norm(Wt, At, Bt, s).double().numpy()
    # the fp32 terms as the torch tail of the factored norm holds them (dora_num.ops.norm)
    base32 = base_row_norm_sq(Wt)
    U, G = Wt @ At.T, At @ At.T
    cross32, ba32 = (Bt * U).sum(1), ((Bt @ G) * Bt).sum(1)
    lora_abs, b_abs = lora_row_magnitudes(Bt, G, d_in=d_in)
    kappa_post, rel_post = factored_norm_posterior(base32, cross32, ba32, two_s, s_sq, d_in=d_in, r=r,
                                                   lora_abs=lora_abs, b_abs=b_abs)
    out = pd.DataFrame({"row": np.arange(rows), "kappa": kappa, "log10_kappa": np.log10(kappa), "exact": exact.value,
                        "factored": fac, "guarded": guarded, "dense": den,
                        "bound_factored": factored_norm_bound(W, A, B, s),
                        "bound_dense": dense_norm_bound(W, A, B, s),
                        "kappa_post": kappa_post.double().numpy(), "rel_bound_post": rel_post.double().numpy(),
                        "recomputed": (rel_post > CANCELLATION_REL).numpy()})
    for k in ("factored", "guarded", "dense"):
        out[f"err_{k}"] = np.abs(out[k] - out["exact"])
        with np.errstate(divide="ignore", invalid="ignore"):
            out[f"rel_{k}"] = np.where(out["exact"] > 0, out[f"err_{k}"] / out["exact"],
                                       np.where(out[f"err_{k}"] == 0, 0.0, np.inf))
        out[f"ulps_{k}"] = np.abs(ulp_distance(out[k].to_numpy(), exact.rounded, "fp32"))
    return out


LOG10_KAPPA_BINS = (0, 2, 4, 6, 8, 10, 12, 14, 16, 20)


def conditioning_table(cond: pd.DataFrame) -> pd.DataFrame:
    """Median relative errors and bounds per bin of ``log10(kappa)`` (the index is named so)."""
    bins = pd.cut(cond["log10_kappa"], bins=list(LOG10_KAPPA_BINS), include_lowest=True)
    rel_b = cond.assign(rel_bound_factored=cond["bound_factored"] / cond["exact"],
                        rel_bound_dense=cond["bound_dense"] / cond["exact"])
    t = (rel_b.groupby(bins, observed=True)[["rel_factored", "rel_guarded", "rel_dense", "rel_bound_factored",
                                             "rel_bound_dense", "rel_bound_post"]].median()
         .assign(factored_over_dense=lambda d: d["rel_factored"] / d["rel_dense"],
                 rows=rel_b.groupby(bins, observed=True).size(),
                 recomputed=rel_b.groupby(bins, observed=True)["recomputed"].sum()))
    t.index.name = "log10(kappa)"
    return t


def conditioning_markdown(cond: pd.DataFrame, scale: float, tau_min: float) -> str:
    """What holds, where, and what does not, in the conditioning study (generated from ``cond``)."""
    lk = cond["log10_kappa"]
    fin_f, fin_d = np.isfinite(cond["bound_factored"]), np.isfinite(cond["bound_dense"])
    ok_f = bool((cond["err_factored"] <= cond["bound_factored"]).all())
    ok_d = bool((cond["err_dense"] <= cond["bound_dense"]).all())
    post = np.isfinite(cond["rel_bound_post"])
    ok_p = bool((cond.loc[post, "err_factored"] <= cond.loc[post, "rel_bound_post"] * cond.loc[post, "exact"]).all())
    rel_bf = cond["bound_factored"] / cond["exact"]
    vac_f = lk[rel_bf >= 1].min() if (rel_bf >= 1).any() else np.nan
    lead_f = lk[cond["rel_factored"] >= 0.5].min() if (cond["rel_factored"] >= 0.5).any() else np.nan
    lead_d = lk[cond["rel_dense"] >= 0.5].min() if (cond["rel_dense"] >= 0.5).any() else np.nan
    post_max = lk[post].max() if post.any() else np.nan
    ratio_gd = cond["err_guarded"] / cond["bound_dense"]
    ok_gd = cond["err_guarded"] <= cond["bound_dense"]
    return "\n\n".join([
        f"**Setting.** s = fl32({scale:.6g}) (s^2 inexact in fp32 unless s is a power of two), "
        f"tau from 1 down to {tau_min:g}: log10(kappa) from {lk.min():.1f} to {lk.max():.1f}, {len(cond)} rows.",
        f"**What holds.** Every measured error is within its a-priori bound: factored {'yes' if ok_f else '**NO**'}, "
        f"dense {'yes' if ok_d else '**NO**'}; no bound is NaN ({int((~fin_f).sum())} factored and "
        f"{int((~fin_d).sum())} dense bounds are inf: overflow possible). The guard's a-posteriori bound from the "
        f"fp32 terms alone holds on every row where it is finite ({'yes' if ok_p else '**NO**'}), which is up to "
        f"log10(kappa) = {post_max:.1f}; beyond, it is inf (the row must be recomputed).",
        f"**The guard.** The guarded factored norm (the default of `dora_num.ops`) recomputes the "
        f"{int(cond['recomputed'].sum())} rows whose a-posteriori bound exceeds 2^-6 (from log10(kappa) = "
        f"{(lk[cond['recomputed']].min() if cond['recomputed'].any() else np.nan):.1f}) in float64; it is within "
        f"the dense norm's a-priori bound on {int(ok_gd.sum())} of {len(cond)} rows "
        f"(largest error / dense bound {float(ratio_gd.max()):.2g}; the bare factored norm exceeds it on "
        f"{int((cond['err_factored'] > cond['bound_dense']).sum())} rows) and its largest relative error is "
        f"{float(cond['rel_guarded'].max()):.2g}.",
        f"**Where it stops meaning much.** The factored bound reaches a relative size 1 (no correct digit "
        f"guaranteed) from log10(kappa) = {vac_f:.1f}; the factored norm's measured error reaches 50% from "
        f"log10(kappa) = {lead_f:.1f}, the dense norm's "
        + (f"from {lead_d:.1f}" if np.isfinite(lead_d) else f"never up to log10(kappa) = {float(lk.max()):.1f}")
        + ". The dense norm degrades like sqrt(kappa), the bare factored one like kappa.",
    ])


# --------------------------------------------------------------------------
# Throughput of the ground truth.
# --------------------------------------------------------------------------

def bench(n: int = 2_000_000, repeats: int = 5, fmt: str = "bf16", seed: int = 0) -> dict:
    """Wall time of :func:`compose_exact` (correctly rounded, certified) on ``n`` realistic elements."""
    ci = inputs.compose(fmt, "realistic", n, seed)
    times, fallback = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tr = compose_exact(ci["base"], ci["lora"], ci["g"], ci["s"], fmt)
        times.append(time.perf_counter() - t0)
        fallback = tr.n_fallback
    return {"n": n, "format": fmt, "repeats": repeats, "median_s": float(np.median(times)),
            "min_s": float(np.min(times)), "max_s": float(np.max(times)), "n_fallback": fallback,
            "elements_per_s": float(n / np.median(times))}

