"""The figures of notebook 03: one function per figure, named like the file the
notebook saves it as, each taking the notebook's tidy tables and returning a
matplotlib figure (every notebook's figures live in its study folder's ``plots.py``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from ...numerics.formats import STUDIED_FORMATS


# g - 1 ticks of the exhaustive panels (symlog, linthresh 2^-24): every third decade; at every second
# the labels -10^-2 and -10^-4 of a 4.2-inch panel overlapped (the layout check, dora_num/repro/layout.py)
EXHAUSTIVE_G_TICKS = [-1e-2, -1e-5, 0, 1e-5, 1e-2]


def error_vs_bound(samples: pd.DataFrame):
    """Per-element measured relative error against the relative a-priori bound, per formula."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (formula, d) in zip(axes, samples.groupby("formula")):
        d = d[np.isfinite(d["bound"]) & (d["bound"] > 0) & (d["err"] > 0) & np.isfinite(d["rel"])]
        d = d.assign(rel_bound=d["bound"] * d["rel"] / d["err"])  # bound / |exact|
        sns.scatterplot(data=d, x="rel_bound", y="rel", hue="variant", s=8, alpha=0.5, ax=ax, linewidth=0,
                        rasterized=True, legend=ax is axes[-1])
        lo, hi = d["rel_bound"].min(), d["rel_bound"].max()
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="error = bound")
        ax.set(xscale="log", yscale="log", title=formula, xlabel="bound / |exact|", ylabel="measured relative error")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Measured relative error vs relative a-priori bound (every point lies on or below the dashed line)")
    return fig


def max_ulps(summary: pd.DataFrame):
    """Largest error in ULPs of the output format, per formula, format and arithmetic."""
    ulp = (summary.assign(arith=summary["variant"] + " / g " + summary["g_in"])
           .groupby(["formula", "format", "arith"], as_index=False)["max_ulps"].max())
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharey=True)
    for ax, (formula, d) in zip(axes, ulp.groupby("formula")):
        d.pivot(index="format", columns="arith", values="max_ulps").plot.bar(ax=ax, logy=True, legend=ax is axes[-1])
        ax.tick_params(axis="x", rotation=90)  # fp8_e4m3fn and fp8_e5m2 side by side overlap horizontally
        ax.set(title=formula, ylabel="max error (ULPs of the output format)")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def factored_vs_dense(cond: pd.DataFrame):
    """Relative error of the factored and dense norms against the assembly's condition number, with bounds."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, c in (("factored", "C0"), ("dense", "C1")):
        ax.scatter(cond["kappa"], cond[f"rel_{k}"].clip(lower=1e-10), s=14, color=c, label=f"{k}: measured")
        ax.plot(cond["kappa"], cond[f"bound_{k}"] / cond["exact"], color=c, lw=1, ls="--", label=f"{k}: bound")
    u = 2.0**-24
    ax.plot(cond["kappa"], u * cond["kappa"], "k:", lw=1, label="u * kappa")
    ax.plot(cond["kappa"], u * np.sqrt(cond["kappa"]), "k-.", lw=1, label="u * sqrt(kappa)")
    if "rel_guarded" in cond:  # the operator's default: rows the guard cannot certify recomputed in float64
        ax.scatter(cond["kappa"], cond["rel_guarded"].clip(lower=1e-10), s=18, color="C2", marker="x",
                   label="factored, guarded (default): measured")
    if "rel_bound_post" in cond:  # the a-posteriori bound the cancellation guard evaluates (finite rows)
        post = np.isfinite(cond["rel_bound_post"])
        ax.plot(cond.loc[post, "kappa"], cond.loc[post, "rel_bound_post"], color="C2", lw=1, ls="-.",
                label="factored: guard's bound")
    ax.set(xscale="log", yscale="log", xlabel="condition number kappa of the assembly (log scale)",
           ylabel="relative error of the row norm (fp32)", title="Factored vs dense row norm (exact reference: mpmath)")
    ax.legend(fontsize=7)
    return fig


def exhaustive_tightness(ex: pd.DataFrame):
    """Every (base, lora) pair of each format (:mod:`dora_num.studies.bounds.exhaustive`): the
    largest error / bound over the pairs against ``g - 1`` (symlog), one panel per format, one
    line per formula x arithmetic, every ``s``; at most 1 everywhere (the dashed line), and 1
    where the bound is attained."""
    fmts = [f for f in STUDIED_FORMATS if f in set(ex["format"])]
    fig, axes = plt.subplots(1, len(fmts), figsize=(4.2 * len(fmts), 3.4), squeeze=False, sharey=True)
    for ax, f in zip(axes[0], fmts):
        d = ex[ex["format"] == f].groupby(["formula", "arith", "g_minus_1"], as_index=False)["max_err_over_bound"].max()
        for (formula, arith), dd in d.groupby(["formula", "arith"]):
            ax.plot(dd["g_minus_1"], dd["max_err_over_bound"], marker="o", ms=3, lw=1,
                    label=f"{formula.removeprefix('compose_')}, {arith}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("symlog", linthresh=2.0**-24)
        ax.set_xticks(EXHAUSTIVE_G_TICKS)
        ax.set(title=f"{f}: every (base, lora) pair", xlabel="g - 1", ylabel="max error / bound (over s too)",
               ylim=(0, 1.05))
    axes[0][-1].legend(fontsize=7)
    return fig
