"""The figures of notebook 00: one function per figure, named like the file the
notebook saves it as, each taking the notebook's tidy tables and returning a
matplotlib figure (every notebook's figures live in its study folder's ``plots.py``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from ...numerics.formats import FORMATS


def norm_errors(per_layer: pd.DataFrame):
    """Relative error of the factored and dense fp32 norms vs float64 and their bounds, worst row per layer."""
    long = per_layer.melt(id_vars=["layer"], value_vars=["rel_err_factored_max", "rel_err_dense_max",
                                                              "bound_factored_rel_max", "bound_dense_rel_max"],
                          var_name="quantity", value_name="relative error")
    long["quantity"] = long["quantity"].map({"rel_err_factored_max": "factored fp32 (measured)",
                                             "rel_err_dense_max": "dense fp32 (measured)",
                                             "bound_factored_rel_max": "factored: a-priori bound",
                                             "bound_dense_rel_max": "dense: a-priori bound"})
    fig, ax = plt.subplots(figsize=(10, 4))
    sns.scatterplot(data=long, x="layer", y="relative error", hue="quantity", style="quantity", ax=ax)
    ax.axhline(2.0**-24, color="grey", lw=0.8, ls=":")
    ax.text(0, 2.0**-24, " u(fp32) = 2^-24", va="bottom", fontsize=8, color="grey")
    ax.set_yscale("log"); ax.set_xlabel(""); ax.tick_params(axis="x", rotation=90, labelsize=7)  # noqa: E702
    ax.set_title("Row-norm relative error vs float64, worst row per layer")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), title=None)
    return fig


def g_distribution(g_rows: pd.DataFrame, *, rank: int, alpha: float, update_ratio: float, g_spread: float):
    """``|g - 1|`` after the perturbation (all rows, all layers) beside the bf16 and fp16 zones."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    absg = np.abs(g_rows["g_minus_1"].to_numpy())
    absg = absg[absg > 0]
    sns.histplot(x=absg, log_scale=True, bins=60, ax=ax)
    for key, ls in (("bf16", "--"), ("fp16", ":")):
        f = FORMATS[key]
        ax.axvline(f.eps / 2, color="k", ls=ls, lw=1, label=f"{key}: eps/2 = {f.eps / 2:.2g}")
    ax.set_xlabel("|g - 1| after the perturbation (all rows, all layers)")
    ax.legend(); ax.set_title(f"r = {rank}, s = {alpha / rank:g}, ||sBA||/||W|| = {update_ratio:g}, "  # noqa: E702
                              f"std(g-1) = {g_spread:g}")
    return fig
