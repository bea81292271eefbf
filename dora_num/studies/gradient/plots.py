"""The figures of notebook 06: one function per figure, named like the file the
notebook saves it as, each taking the notebook's tidy tables and returning a
matplotlib figure (every notebook's figures live in its study folder's ``plots.py``)."""

from __future__ import annotations

import pandas as pd
import seaborn as sns


def dg_error_vs_tokens(syn: pd.DataFrame):
    """Relative error of dg against tokens per step, per reduction, base scale and dtype."""
    g = sns.relplot(data=syn[syn.rel_err_norm > 0], x="T", y="rel_err_norm", hue="reduction", style="base_scale",
                    col="dtype", kind="line", marker="o", height=3.2, facet_kws={"sharey": True})
    g.set(xscale="log", yscale="log", ylabel="||dg^ - dg|| / ||dg||")
    return g.figure


def memory_peak_vs_tokens(trans: pd.DataFrame):
    """The model's predicted peak against tokens per step, per norm, with and without checkpointing."""
    g = sns.relplot(data=trans, x="tokens", y="peak", hue="norm", col="checkpointing", kind="line", marker="o",
                    height=3.2)
    g.set(xscale="log", ylabel="predicted peak (bytes)")
    return g.figure


def memory_holdout(diag: pd.DataFrame, title: str = "memory model out of sample (H100)"):
    """The pre-registered holdout: measured peak against the registered prediction (log axes, the a-priori
    band), coloured by the verdict's status, each point labelled by its registered order; hollow markers: the
    peak the step reached where the previous configuration's layers were in the baseline (``implied``)."""
    import matplotlib.pyplot as plt
    import numpy as np

    from .memory_model import TOLERANCE

    fig, ax = plt.subplots(figsize=(5.6, 4.6))
    lo, hi = 2e8, 2e10
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, color="0.4", lw=0.8)
    # within: |pred - meas| <= TOL * meas, i.e. meas in [pred / (1 + TOL), pred / (1 - TOL)]
    ax.fill_between(xs, xs / (1 + TOLERANCE), xs / (1 - TOLERANCE), color="0.85", label=f"within +-{TOLERANCE:.0%}")
    colours = {"within": "tab:green", "miss": "tab:red", "not measured": "tab:orange"}
    for status, part in diag.groupby("status"):
        ok = part[part["measured"] > 0]
        if len(ok):  # a status with no point drawn (measured below zero, or not at all) gets no legend entry
            ax.scatter(ok["predicted"], ok["measured"], color=colours.get(status, "k"), label=status, zorder=3)
    # each point's registered order beside it, above right; where points lie within 10 % of one prediction, the
    # highest is labelled above and the others below, so that labels at nearly one prediction do not overlap
    # (a point measured below zero has only its hollow marker: labelled there)
    at = diag.assign(y=np.where(diag["measured"] > 0, diag["measured"], diag["implied"]))
    at = at[at["y"] > 0].sort_values("predicted")
    cluster = (np.log(at["predicted"]).diff().fillna(1.0) >= 0.1).cumsum()
    for _, group in at.groupby(cluster.to_numpy()):
        for k, (_, r) in enumerate(group.sort_values("y", ascending=False).iterrows()):
            ax.annotate(str(r["order"]), (r["predicted"], r["y"]), textcoords="offset points",
                        xytext=(5, 3 if k == 0 else -10), fontsize=8)
    held = diag[diag["held"] > 0]
    if len(held):  # no legend entry where nothing was held (the rerun with the fixed harness)
        ax.scatter(held["predicted"], held["implied"], facecolors="none", edgecolors="k", zorder=3,
                   label="measured + the held layers")
    for _, r in held[held["measured"] > 0].iterrows():  # joined to its measured point, whose label it shares
        ax.plot([r["predicted"]] * 2, [r["measured"], r["implied"]], color="k", lw=0.6, ls=":")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="registered prediction (bytes)",
           ylabel="measured peak (bytes)", title=title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
