"""The figures of notebook 04: one function per figure, named like the file the
notebook saves it as, each taking the notebook's tidy tables and returning a
matplotlib figure (every notebook's figures live in its study folder's ``plots.py``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...repro.plotting import legend_outside
from .equivalence import Margin


def loss_curves(loss: pd.DataFrame, smooth: int):
    """Every run's loss, rolling mean over ``smooth`` steps (display only)."""
    s = loss.assign(run=lambda d: d.path + " s" + d.seed.astype(str) + d.repeat.map({0: "", 1: " (repeat)"})
                    + d.perturbed.map({False: "", True: " (m + 1 ulp)"}))
    s["loss (rolling mean)"] = s.groupby("run").loss.transform(
        lambda x: x.rolling(min(smooth, len(x)), min_periods=1).mean())
    fig, ax = plt.subplots(figsize=(8, 4))
    sns.lineplot(data=s, x="step", y="loss (rolling mean)", hue="run", style="path", ax=ax)
    ax.set_yscale("log")
    legend_outside(ax)
    return fig


def deltas_vs_floor(rows: pd.DataFrame, margin: Margin):
    """Rolling ``|delta loss|`` of every pair (:func:`~dora_num.studies.convergence.equivalence.rolling_abs_deltas`)
    beside the different-batch floor (seed to seed) and the margin of the TOST this study no longer decides by
    (context: the floor that decides is ``ulp_perturbation``, the same batches with m moved by 1 ulp)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    palette = {"fused_vs_eager": "C0", "seed_to_seed": "C1", "repeat": "C2", "ulp_perturbation": "C4"}
    sns.lineplot(data=rows, x="step", y="|delta loss|", hue="kind", units="pair", estimator=None, lw=0.8, ax=ax,
                 palette={k: v for k, v in palette.items() if k in set(rows.kind)})
    ax.axhline(margin.floor, color="k", ls="--", lw=1, label="seed-to-seed floor (other batches)")
    ax.axhline(margin.margin, color="k", ls=":", lw=1, label="TOST margin (test dropped)")
    ax.set_yscale("symlog", linthresh=1e-7)
    ax.set_ylim(bottom=0)  # |delta| >= 0; exact zeros (bitwise-equal steps) sit on the axis
    ax.legend(fontsize=8)
    return fig


def g_stats(g_stats: pd.DataFrame):
    """``g - 1`` over all modules (max |g-1| and std) per run and step."""
    g = g_stats[(g_stats.module == "all") & (g_stats.statistic.isin(["max_abs", "std"]))]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    sns.lineplot(data=g, x="step", y="value", hue="run", style="statistic", ax=ax)
    ax.set_ylabel("g - 1 over all modules")
    legend_outside(ax)
    return fig
