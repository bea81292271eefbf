"""The figures of notebook 01: one function per figure, named like the file the
notebook saves it as, each taking the notebook's tidy tables and returning a
matplotlib figure (every notebook's figures live in its study folder's ``plots.py``).

``trained_*``: the adapters trained on the H200 (:mod:`.trained`'s tables; step 0 is
drawn at 1 on the log axes); the CPU agreement runs; the compose error and the paper's
benchmark (:mod:`.analysis`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter
import numpy as np
import pandas as pd
import seaborn as sns

from ...adapters.collapse import POOLED
from ...numerics.formats import STUDIED_FORMATS, get_format
from ..bounds.plots import EXHAUSTIVE_G_TICKS
from .runs import CROSSCHECK_FACTOR, CROSSCHECK_FROM_STEP, MODULE_TYPES
from .trained import PAPER_ADAPTER

_MEASURE = {"frac_rounds_to_one": "exact: fl(g) = 1", "frac_symmetric_zone": "paper: |g-1| < eps/2",
            "absorption": "absorption: fl(g x) = x"}


def _pooled_groups(collapse: pd.DataFrame) -> pd.DataFrame:
    """The pooled rows (all modules) of a trained record's collapse table, step 0 at 1 for log axes."""
    c = collapse[collapse["group"] == POOLED]
    return c.assign(step1=c["step"].clip(lower=1)).reset_index(drop=True)


# ----------------------------------------------------------------------------
# The trained adapters (H200)
# ----------------------------------------------------------------------------

