"""Reading the exhaustive compose results (notebooks 01 and 03): tables, a figure, and a
re-check of every recorded worst input on the CPU with the package's own functions.

The records: ``data/exhaustive/compose_fp8.csv.gz`` (fp8, CPU) and
``data/gpu/exhaustive/compose_exhaustive.csv`` (bf16/fp16, H200), one row per format x g x s x
formula x arithmetic as written by :func:`.exhaustive.stats_rows` / :func:`.exhaustive.cpu_exhaustive`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pandas as pd

from ...numerics.formats import FORMATS, get_format
from .exhaustive import FP8_FILE, RESULT_FILE, all_values, eager_variants


def computed_value(formula: str, arith: str, fmt, b: float, l_: float, g: float, s: float) -> float:
    """One computed result: eager torch for the 16-bit formats (what the GPU kernel computes),
    :func:`~dora_num.numerics.emulate.emulate` for fp8 (what :func:`cpu_exhaustive` used)."""
    from ...numerics.emulate import emulate

    fmt = get_format(fmt)
    if fmt.bits == 16:
        bits = lambda v: np.array([v], dtype=fmt.np_dtype).view(np.uint16)  # noqa: E731
        out = eager_variants(fmt, bits(b), bits(l_), g, s)[(formula, arith)]
        return float(out.view(fmt.np_dtype).astype(np.float64)[0])
    return float(emulate(formula, {"base": np.array([b]), "lora": np.array([l_]), "g": np.array([g]), "s": s},
                         fmt, arith)[0])


def recheck_worst(df: pd.DataFrame) -> pd.DataFrame:
    """For each row's two worst inputs (largest ULP error, largest error/bound): the computed
    value (:func:`computed_value`), the exact value (``Fraction``), the ULP error, the bound
    (``compose_bound`` itself) in ULPs of the format at the exact value, and whether they
    reproduce what the exhaustive run recorded (``agrees``)."""
    from ...numerics.bounds import compose_bound
    from ...numerics.formats import round_fraction, ulp, ulp_distance

    out = []
    for _, r in df.iterrows():
        fmt = get_format(r["format"])
        _, vals = all_values(fmt)
        for which, bcol, lcol in (("max_ulp", "worst_ulp_base_bits", "worst_ulp_lora_bits"),
                                  ("max_err_over_bound", "worst_ratio_base_bits", "worst_ratio_lora_bits")):
            if r[bcol] < 0:
                continue
            b, l_ = float(vals[int(r[bcol])]), float(vals[int(r[lcol])])
            g, s = float(r["g"]), float(r["s"])
            c = computed_value(r["formula"], r["arith"], fmt, b, l_, g, s)
            X = (Fraction(g) - 1) * Fraction(b) + Fraction(g) * Fraction(s) * Fraction(l_)
            ref = round_fraction(X, fmt)
            B = float(compose_bound(r["formula"], np.array([b]), np.array([l_]), np.array([g]), s, fmt,
                                    r["arith"])[0])
            err = float(abs(Fraction(c) - X))
            d = int(abs(ulp_distance(np.array([ref]), np.array([c]), fmt)[0]))
            q = float(ulp(np.array([float(X)]), fmt)[0])
            rec = r["max_err_over_bound"]
            agrees = (d == int(r["max_ulp"])) if which == "max_ulp" else \
                (B > 0 and abs(err / B - rec) <= 2.0**-20 * max(1.0, rec))  # recorded ratio: fp32, rounded
            out.append({**{k: r[k] for k in ("format", "g_label", "g", "s_label", "formula", "arith")},
                        "worst_by": which, "base": b, "lora": l_, "computed": c, "exact": float(X),
                        "rounded_exact": ref, "ulp_error": d, "err_over_ulp": err / q, "bound_over_ulp": B / q,
                        "err_over_bound": err / B if B > 0 else math.nan, "agrees": bool(agrees)})
    return pd.DataFrame(out)


def load_gpu(folder=None) -> pd.DataFrame:
    """The recorded 16-bit GPU run (``data/gpu/exhaustive/compose_exhaustive.csv``)."""
    from ...repro.paths import committed_data

    folder = committed_data("gpu", "exhaustive") if folder is None else folder
    path = folder / RESULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run python -m dora_num.studies.exhaustive_gpu --out DIR on the "
                                "H200, then python -m dora_num.studies.exhaustive_gpu --ingest DIR")
    return pd.read_csv(path)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per format x formula x arithmetic: over all (g, s), the smallest fraction
    correctly rounded and within 1 ULP, the largest ULP error, the violations, the largest
    err/bound, and the (g, s) where the largest ULP error occurs."""
    keys = ["format", "formula", "arith"]
    worst = df.loc[df.groupby(keys)["max_ulp"].idxmax(), keys + ["g_label", "s_label"]]
    agg = df.groupby(keys, as_index=False).agg(
        configs=("g", "size"), pairs_measured=("n_measured", "sum"), min_frac_correctly_rounded=(
            "frac_correctly_rounded", "min"), min_frac_within_1ulp=("frac_within_1ulp", "min"),
        max_ulp=("max_ulp", "max"), violations=("violations", "sum"), max_err_over_bound=("max_err_over_bound", "max"),
        nonfinite=("spurious_nonfinite", "sum"), overflow=("overflow_agree", "sum"))
    return agg.merge(worst.rename(columns={"g_label": "worst_g", "s_label": "worst_s"}), on=keys)


