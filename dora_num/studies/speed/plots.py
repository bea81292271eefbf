"""The figures of notebook 05 (memory and speed): one function per figure, each taking
the tidy tables of :mod:`~dora_num.studies.speed.report` and returning a matplotlib
figure, named like the file the notebook saves it as (the package's plotting
convention: every notebook's figures live in its study folder's ``plots.py``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker as mticker
import pandas as pd
import seaborn as sns


def compose_pct_copy(bw: pd.DataFrame, dtype: str = "bfloat16"):
    """% of the copy bandwidth vs elements (tokens x d_out), per op and implementation."""
    t = bw[(bw["dtype"] == dtype) & bw["op"].isin(["fwd", "bwd", "train"])].copy()
    t["elements"] = t["tokens"] * t["d_out"]
    g = sns.relplot(data=t, x="elements", y="pct_copy", hue="impl", style="impl", col="op", kind="line",
                    marker="o", height=3.2, aspect=1.1, estimator="median", errorbar=None)
    g.set(xscale="log", ylim=(0, 110), ylabel="% of copy bandwidth")
    for ax in g.axes.flat:
        ax.axhline(100, color="grey", lw=0.8, ls="--")
    g.figure.suptitle(f"compose kernels, {dtype}: useful bytes / time vs device copy", y=1.04)
    return g.figure


def compose_speedups(sp: pd.DataFrame, dtype: str = "bfloat16"):
    """Fused speedup over eager and over torch.compile, per op, vs elements."""
    t = sp[(sp["dtype"] == dtype) & sp["op"].isin(["fwd", "bwd_autograd", "train"])].copy()
    t["elements"] = t["tokens"] * t["d_out"]
    long = t.melt(id_vars=["op", "elements"], value_vars=["speedup_vs_eager", "speedup_vs_compile"],
                  var_name="baseline", value_name="speedup").dropna()
    g = sns.relplot(data=long, x="elements", y="speedup", hue="baseline", col="op", kind="line", marker="o",
                    height=3.2, aspect=1.1, estimator="median", errorbar=None)
    g.set(xscale="log", yscale="log")
    for ax in g.axes.flat:
        ax.axhline(1, color="grey", lw=0.8, ls="--")
    return g.figure


def norm_peak_memory(nt: pd.DataFrame):
    """Peak extra memory per row-norm method (measured; the theory agrees within 0.1 MB)."""
    t = nt.copy()
    # the rank on a second line: "8192x28672 r384" on one line overlapped its neighbours even at 20 degrees
    t["shape"] = t["d_out"].astype(str) + "x" + t["d_in"].astype(str) + "\nr" + t["rank"].astype(str)
    g = sns.catplot(data=t, x="shape", y="measured_MB", hue="method", col="w_dtype", kind="bar", height=3.6,
                    aspect=1.4)
    for ax in g.axes.flat:
        ax.set_yscale("log")
    g.set_axis_labels("", "peak extra memory (MB, log)")
    return g.figure


def layer_vs_peft(lt: pd.DataFrame):
    """Forward / forward+backward time and peak memory: dora_num vs PEFT."""
    t = lt.copy()
    t["shape"] = t["d_in"].astype(str) + " r" + t["rank"].astype(str) + " T" + t["tokens"].astype(str)
    t["peak_MB"] = t["peak_extra_bytes"] / 1e6
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    sns.barplot(data=t[t["mode"] == "fwd_bwd"], x="shape", y="ms", hue="impl", ax=axes[0])
    axes[0].set_title("forward + backward time (ms)")
    sns.barplot(data=t[t["mode"] == "fwd_bwd"], x="shape", y="peak_MB", hue="impl", ax=axes[1])
    axes[1].set_title("forward + backward peak extra memory (MB)")
    for ax in axes:
        ax.set_xlabel("")
    fig.tight_layout()
    return fig


def train_step_timing(tt: pd.DataFrame):
    """Training step time by timing mode: one step through autograd (host in the loop)
    vs CUDA-graph replay (device only), fused vs compile, as % of the bandwidth floor."""
    t = tt[tt["mode"].isin(["do_bench_step", "cuda_graph"])].copy()
    t["shape"] = t["tokens"].astype(str) + "x" + t["d_out"].astype(str)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, mode, title in zip(axes, ("do_bench_step", "cuda_graph"),
                               ("one step at a time through autograd", "CUDA graph replay (device only)")):
        sns.barplot(data=t[t["mode"] == mode], x="shape", y="pct_floor", hue="impl", ax=ax)
        ax.axhline(100, color="k", lw=0.8, ls="--")
        ax.set_title(title)
        ax.set_xlabel("tokens x d_out (bf16)")
    axes[0].set_ylabel("% of the bandwidth floor (16 B/element)")
    fig.tight_layout()
    return fig


def released_ratios(t: pd.DataFrame, device: str = ""):
    """Their time / ours per op and shape (:func:`~dora_num.studies.speed.released.like_for_like`): the
    median round as a dot, the range over rounds as a bar, a line at 1 (right of it: theirs took longer)."""
    t = t.reset_index(drop=True)
    labels = t["op"].astype(str) + "  " + t["shape"]
    y = range(len(t))[::-1]  # the table's first row at the top
    fig, ax = plt.subplots(figsize=(6.4, 0.26 * len(t) + 1.0))
    colors = dict(zip(t["op"].cat.categories if hasattr(t["op"], "cat") else sorted(set(t["op"])),
                      sns.color_palette("colorblind")))
    for yi, (_, r) in zip(y, t.iterrows()):
        ax.errorbar(r["ratio"], yi, xerr=[[r["ratio"] - r["ratio_lo"]], [r["ratio_hi"] - r["ratio"]]], fmt="o",
                    ms=4, capsize=2, lw=1, color=colors[r["op"]])
    ax.axvline(1, color="grey", lw=0.8, ls="--")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xscale("log")
    lo, hi = min(t["ratio_lo"].min(), 1) / 1.1, max(t["ratio_hi"].max(), 1) * 1.1
    ticks = [x for x in (0.5, 0.8, 1, 1.5, 2, 3, 5, 7, 10, 20) if lo <= x <= hi]
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(mticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(mticker.FixedFormatter([f"{x:g}" for x in ticks]))
    ax.xaxis.set_minor_locator(mticker.NullLocator())
    ax.set_xlabel("their time / ours (dot: median round; bar: min to max over rounds)")
    n = int(t["rounds"].min()) if len(t) else 0
    ax.set_title(f"released dorafactors kernels vs ours, {n} interleaved rounds{', ' + device if device else ''}",
                 fontsize=9)
    fig.tight_layout()
    return fig


def targets_over_sessions(t: pd.DataFrame, card: str = "", labels: tuple[str, str] = ("first session", "repeat session")):
    """Each target's measured value over its threshold in two sessions
    (:func:`~dora_num.studies.speed.report.targets_over_sessions`): the first session as a filled dot, the
    second as a hollow one (``labels``: their legend entries), joined by a line; at or right of 1 the target
    is met; a label in red where the sessions' verdicts differ."""
    t = t.reset_index(drop=True)
    y = range(len(t))[::-1]
    fig, ax = plt.subplots(figsize=(7.2, 0.26 * len(t) + 1.1))
    a, b = t["measured_1"] / t["threshold"], t["measured_2"] / t["threshold"]
    for yi, x1, x2 in zip(y, a, b):
        ax.plot([x1, x2], [yi, yi], color="grey", lw=1)
    ax.plot(a, list(y), "o", ms=4, color="C0", label=labels[0])
    ax.plot(b, list(y), "o", ms=5, mfc="none", color="C1", label=labels[1])
    ax.axvline(1, color="grey", lw=0.8, ls="--")
    ax.set_yticks(list(y), t["target"] + "  " + t["shape"], fontsize=6.5)
    for tick, split in zip(ax.get_yticklabels(), t["over_sessions"] == "split"):
        if split:
            tick.set_color("C3")
    ax.set_xscale("log")
    lo, hi = min(a.min(), b.min(), 1) / 1.15, max(a.max(), b.max(), 1) * 1.15
    ticks = [x for x in (0.25, 0.5, 0.8, 1, 1.5, 2, 3, 5, 10, 20, 50) if lo <= x <= hi]
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(mticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(mticker.FixedFormatter([f"{x:g}" for x in ticks]))
    ax.xaxis.set_minor_locator(mticker.NullLocator())
    ax.set_xlabel("measured / threshold (1 or more: met; red label: the two verdicts differ)", fontsize=8)
    ax.set_title(f"speed and memory targets in two sessions{', ' + card if card else ''}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
