"""The figures of notebook 02: one function per figure, named like the file the
notebook saves it as, each taking the notebook's tidy tables and returning a
matplotlib figure (every notebook's figures live in its study folder's ``plots.py``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from .sqrt import HIST_CAP

ASSEMBLY_SITES = {"s0": "2s·cross + base_sq", "s1": "s²·ba + t"}  # the contraction sites, in order
SQRT_NAMES = {"rn": "sqrt RN", "faithful_other": "sqrt faithful"}


def variant_name(placement: str, sqrt: str) -> str:
    """A placement label (``s0:fma+s1:fma``) and a sqrt model, in words for a legend."""
    sites = [part.split(":")[0] for part in placement.split("+") if part != "none"]
    fma = "no FMA" if not sites else "FMA at " + " and ".join(sites)
    return f"{fma}, {SQRT_NAMES.get(sqrt, sqrt)}" + (" (production)" if fma == "no FMA" and sqrt == "rn" else "")


def _pooled_ulp_axis(ax) -> None:
    """Ticks of a ULP histogram whose outermost bins pool everything beyond +-HIST_CAP, labelled as such."""
    edge = HIST_CAP + 1
    ticks = [-edge, -HIST_CAP // 2, 0, HIST_CAP // 2, edge]
    ax.set_xticks(ticks, [f"\u2264\u2212{edge}"] + [str(t).replace("-", "\u2212") for t in ticks[1:-1]]
                  + [f"\u2265{edge}"])


def assembly_ulp_hist(hist: pd.DataFrame, sets: list[str]):
    """ULP differences of each assembly placement x sqrt model from production, per input set."""
    h = hist.query("vs == 'production'").copy()
    h["variant"] = [variant_name(p, q) for p, q in zip(h["placement"], h["sqrt"])]
    fig, axes = plt.subplots(1, len(sets), figsize=(3.9 * len(sets) + 2.4, 3.9), sharey=False, layout="constrained")
    for ax, name in zip(axes, sets):
        tab = h[h["set"] == name].pivot_table(index="ulp", columns="variant", values="count", aggfunc="sum").fillna(0)
        for col in tab.columns:
            ax.plot(tab.index, tab[col].replace(0, np.nan), marker="o", ms=3, lw=1, label=col)
        ax.set_yscale("log"); ax.set_title(f"inputs: {name}"); ax.set_xlabel("ulps from production's wnorm")  # noqa: E702
        _pooled_ulp_axis(ax)
    axes[0].set_ylabel("rows")
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7, title="contraction, square root",
               title_fontsize=8)
    fig.suptitle("Norm assembly: every placement of FMA contractions and square-root model against production")
    fig.supxlabel("sites: s0 = " + ASSEMBLY_SITES["s0"] + ", s1 = " + ASSEMBLY_SITES["s1"] + " (an FMA rounds the "
                  "product and the sum once); sqrt RN: correctly rounded, faithful: each inexact root at its other "
                  f"neighbour; the outer bins hold every difference beyond \u00b1{HIST_CAP} ulps", fontsize=7.5)
    return fig


def assembly_contraction_explained(ex: pd.DataFrame):
    """The fraction of site results a contraction changes against ``q`` (the explain table)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.scatterplot(data=ex[(ex["mean_q"] > 0) & (ex["site_result_changed"] > 0)], x="mean_q", y="site_result_changed",
                    hue="set", style="site", size="n", ax=ax)
    ax.plot([1e-5, 1], [1e-5, 1], color="grey", lw=0.8, ls=":", label="rate = q")
    ax.set_xscale("log"); ax.set_yscale("log")  # noqa: E702
    ax.set_xlabel("q = removed rounding / ulp(site result) (bin mean)")
    ax.set_ylabel("fraction of site results changed")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    ax.set_title("Norm assembly: a contraction changes a result with probability ~ q")
    return fig


