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