def load_all() -> tuple[pd.DataFrame, list[str]]:
    """The recorded exhaustive results: fp8 (CPU, ``data/exhaustive/``) and, when recorded,
    bf16/fp16 (H200, ``data/gpu/exhaustive/``); and what is missing, in words."""
    from ...repro.paths import committed_data

    missing, parts = [], []
    fp8 = committed_data("exhaustive", FP8_FILE)
    if fp8.is_file():
        parts.append(pd.read_csv(fp8))
    else:
        missing.append(f"{fp8} (python -m dora_num.studies.bounds.exhaustive record-fp8)")
    try:
        parts.insert(0, load_gpu())
    except FileNotFoundError as e:
        missing.append(str(e))
    return (pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()), missing


def collapse_view(df: pd.DataFrame, s_label: str = "1") -> pd.DataFrame:
    """Fraction correctly rounded per format and ``g`` (rows) and formula x arithmetic (columns)."""
    d = df[df["s_label"] == s_label]
    return d.pivot_table(index=["format", "g_minus_1", "g_label"], columns=["formula", "arith"],
                         values="frac_correctly_rounded").sort_index()


def plot_correctly_rounded(df: pd.DataFrame, s_label: str = "1"):
    """Fraction correctly rounded against ``g - 1`` (symlog), one panel per format."""
    import matplotlib.pyplot as plt

    d = df[df["s_label"] == s_label]
    fmts = [f for f in ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2") if f in set(d["format"])]
    fig, axes = plt.subplots(1, len(fmts), figsize=(4.2 * len(fmts), 3.4), squeeze=False, sharey=True)
    for ax, f in zip(axes[0], fmts):
        for (formula, arith), dd in d[d["format"] == f].groupby(["formula", "arith"]):
            dd = dd.sort_values("g_minus_1")
            ax.plot(dd["g_minus_1"], dd["frac_correctly_rounded"], marker="o", ms=3, lw=1,
                    label=f"{formula.removeprefix('compose_')}, {arith}")
        fm = FORMATS[f]
        ax.axvspan(-fm.eps / 4, fm.eps / 2, color="grey", alpha=0.2)
        ax.set_xscale("symlog", linthresh=2.0**-24)
        ax.set(title=f"{f}: every (base, lora) pair, s = {s_label}", xlabel="g - 1",
               ylabel="fraction correctly rounded")
    axes[0][-1].legend(fontsize=7)
    return fig


def attained(df: pd.DataFrame, chk: pd.DataFrame, threshold: float = 0.99) -> pd.DataFrame:
    """The configurations whose largest err/bound reaches ``threshold``, with the input where
    (from :func:`recheck_worst`): where the bound is attained."""
    w = chk[chk["worst_by"] == "max_err_over_bound"]
    w = w[w["err_over_bound"] >= threshold]
    return w[["format", "g_label", "s_label", "formula", "arith", "base", "lora", "computed", "exact", "err_over_ulp",
              "bound_over_ulp", "err_over_bound"]].sort_values("err_over_bound", ascending=False)