def compose_ulp_hist(hist: pd.DataFrame, sets: list[str], fmts=("fp32", "bf16")):
    """ULP differences of each compose placement from production, per input set and output format."""
    h = hist.query("vs == 'production' and formula != 'compose_naive'").copy()
    h["variant"] = h["formula"].str.replace("compose_", "") + " " + h["placement"]
    fmts = list(fmts)
    fig, axes = plt.subplots(len(fmts), len(sets), figsize=(4.2 * len(sets), 6), squeeze=False)
    for i, fmt in enumerate(fmts):
        for j, name in enumerate(sets):
            ax = axes[i][j]
            tab = h[(h["set"] == name) & (h["fmt"] == fmt)].pivot_table(index="ulp", columns="variant", values="count",
                                                                        aggfunc="sum").fillna(0)
            for col in tab.columns:
                ax.plot(tab.index, tab[col].replace(0, np.nan), marker="o", ms=3, lw=1, label=col)
            ax.set_yscale("log"); ax.set_title(f"{name}, {fmt} output", fontsize=9)  # noqa: E702
            ax.set_xlabel("ULP difference from production" if i == len(fmts) - 1 else "")
            _pooled_ulp_axis(ax)
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    fig.subplots_adjust(hspace=0.45)  # the upper row's tick labels clear of the lower row's titles
    fig.suptitle(f"Compose: contraction placements vs production (outer bins: beyond \u00b1{HIST_CAP} ulps)")
    return fig


def sqrt_census_failures(profile: pd.DataFrame, impls):
    """Where an fp32 sqrt fails, over every normal input (the census,
    :func:`~dora_num.studies.fma.census.failure_profile`): the fraction not correctly rounded
    against the position of the exact root between its neighbouring floats (0: on the lower
    float, 1/2: at the rounding boundary), one line per exponent parity (odd: the root's
    significand lies in [sqrt 2, 2)), one panel per implementation."""
    impls = [i for i in impls if i in set(profile["implementation"])]
    fig, axes = plt.subplots(1, max(len(impls), 1), figsize=(5.2 * max(len(impls), 1), 3.6), squeeze=False)
    for ax, impl in zip(axes[0], impls):
        d = profile[profile["implementation"] == impl]
        for par, dd in d.groupby("exp_parity"):
            ax.plot(dd["position"], dd["frac_not_correct"], marker="o", ms=3, lw=1, label=f"exponent {par}")
        ax.axvline(0.5, color="grey", lw=0.8, ls=":")
        ax.set(title=impl, xlabel="position of the exact root between neighbouring floats",
               ylabel="fraction not correctly rounded", ylim=(-0.02, 1.02))
        ax.legend(fontsize=8)
    fig.suptitle("fp32 sqrt, every normal input: where the results are not correctly rounded", y=1.04)
    fig.tight_layout()
    return fig


def propagation_layers(propagation: pd.DataFrame):
    """Fraction of ``DoRALinear`` outputs each variant changes (mean over layers and scales, min-max bars)."""
    fig, ax = plt.subplots(figsize=(9, 4))
    sns.barplot(data=propagation[propagation["variant"] != "production"], x="variant", y="changed", hue="dtype", ax=ax,
                errorbar=("pi", 100))
    ax.set_ylabel("fraction of layer outputs changed\n(mean over layers and scales; bars: min-max)")
    ax.set_xlabel("")
    ax.tick_params(axis="x", rotation=90)  # at 20 degrees the long variant names overlapped
    ax.set_title("DoRALinear outputs vs production, MiniLM layers")
    return fig


def gpu_agreement(rates: pd.DataFrame):
    """Each recorded variant's bitwise agreement on the H200 beside the emulation's prediction."""
    fig, ax = plt.subplots(figsize=(8, 4))
    r = rates.copy(); r["label"] = r["variant"] + " [" + r["model"] + "]"  # noqa: E702
    exact = r["exact_prediction"].astype(bool)
    ax.hlines(r.loc[~exact, "label"], r.loc[~exact, "agreement_lo"], r.loc[~exact, "agreement_hi"], color="grey",
              lw=3, alpha=0.6, label="emulation: interval (faithful sqrt)")
    ax.plot(r.loc[exact, "agreement_lo"], r.loc[exact, "label"], "o", color="grey", label="emulation: exact prediction")
    ax.plot(r["gpu_agreement"], r["label"], "x", color="C3", ms=8, label="H200 (4M inputs)")
    ax.set_xlabel("bitwise agreement with the torch reference"); ax.legend(loc="lower left", fontsize=8)  # noqa: E702
    return fig
