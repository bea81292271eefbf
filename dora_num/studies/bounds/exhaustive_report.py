"""Reading the exhaustive compose results (notebooks 01 and 03): tables, the recorded data sets, and a
re-check of every recorded worst input on the CPU with the package's own functions.

The records: ``data/exhaustive/compose_fp8.csv.gz`` (fp8, CPU) and
``data/gpu/exhaustive/compose_exhaustive.csv.xz`` (bf16/fp16, H200), one row per format x g x s x
formula x arithmetic as written by :func:`.exhaustive.stats_rows` / :func:`.exhaustive.cpu_exhaustive`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pandas as pd

from ...numerics.formats import get_format
from .datasets import COMPOSE_FP8, COMPOSE_GPU
from .exhaustive import all_values, eager_variants



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
    (``compose_bound`` itself) in ULPs of the format at the exact value, the ulp bound
    (``compose_ulp_bound``) and the sum's condition ``kappa_c`` (``compose_condition``), all
    computed here on the CPU, and whether they reproduce what the exhaustive run recorded
    (``agrees``).  ``within_ulp_bound``: the ULP error is within the ulp bound."""
    from ...numerics.bounds import compose_bound, compose_condition, compose_ulp_bound
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
            args = (np.array([b]), np.array([l_]), np.array([g]), s, fmt, r["arith"])
            B = float(compose_bound(r["formula"], *args)[0])
            U = float(compose_ulp_bound(r["formula"], *args)[0])
            kappa = float(compose_condition(*args[:4])[0])
            err = float(abs(Fraction(c) - X))
            d = int(abs(ulp_distance(np.array([ref]), np.array([c]), fmt)[0]))
            q = float(ulp(np.array([float(X)]), fmt)[0])
            rec = r["max_err_over_bound"]
            agrees = (d == int(r["max_ulp"])) if which == "max_ulp" else \
                (B > 0 and abs(err / B - rec) <= 2.0**-20 * max(1.0, rec))  # recorded ratio: fp32, rounded
            out.append({**{k: r[k] for k in ("format", "g_label", "g", "s_label", "formula", "arith")},
                        "worst_by": which, "base": b, "lora": l_, "computed": c, "exact": float(X),
                        "rounded_exact": ref, "ulp_error": d, "err_over_ulp": err / q, "bound_over_ulp": B / q,
                        "err_over_bound": err / B if B > 0 else math.nan, "ulp_bound": U, "kappa_c": kappa,
                        "within_ulp_bound": bool(d <= U), "agrees": bool(agrees)})
    return pd.DataFrame(out)