def trained_quality(evals: pd.DataFrame, outcome: pd.DataFrame):
    """Validation MRR@10 and loss of the standard runs over training, the base model dotted."""
    ev = evals.merge(outcome[["run", "rank", "lr", "variant"]], on="run")
    ev = ev[ev["variant"] == "standard"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, (col, lab) in zip(axes, (("mrr10", "validation MRR@10"), ("val_loss", "validation loss"))):
        sns.lineplot(data=ev, x="step", y=col, hue="rank", style="lr", palette="viridis", ax=ax)
        ax.axhline(float(evals.loc[evals["step"] == 0, col].iloc[0]), color="k", lw=0.8, ls=":")
        ax.set(ylabel=lab, title=f"{lab} (dotted: the base model)")
    return fig


def trained_collapse_over_training(collapse: pd.DataFrame):
    """Per format and lr: the exact-zone, paper-zone and absorption fractions (pooled) over training."""
    col = _pooled_groups(collapse)
    col = col[col["variant"] == "standard"]
    long = col.melt(id_vars=["run", "rank", "lr", "step1", "format"], value_name="fraction", var_name="measure",
                    value_vars=list(_MEASURE))
    long["measure"] = long["measure"].map(_MEASURE)
    g = sns.relplot(data=long, x="step1", y="fraction", hue="rank", style="measure", col="format", row="lr",
                    kind="line", palette="viridis", height=2.5, aspect=1.15, facet_kws={"sharey": True},
                    dashes=["", (4, 2), (1, 1)])
    g.set(xscale="log")
    g.set_titles(row_template="lr {row_name}", col_template="{col_name}")
    g.set_axis_labels("step", "fraction")
    g.figure.suptitle("collapse over training (pooled over modules)", y=1.02)
    return g.figure


def trained_g_std(collapse: pd.DataFrame):
    """std of g (all modules) over training, beside the paper's adapter."""
    std = _pooled_groups(collapse[collapse["format"] == "bf16"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    sns.lineplot(data=std[std["variant"].isin(["standard", "rsLoRA"])], x="step1", y="g_std", hue="rank", style="lr",
                 markers=True, palette="viridis", ax=ax)
    ax.axhline(PAPER_ADAPTER["g_std"], color="k", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="step", ylabel="std of g (all modules)",
           title=f"spread of g over training (dotted: the paper's adapter, {PAPER_ADAPTER['g_std']:g})")
    return fig


def trained_final_exact_zone(collapse: pd.DataFrame):
    """Exact-zone fraction of the final adapters per rank, lr and format."""
    fin = collapse[collapse["final"] & (collapse["group"] == POOLED) & collapse["variant"].eq("standard")]
    g = sns.catplot(data=fin, x="rank", y="frac_rounds_to_one", hue="lr", col="format", kind="bar", height=2.8,
                    aspect=0.9, palette="crest")
    g.set_titles(col_template="{col_name}")
    g.set_axis_labels("rank", "fraction of g with fl(g) = 1")
    g.figure.suptitle("exact-zone collapse of the final adapters", y=1.03)
    return g.figure


def trained_final_by_module_type(bytype: pd.DataFrame):
    """Exact-zone fraction per module type at the final step (:func:`.trained.final_by_module_type`)."""
    g = sns.catplot(data=bytype, x="group", y="frac_rounds_to_one", hue="rank", col="format", row="lr", kind="bar",
                    order=list(MODULE_TYPES), palette="viridis", height=2.4, aspect=1.2)
    g.set_titles(row_template="lr {row_name}", col_template="{col_name}")
    g.set_xticklabels(rotation=45)
    g.set_axis_labels("module type", "fl(g) = 1")
    g.figure.suptitle("exact-zone fraction per module type, final step", y=1.02)
    return g.figure


def trained_bf16_by_module_type_over_training(collapse: pd.DataFrame):
    """bf16 exact-zone fraction per module type over training, per rank and lr (standard runs)."""
    c = collapse
    over = c[(c["group"] != POOLED) & c["variant"].eq("standard") & c["format"].eq("bf16")]
    over = over.assign(step1=over["step"].clip(lower=1))
    g = sns.relplot(data=over, x="step1", y="frac_rounds_to_one", hue="group", hue_order=list(MODULE_TYPES),
                    col="rank", row="lr", kind="line", marker="o", height=2.3, aspect=1.0)
    g.set(xscale="log")
    g.set_titles(row_template="lr {row_name}", col_template="r = {col_name}")
    g.set_axis_labels("step", "bf16: fl(g) = 1")
    g.figure.suptitle("bf16 exact-zone fraction per module type over training", y=1.02)
    return g.figure


def _g_zones(ax, label: str):
    """Each 16-bit format's zones on a histogram of ``g - 1``: shaded the paper's symmetric
    zone ``|g - 1| < eps/2`` (legend ``label.format(fmt=...)``), solid lines the ends of the
    exact zone (the ``g`` that round to 1: half the spacing below / above one)."""
    for fmt, color in (("bf16", "C0"), ("fp16", "C1")):
        f = get_format(fmt)
        ax.axvspan(-f.eps / 2, f.eps / 2, color=color, alpha=0.12, label=label.format(fmt=fmt))
        for x in (-f.spacing_below_one / 2, f.spacing_above_one / 2):
            ax.axvline(x, color=color, lw=1.2)


def trained_g_histogram(g_final: dict, final_steps: dict, runs=("r16_lr0.001", "r128_lr0.0001")):
    """Every row of ``g - 1`` at the final step of ``runs`` (those recorded; else the first run), with
    each format's zones: shaded the paper's symmetric zone, solid lines the exact zone's ends."""
    want = [r for r in runs if r in g_final] or sorted(g_final)[:1]
    fig, axes = plt.subplots(1, len(want), figsize=(6 * len(want), 3.4), squeeze=False)
    for ax, run in zip(axes[0], want):
        ax.hist(np.concatenate(list(g_final[run].values())) - 1, bins=200, color="0.4")
        _g_zones(ax, "{fmt}: |g-1| < eps/2")
        ax.set(xlabel="g - 1", ylabel="rows", title=f"{run}, step {final_steps[run]}")
        ax.legend(fontsize=7)
    return fig


def trained_g_std_vs_lr_steps(collapse: pd.DataFrame):
    """std of g at the final step against lr x steps, beside the paper's adapter."""
    fs = collapse[collapse["final"] & (collapse["group"] == POOLED) & collapse["format"].eq("bf16")]
    fs = fs[fs["variant"].isin(["standard", "rsLoRA"])]
    fs = fs.assign(lr_steps=fs["lr"] * fs["step"])
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    sns.scatterplot(data=fs, x="lr_steps", y="g_std", hue="rank", style="variant", palette="viridis", s=60, ax=ax)
    ax.axhline(PAPER_ADAPTER["g_std"], color="k", lw=0.8, ls=":", label="paper: Qwen2-VL-7B r=128")
    ax.set(xscale="log", yscale="log", xlabel="lr x steps", ylabel="std of g at the final step")
    ax.xaxis.set_minor_formatter(NullFormatter())  # on 1.5 decades matplotlib labels 3e-1 and 4e-1, which overlap
    ax.legend(fontsize=7)
    return fig


def seeds_fraction_vs_lr_integral(sens: pd.DataFrame):
    """The pooled fraction of every kept capture of every seed (:func:`.seeds.sensitivity_table`) against
    L = lr x steps (warmup counted as run); best checkpoints ringed, last ones crossed."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    sns.scatterplot(data=sens, x="L", y="fraction", hue="rank", style="lr", palette="viridis", s=28, ax=ax)
    b, f = sens[sens["best"].astype(bool)], sens[sens["final"].astype(bool)]
    ax.scatter(b["L"], b["fraction"], s=90, facecolors="none", edgecolors="k", lw=0.8, label="best checkpoint")
    ax.scatter(f["L"], f["fraction"], s=40, marker="x", color="k", lw=0.8, label="last capture")
    fmt, zone = sens["format"].iloc[0], sens["zone"].iloc[0]
    ax.set(xscale="log", xlabel="L = lr x steps (warmup counted as run)", ylim=(-0.02, 1.02),
           ylabel=f"fraction of g, {fmt} ({'fl(g) = 1' if zone == 'one' else '|g-1| < eps/2'})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def seeds_fractions(frac: pd.DataFrame, zone: str = "one"):
    """The pooled fraction of g in ``zone`` per configuration (:func:`.seeds.fraction_table`), bf16 and fp16, at
    the best checkpoint and the last capture, each with its 95 % interval over seeds and modules."""
    t = frac[(frac["zone"] == zone) & frac["format"].isin(["bf16", "fp16"])]
    order = t.drop_duplicates("config").sort_values(["lr", "variant", "rank"], ascending=[True, False, True])["config"].tolist()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, fmt in zip(axes, ("bf16", "fp16")):
        for k, (at, colour) in enumerate((("best", "C0"), ("final", "C3"))):
            u = t[(t["format"] == fmt) & (t["checkpoint"] == at)].set_index("config").reindex(order)
            x = np.arange(len(order)) + (k - 0.5) * 0.3
            n = int(u["n_seeds"].max())
            ax.errorbar(x, u["fraction"], yerr=[u["fraction"] - u["lo"], u["hi"] - u["fraction"]], fmt="o",
                        ms=4, color=colour, capsize=2, lw=0.9,
                        label=f"{'best checkpoint' if at == 'best' else 'last capture'} ({n} seeds)")
        lab = t.drop_duplicates("config").set_index("config")
        ax.set_xticks(np.arange(len(order)), [f"r{lab.loc[c, 'rank']}\n{lab.loc[c, 'lr']:.0e}"
                                             + ("\nrsLoRA" if lab.loc[c, "variant"] != "standard" else "")
                                             for c in order], fontsize=7)
        ax.set(title=fmt, ylim=(-0.02, 1.02))
    axes[0].set_ylabel("fraction of g with fl(g) = 1" if zone == "one" else "fraction with |g-1| < eps/2")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def trained_crosscheck(crosscheck: pd.DataFrame):
    """RMS(g_PEFT - g_ours) / RMS(g_ulp - g_ours) per module type over training, both g, with the criterion."""
    cc = crosscheck[(crosscheck["group"] != "all") & (crosscheck["ratio"] > 0)]  # step 0 of params: 0 / x
    cc = cc.assign(step1=cc["step"].clip(lower=1))
    g = sns.relplot(data=cc, x="step1", y="ratio", hue="group", col="g", kind="line", marker="o", height=3, aspect=1.3,
                    hue_order=list(MODULE_TYPES))
    for ax in g.axes.flat:
        ax.axhline(CROSSCHECK_FACTOR, color="k", lw=0.8, ls=":")
        ax.axvline(CROSSCHECK_FROM_STEP, color="0.6", lw=0.8, ls="--")
    g.set(xscale="log", yscale="log")
    g.set_axis_labels("step", "RMS(g_peft - g_ours) / RMS(g_ulp - g_ours)")
    g.figure.suptitle("PEFT vs DoRALinear, in units of the 1-ulp chaos floor (dotted: the criterion)", y=1.03)
    return g.figure


# ----------------------------------------------------------------------------
# The CPU agreement runs (fp32, 20 steps)
# ----------------------------------------------------------------------------


def agreement_peft_vs_doralinear(agreement: pd.DataFrame):
    """``|delta loss|`` of PEFT vs ours per step, beside the 1-ulp baseline."""
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(agreement["step"], (agreement["peft"] - agreement["dora_num"]).abs(), marker="o", label="|L_peft - L_ours|")
    ax.plot(agreement["step"], (agreement["dora_num_perturbed"] - agreement["dora_num"]).abs(), marker="s",
            label="|L_ours(m + 1 ulp) - L_ours|  (baseline)")
    ax.set(xlabel="step", ylabel="|delta loss|", title="loss agreement, PEFT vs DoRALinear (CPU)")
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------
# The compose error and the paper's benchmark
# ----------------------------------------------------------------------------

def compose_ulp_error_vs_gm1(agg: pd.DataFrame):
    """Mean ULP error of the compose against ``|g-1|`` (:func:`~dora_num.studies.cancellation.analysis.error_by_gm1`)."""
    g = sns.relplot(data=agg, x="abs_gm1", y="ulp_mean", hue="variant", style="formula", col="format", row="side",
                    kind="line", height=2.8, aspect=1.3)
    for (side, fmt), ax in g.axes_dict.items():
        f = get_format(fmt)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(bottom=0)
        ax.axvline(f.spacing_below_one / 2 if side == "g < 1" else f.spacing_above_one / 2, color="k", lw=0.8, ls="--")
        ax.axvline(f.eps / 2, color="0.5", lw=0.8, ls=":")
    g.set_axis_labels("|g - 1|", "")
    g.figure.supylabel("mean |error| (ulps of the output)")
    g.figure.suptitle("compose error vs |g-1| on real activations (dashed: end of the zone fl(g) = 1; "
                      "dotted: the paper's eps/2)")
    g.tight_layout()
    return g.figure


def compose_ulp_error_vs_rho(canc: pd.DataFrame):
    """Mean ULP error of both forms (fp32 intermediates) against the naive form's cancellation ratio
    ``|base| / |X|`` (:func:`~dora_num.studies.cancellation.analysis.error_by_cancellation`), with the predicted
    ratio ``2^(22-p)`` beyond which the naive form's fp32 rounding can reach half an ulp of the result."""
    from ...numerics.bounds import one_ulp_condition

    c = canc[~canc["sparse"]].assign(rho=lambda d: 2.0 ** (d["log2_rho"] + 0.5))
    g = sns.relplot(data=c, x="rho", y="ulp_mean", hue="formula", col="format", kind="line", marker="o", height=3,
                    aspect=1.3)
    for fmt, ax in g.axes_dict.items():
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_ylim(bottom=0)
        ax.axvline(one_ulp_condition(fmt), color="k", lw=0.8, ls="--")
    g.set_axis_labels("|base| / |X|  (power-of-two bins)", "mean |error| (ulps)")
    g.figure.suptitle("compose error vs the naive form's cancellation ratio |base|/|X|, fp32 intermediates\n"
                      "dashed: 2^(22-p), the ratio beyond which the naive form can pass 1 ulp")
    g.tight_layout()
    return g.figure


def compose_term_lost_vs_gm1(agg: pd.DataFrame):
    """How much of the ``(g-1)*base`` term the compose loses, against ``|g-1|``."""
    g = sns.relplot(data=agg, x="abs_gm1", y="term_lost_median", hue="variant", style="formula", col="format",
                    row="side", kind="line", height=2.8, aspect=1.3)
    for ax in g.axes.flat:
        ax.set(xscale="log", yscale="log")
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
    g.set_axis_labels("|g - 1|", "median |error| / |(g-1) base|")
    g.figure.suptitle("how much of the (g-1)*base term is lost (1 = all of it)")
    g.tight_layout()
    return g.figure


def paper_benchmark(bench: pd.DataFrame, shape):
    """The paper's max-abs metric and the ULP metric that sees the ``(g-1)*base`` term, per g."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(bench))
    for col, lab in (("naive_max_abs", "naive"), ("stable_max_abs", "stable"), ("output_floor", "output rounding floor"),
                     ("cr_stored_floor", "correctly rounded on stored inputs")):
        axes[0].plot(x, bench[col], marker="o", label=lab)
    axes[0].set(xticks=x, xticklabels=[f"{g:g}" for g in bench["g"]], yscale="log", xlabel="g", ylabel="max |error|",
                title=f"paper metric, bf16 {shape[0]}x{shape[1]}")
    axes[0].tick_params(axis="x", rotation=90)  # 0.999 and 0.9999 side by side overlapped at 45 degrees
    axes[0].legend(fontsize=7)
    for col, lab in (("naive_ulp_mean", "naive (bf16 ops)"), ("stable_ulp_mean", "stable (bf16 ops)"),
                     ("naive_fp32_ulp_mean", "naive (fp32, g fp32)"), ("stable_fp32_ulp_mean", "stable (fp32, g fp32)")):
        axes[1].plot(x, bench[col], marker="o", label=lab)
    axes[1].set_yscale("symlog", linthresh=1e-3)
    axes[1].set(xticks=x, xticklabels=[f"{g:g}" for g in bench["g"]], ylim=(0, None), xlabel="g",
                ylabel="mean |error| (bf16 ulps)", title="vs correctly rounded (sees (g-1)*base)")
    axes[1].tick_params(axis="x", rotation=90)
    axes[1].legend(fontsize=7)
    return fig


def exhaustive_correctly_rounded(ex: pd.DataFrame, s_label: str = "1"):
    """Every (base, lora) pair of each format (:mod:`dora_num.studies.bounds.exhaustive`): the
    fraction correctly rounded against ``g - 1`` (symlog), one panel per format, one line per
    formula x arithmetic; shaded: the collapse zone ``fl(g) = 1`` (``-eps/4 <= g - 1 <= eps/2``)."""
    d = ex[ex["s_label"] == s_label]
    fmts = [f for f in STUDIED_FORMATS if f in set(d["format"])]
    fig, axes = plt.subplots(1, len(fmts), figsize=(4.2 * len(fmts), 3.4), squeeze=False, sharey=True)
    for ax, f in zip(axes[0], fmts):
        for (formula, arith), dd in d[d["format"] == f].groupby(["formula", "arith"]):
            dd = dd.sort_values("g_minus_1")
            ax.plot(dd["g_minus_1"], dd["frac_correctly_rounded"], marker="o", ms=3, lw=1,
                    label=f"{formula.removeprefix('compose_')}, {arith}")
        fm = get_format(f)
        ax.axvspan(-fm.eps / 4, fm.eps / 2, color="grey", alpha=0.2)
        ax.set_xscale("symlog", linthresh=2.0**-24)
        ax.set_xticks(EXHAUSTIVE_G_TICKS)
        ax.set(title=f"{f}, every pair, s = {s_label}", xlabel="g - 1", ylabel="fraction correctly rounded")
    axes[0][-1].legend(fontsize=7)
    return fig