def load_gpu(folder=None) -> pd.DataFrame:
    """The recorded 16-bit GPU run (``data/gpu/exhaustive/compose_exhaustive.csv.xz``, or ``folder``);
    :class:`~dora_num.repro.recording.RecordedDataMissing` saying how to record it."""
    path = COMPOSE_GPU.subset("results").require(folder)[0]
    return pd.read_csv(path)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per format x formula x arithmetic: over all (g, s), the smallest fraction
    correctly rounded and within 1 ULP, the largest ULP error, the violations of the bound and of
    the ulp bound, the largest err/bound, the pairs with ``kappa_c <= one_ulp_condition`` (the
    domain of lemma 1's 1-ulp claim) and how many of them are more than 1 ULP off, and the
    (g, s) where the largest ULP error occurs."""
    keys = ["format", "formula", "arith"]
    worst = df.loc[df.groupby(keys)["max_ulp"].idxmax(), keys + ["g_label", "s_label"]]
    agg = df.groupby(keys, as_index=False).agg(
        configs=("g", "size"), pairs_measured=("n_measured", "sum"), min_frac_correctly_rounded=(
            "frac_correctly_rounded", "min"), min_frac_within_1ulp=("frac_within_1ulp", "min"),
        max_ulp=("max_ulp", "max"), violations=("violations", "sum"), max_err_over_bound=("max_err_over_bound", "max"),
        ulp_bound_violations=("ulp_bound_violations", "sum"), kappa_le_one_ulp=("kappa_le_one_ulp", "sum"),
        kappa_le_one_ulp_over_1ulp=("kappa_le_one_ulp_over_1ulp", "sum"), nonfinite=("spurious_nonfinite", "sum"),
        overflow=("overflow_agree", "sum"))
    return agg.merge(worst.rename(columns={"g_label": "worst_g", "s_label": "worst_s"}), on=keys)


def gpu_bitwise_failures(folder=None) -> list[str]:
    """The recorded run's check of the kernel against the package on CUDA
    (``compose_exhaustive_bitwise.csv``): one line per (format, g, s) with a nonzero mismatch
    count (computed variants, exact result, bounds, ulp bounds, ``kappa_c``); empty when the
    kernel that produced the record is the package's transcription on that device."""
    path = COMPOSE_GPU.subset("bitwise").require(folder)[0]
    chk = pd.read_csv(path)
    counts = chk.drop(columns=["format", "g", "s", "n_finite"])
    return [f"{r['format']} g={r['g']} s={r['s']}: " + ", ".join(f"{k}={v}" for k, v in counts.loc[i].items() if v)
            for i, r in chk.iterrows() if counts.loc[i].any()]


def load_all(*, gpu: bool = True) -> pd.DataFrame:
    """The recorded exhaustive results: fp8 (CPU, ``data/exhaustive/``: required) and, with
    ``gpu``, bf16/fp16 (H200, ``data/gpu/exhaustive/``); a missing record raises
    :class:`~dora_num.repro.recording.RecordedDataMissing` (a notebook asks first with
    ``ctx.recorded(COMPOSE_GPU, required=False)``)."""
    parts = [pd.read_csv(COMPOSE_FP8.require()[0])]
    if gpu:
        parts.insert(0, load_gpu())
    return pd.concat(parts, ignore_index=True)


def collapse_view(df: pd.DataFrame, s_label: str = "1") -> pd.DataFrame:
    """Fraction correctly rounded per format and ``g`` (rows) and formula x arithmetic (columns)."""
    d = df[df["s_label"] == s_label]
    return d.pivot_table(index=["format", "g_minus_1", "g_label"], columns=["formula", "arith"],
                         values="frac_correctly_rounded").sort_index()


def attained(df: pd.DataFrame, chk: pd.DataFrame, threshold: float = 0.99) -> pd.DataFrame:
    """The configurations whose largest err/bound reaches ``threshold``, with the input where
    (from :func:`recheck_worst`): where the bound is attained."""
    w = chk[chk["worst_by"] == "max_err_over_bound"]
    w = w[w["err_over_bound"] >= threshold]
    return w[["format", "g_label", "s_label", "formula", "arith", "base", "lora", "computed", "exact", "err_over_ulp",
              "bound_over_ulp", "err_over_bound"]].sort_values("err_over_bound", ascending=False)


def one_ulp_claim(df: pd.DataFrame) -> pd.DataFrame:
    """Lemma 1's claim on every pair, per format x formula x arithmetic (over all g, s): the pairs
    measured, those with ``kappa_c <= one_ulp_condition(fmt)`` and how many of them are more than
    1 ULP off (0 for the stable form with fp32 intermediates: the claim), the fraction within 1 ULP
    elsewhere too, and the violations of the per-pair ulp bound (``compose_ulp_bound``: 0 for every
    variant)."""
    keys = ["format", "formula", "arith"]
    out = df.groupby(keys, as_index=False)[["n_measured", "kappa_le_one_ulp", "kappa_le_one_ulp_over_1ulp",
                                             "ulp_bound_le_1", "ulp_bound_violations"]].sum()
    out["frac_well_conditioned"] = out["kappa_le_one_ulp"] / out["n_measured"]
    return out
