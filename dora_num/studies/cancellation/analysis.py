"""Notebook 01 (cancellation at g≈1): compose error on real activations, and the paper's benchmark.

The collapse fractions of trained adapters (the H200 record) are :mod:`.trained`'s; this module holds

The method in full: docs/methods.md, studies/cancellation/analysis.py.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

from ...adapters.corpus import load_corpus
from ...adapters.model import load_base_model, tokenize
from ...adapters.peft_io import load_peft_dora
from ...numerics.emulate import emulate
from ...numerics.formulas import scale_constants
from ...numerics.formats import get_format, round_to, ulp_distance
from ...numerics.ground_truth import compose_exact
from ...ops.norm import factored_row_norm, magnitude_scale
from ...repro.provenance import read_provenance
from .datasets import AGREEMENT, PAPER_SHAPE, TRAINED
from .runs import CROSSCHECK, resolve_base

PAPER_G_VALUES = (0.9, 0.99, 0.999, 0.9999, 1.0, 1.0001, 1.001, 1.01, 1.1)
PAPER_PEAK = {"naive": 2.342e-2, "stable": 7.81e-3, "ratio": 3.0}  # [2048, 8192], bf16, g = 1

VARIANTS = (("per_op", "fp32"), ("fp32", "fp32"), ("fp32", "storage"))  # (arithmetic, where g is held)
VARIANT_LABEL = {("per_op", "fp32"): "per-op in format (g in format)", ("fp32", "fp32"): "fp32 intermediates",
                 ("fp32", "storage"): "fp32 intermediates, g in format"}


# The compose study's input, read in SMOKE mode too: the H200 record's r = 16, lr 1e-3 export (the
# cross-check configuration) and the manifest naming the base weights it was trained on.
COMPOSE_RUN = f"r{CROSSCHECK[0]}_lr{CROSSCHECK[1]:g}"
COMPOSE_ADAPTER = TRAINED.subset("export_config", "export_weights", "manifest")
__all__ = ["AGREEMENT", "COMPOSE_ADAPTER", "PAPER_SHAPE"]  # the data sets notebook 01 asks for by this module


# ----------------------------------------------------------------------------
# 1. Real activations of a trained adapter.
# ----------------------------------------------------------------------------

def compose_adapter() -> tuple:
    """``(adapter folder, base record)`` of :data:`COMPOSE_ADAPTER`: the committed export and the
    manifest's ``base`` (what :func:`.runs.resolve_base` rebuilds and checks)."""
    import json

    COMPOSE_ADAPTER.require()
    cfg, manifest = COMPOSE_ADAPTER.path("export_config"), COMPOSE_ADAPTER.path("manifest")
    return cfg.parent, json.loads(manifest.read_text())["base"]


def real_compose_inputs(adapter_dir=None, modules=None, *, base_dir=None, n_texts: int = 16,
                        max_rows: int | None = 64, seed: int = 0, with_g: bool = False):
    """``{module: (base, lora, s)}``: fp32 ``x W^T`` and ``x A^T B^T`` on real text (base MiniLM inputs x).

    ``adapter_dir``: a PEFT DoRA adapter on ``base_dir`` (default: the packaged MiniLM); without it, the
    committed trained adapter (:data:`COMPOSE_ADAPTER`) on the base weights it was trained on (rebuilt in a
    temporary folder and checked against the fingerprint the runs recorded).  ``max_rows``: a seeded sample of
    that many token rows per module; ``None``: every token of the ``n_texts`` validation summaries (padding
    dropped).  ``with_g``: the tuples are ``(base, lora, s, g)`` with the adapter's own fp32
    ``g = m / ||W + sBA||_row`` (factored norm, as ``DoRALinear`` forms it), one per output row."""
    if adapter_dir is None:
        import tempfile
        from pathlib import Path

        if base_dir is not None:
            raise ValueError("base_dir is for a given adapter_dir; the committed adapter's base is its record's")
        adapter_dir, base = compose_adapter()
        with tempfile.TemporaryDirectory(prefix="dora-num-01-base-") as tmp:
            model, tok = load_base_model(resolve_base(base, Path(tmp)))
    else:
        model, tok = load_base_model(base_dir)
    states = {s.name: s for s in load_peft_dora(adapter_dir, model)}
    names = sorted(states) if modules is None else list(modules)
    texts = [p["summary"] for p in load_corpus(split="validation")[:n_texts]]
    inputs: dict[str, list] = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda m, i, o, n=n: inputs.setdefault(n, []).append(i[0].reshape(-1, i[0].shape[-1]))) for n in names]
    with torch.no_grad():
        batch = tokenize(tok, texts)
        model(**batch)
    for h in hooks:
        h.remove()
    keep = batch["attention_mask"].reshape(-1).bool()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    with torch.no_grad():
        for n in names:
            x = torch.cat(inputs[n])[keep]
            if max_rows is not None:
                x = x[torch.randperm(x.shape[0], generator=gen)[:max_rows].sort().values]
            st = states[n]
            base = x @ st.W.T.float()
            lora = (x @ st.A.T.float()) @ st.B.T.float()
            out[n] = (base.numpy().astype(np.float64), lora.numpy().astype(np.float64), float(st.scale))
            if with_g:
                g = magnitude_scale(st.m.float(), factored_row_norm(st.W, st.A, st.B, st.scale))
                out[n] += (g.double().numpy(),)
    return out


def g_sweep(fmt, n_per_decade: int = 4, lo_exp: int = -22, hi_exp: int = -3) -> np.ndarray:
    """fp32 values of g with ``|g-1|`` from ``2^lo_exp`` to ``2^hi_exp`` on both sides of 1
    (``n_per_decade`` points per octave), plus g = 1 and the exact zone ends of ``fmt``,
    each with its fp32 neighbours."""
    fmt = get_format(fmt)
    k = np.arange(lo_exp * n_per_decade, hi_exp * n_per_decade + 1) / n_per_decade
    d = 2.0 ** k
    special = round_to(np.array([1.0, 1 - fmt.spacing_below_one / 2, 1 + fmt.spacing_above_one / 2]), "fp32")
    s32 = special.astype(np.float32)
    special = np.concatenate([special, np.nextafter(s32, np.float32(2)).astype(np.float64),
                              np.nextafter(s32, np.float32(0)).astype(np.float64)])
    g = round_to(np.concatenate([1 + d, 1 - d, special]), "fp32")
    return np.unique(g)


def compose_error_sweep(inputs: dict, g_values: np.ndarray, formats=("bf16", "fp16"), *,
                        variants=VARIANTS) -> pd.DataFrame:
    """Per format x module x g x formula x variant: ULP errors against the correctly rounded exact compose.

    Inputs are stored in the format first (``round_to``), so every arithmetic and
    the exact reference see the same values.  Columns: ``ulp_median``, ``ulp_p99``,
    ``ulp_max``, ``frac_le1`` (elements within 1 ulp), ``n``, ``term_lost_median``
    (``|error| / |(g-1)*base|``, median: 1 means the ``(g-1)*base`` term is lost);
    the precondition of the 1-ulp claim (:func:`dora_num.numerics.bounds.compose_ulp_bound`):
    ``n_within_bound`` (elements within their own ulp bound, a function of the compose
    sum's condition ``kappa_c``), ``n_well`` (``kappa_c <= one_ulp_condition(fmt)``),
    ``n_le1_well`` (of those, within 1 ulp), ``kappa_max`` and ``ulp_bound_max``.
    ``g`` may be a value or, with ``g_values=None``, the adapter's own per-row ``g``
    (inputs of :func:`real_compose_inputs` with ``with_g=True``; column ``g`` = NaN).
    """
    from ...numerics.bounds import compose_condition, compose_ulp_bound, one_ulp_condition

    rows = []
    for fname in formats:
        fmt = get_format(fname)
        K = one_ulp_condition(fmt)
        for mod, (base, lora, s, *own) in inputs.items():
            b, l = round_to(base, fmt), round_to(lora, fmt)
            g_row = np.broadcast_to(own[0], b.shape) if own else None
            ok = np.isfinite(b) & np.isfinite(l)
            g_own = g_row[ok].ravel() if own else None
            b, l = b[ok].ravel(), l[ok].ravel()
            for g in (g_values if g_values is not None else [np.nan]):
                gg = np.full_like(b, g) if np.isfinite(g) else g_own
                truth = compose_exact(b, l, gg, s, fmt)
                term = np.abs((gg - 1.0) * b)
                kap = compose_condition(b, l, gg, s)
                well = kap <= K
                for formula in ("compose_naive", "compose_stable"):
                    for variant, g_in in variants:
                        out = emulate(formula, {"base": b, "lora": l, "g": gg, "s": s}, fmt, variant, g_in)
                        fin = np.isfinite(out)
                        e = np.abs(ulp_distance(np.where(fin, out, 0.0), truth.rounded, fmt)).astype(np.float64)
                        e[~fin] = np.inf
                        with np.errstate(divide="ignore", invalid="ignore"):
                            lost = np.abs(out - truth.value) / term
                        ub = compose_ulp_bound(formula, b, l, gg, s, fmt, variant, g_in)
                        rows.append({
                            "format": fmt.name, "module": mod, "g": g, "gm1": g - 1.0, "formula": formula,
                            "variant": VARIANT_LABEL[(variant, g_in)], "n": int(e.size),
                            "ulp_median": float(np.median(e)), "ulp_mean": float(e.mean()), "ulp_p99": float(np.quantile(e, 0.99)),
                            "ulp_max": float(e.max()), "n_le1": int((e <= 1).sum()),
                            "term_lost_median": float(np.nanmedian(lost[term > 0])) if (term > 0).any() else np.nan,
                            "n_within_bound": int((e <= ub).sum()), "n_well": int(well.sum()),
                            "n_le1_well": int((e[well] <= 1).sum()), "kappa_max": float(kap.max()),
                            "ulp_bound_max": float(ub.max()),
                        })
    df = pd.DataFrame(rows)
    df["frac_le1"] = df["n_le1"] / df["n"]
    return df


def error_by_cancellation(inputs: dict, g_values, formats=("bf16", "fp16"), *, min_n: int = 100) -> pd.DataFrame:
    """Per format, formula (fp32 intermediates, one final rounding: the contract's arithmetic) and power-of-two
    bin of ``rho = |base| / |X|`` (``X`` the exact compose on the stored inputs; ``X = 0`` left out): elements,
    mean and max ULP error against the correctly rounded result, elements beyond 1 ulp.

    ``rho`` is the naive form's own cancellation ratio: ``g (s lora + base) - base`` rounds (in fp32) terms of
    size ``|base|`` before they cancel down to ``X``, so its rounding error in ulps of ``X`` grows like
    ``rho 2^(p-23)`` and can reach half an ulp once ``rho`` is about ``2^(22-p)``.  The stable form rounds
    ``(g-1) base`` and ``g s lora`` instead (its condition is ``kappa_c``).  ``|g-1|`` sets ``rho`` only where
    ``s lora`` is negligible against ``(g-1) base`` (an adapter early in training: ``rho ~ 1/|g-1|``).  Bins with
    fewer than ``min_n`` elements are marked ``sparse``."""
    fp32 = VARIANT_LABEL[("fp32", "fp32")]
    acc: dict[tuple, list] = {}
    for fname in formats:
        fmt = get_format(fname)
        for base, lora, s, *_ in inputs.values():
            b, l = round_to(base, fmt), round_to(lora, fmt)
            ok = np.isfinite(b) & np.isfinite(l)
            b, l = b[ok].ravel(), l[ok].ravel()
            for g in g_values:
                gg = np.full_like(b, g)
                truth = compose_exact(b, l, gg, s, fmt)
                nz = truth.value != 0
                k = np.floor(np.log2(np.abs(b[nz]) / np.abs(truth.value[nz]) + np.finfo(float).tiny)).astype(int)
                k = np.maximum(k, -1)  # rho < 1/2 in one bin
                for formula in ("compose_naive", "compose_stable"):
                    out = emulate(formula, {"base": b, "lora": l, "g": gg, "s": s}, fmt, "fp32")
                    e = np.abs(ulp_distance(out, truth.rounded, fmt))[nz].astype(np.float64)
                    for kk in np.unique(k):
                        sel = e[k == kk]
                        a = acc.setdefault((fmt.name, formula, int(kk)), [0, 0.0, 0.0, 0])
                        a[0] += sel.size
                        a[1] += float(sel.sum())
                        a[2] = max(a[2], float(sel.max()))
                        a[3] += int((sel > 1).sum())
    rows = [{"format": f, "formula": fo, "variant": fp32, "log2_rho": k, "n": n, "ulp_mean": tot / n, "ulp_max": mx,
             "n_gt1": gt1} for (f, fo, k), (n, tot, mx, gt1) in sorted(acc.items())]
    df = pd.DataFrame(rows)
    df["sparse"] = df["n"] < min_n
    return df


def cancellation_headline(tab: pd.DataFrame) -> dict:
    """From :func:`error_by_cancellation`, per format: Spearman of the naive form's mean ULP error against
    ``log2 rho`` over the bins that are not sparse, its mean error in the smallest and largest fifth of those
    bins, the smallest ``rho`` bin where it is beyond 1 ulp (against the predicted ``2^(22-p)``), and the
    stable form's worst error."""
    from ...numerics.bounds import one_ulp_condition

    out = {}
    for fmt, sub in tab[~tab["sparse"]].groupby("format"):
        nv = sub[sub["formula"] == "compose_naive"].sort_values("log2_rho")
        lo, hi = nv["log2_rho"].quantile(0.2), nv["log2_rho"].quantile(0.8)
        every = tab[tab["format"] == fmt]  # sparse bins included
        naive, stable = every[every["formula"] == "compose_naive"], every[every["formula"] == "compose_stable"]
        beyond = naive[naive["n_gt1"] > 0]
        out[fmt] = {"bins": int(len(nv)),
                    "spearman_log2rho_vs_mean_ulp": float(spearmanr(nv["log2_rho"], nv["ulp_mean"]).statistic),
                    "naive_mean_ulp_smallest_fifth": float(nv[nv["log2_rho"] <= lo]["ulp_mean"].mean()),
                    "naive_mean_ulp_largest_fifth": float(nv[nv["log2_rho"] >= hi]["ulp_mean"].mean()),
                    "naive_first_bin_beyond_1ulp_log2rho": int(beyond["log2_rho"].min()) if len(beyond) else None,
                    "predicted_log2rho": float(np.log2(one_ulp_condition(fmt))),
                    "stable_ulp_max": float(stable["ulp_max"].max()), "naive_ulp_max": float(naive["ulp_max"].max())}
    return out


def error_by_gm1(sweep: pd.DataFrame) -> pd.DataFrame:
    """The sweep (g = 1 left out) averaged per format x formula x variant x side of 1 x
    ``|g-1|``: ``ulp_mean`` and ``term_lost_median``."""
    sw = sweep[sweep["g"] != 1.0].assign(abs_gm1=lambda d: d["gm1"].abs(),
                                          side=lambda d: np.where(d["gm1"] > 0, "g > 1", "g < 1"))
    return sw.groupby(["format", "formula", "variant", "side", "abs_gm1"], as_index=False)[
        ["ulp_mean", "term_lost_median"]].mean()


# ----------------------------------------------------------------------------
# 2. The paper's benchmark.
# ----------------------------------------------------------------------------

def recorded_paper_benchmark(shape) -> pd.DataFrame:
    """The g = 1 paper-shape benchmark as recorded in ``data/01_cancellation_at_g1/`` by
    notebook 01 with ``RECOMPUTE_PAPER_SHAPE = True`` (about 3 minutes on 2 cores, so
    ``make reproduce`` reads it instead).  Refuses a record made at another shape."""
    (path,) = PAPER_SHAPE.require()
    at = read_provenance(path)["parameters"].get("PAPER_SHAPE_AT_G1")
    if list(at or []) != list(shape):
        raise ValueError(f"{path} was recorded at shape {at}, not {list(shape)}; {PAPER_SHAPE.how_to_record}")
    return pd.read_csv(path)


def paper_benchmark(shape=(2048, 8192), g_values=PAPER_G_VALUES, *, s: float = 0.5, seed: int = 1234,
                    fmt="bf16") -> pd.DataFrame:
    """The paper's stability benchmark (docs/paper.md) and the two floors that explain it.

    lora, base ~ N(0,1) in fp64 (seed 1234); per g: inputs and g stored in bf16,
    every op in bf16 (eager bf16 PyTorch = ``per_op`` emulation); reference: the
    stable formula in float64 on the fp64 inputs (the paper's; its own float64
    error is ~1e-16, invisible at these sizes).  Metric: max absolute error.
    Floors: ``output_floor`` = max |fl(ref) - ref| (rounding the exact result once
    to bf16: no method can do better on this metric); ``cr_stored_floor`` = max
    |CR(exact on the stored inputs) - ref| (input storage + one output rounding).
    ``*_ulp_max`` / ``*_ulp_mean`` = ULP errors against the correctly rounded result
    on the stored inputs with the fp32 g: the metric that sees the ``(g-1)*base``
    term.  ``*_fp32_*``: the same forms with fp32 intermediates and g in fp32.
    """
    fmt = get_format(fmt)
    rng = np.random.default_rng(seed)
    lora64 = rng.standard_normal(shape)
    base64 = rng.standard_normal(shape)
    b, l = round_to(base64, fmt), round_to(lora64, fmt)
    sf = scale_constants(s)[0]
    rows = []
    for g in g_values:
        g32 = float(np.float32(g))
        ref = (g32 - 1.0) * base64 + g32 * (sf * lora64)  # the paper's: fp64 stable formula, fp64 inputs
        gg = np.full(shape, g32)
        truth = compose_exact(b, l, gg, sf, fmt)
        row = {"g": g, "output_floor": float(np.abs(round_to(ref, fmt) - ref).max()),
               "cr_stored_floor": float(np.abs(truth.rounded - ref).max())}
        for formula in ("compose_naive", "compose_stable"):
            out = emulate(formula, {"base": b, "lora": l, "g": gg, "s": sf}, fmt, "per_op")
            key = formula.split("_")[1]
            row[f"{key}_max_abs"] = float(np.abs(out - ref).max())
            row[f"{key}_ulp_max"] = float(np.abs(ulp_distance(out, truth.rounded, fmt)).max())
            row[f"{key}_ulp_mean"] = float(np.abs(ulp_distance(out, truth.rounded, fmt)).mean())
        for formula in ("compose_naive", "compose_stable"):  # the contract: fp32 intermediates, g in fp32
            out = emulate(formula, {"base": b, "lora": l, "g": gg, "s": sf}, fmt, "fp32")
            key = formula.split("_")[1] + "_fp32"
            row[f"{key}_max_abs"] = float(np.abs(out - ref).max())
            row[f"{key}_ulp_mean"] = float(np.abs(ulp_distance(out, truth.rounded, fmt)).mean())
        row["ratio_max_abs"] = row["naive_max_abs"] / row["stable_max_abs"]
        rows.append(row)
    return pd.DataFrame(rows)


def headline(sweep: pd.DataFrame) -> dict:
    """The claims the notebook asserts (see its last cell)."""
    fp32 = VARIANT_LABEL[("fp32", "fp32")]
    st = sweep[(sweep["formula"] == "compose_stable") & (sweep["variant"] == fp32)]
    out = {"stable_fp32_frac_within_1ulp": float(st["n_le1"].sum() / st["n"].sum())}
    if "n_within_bound" in st:  # the claim with its precondition (numerics.bounds.compose_ulp_bound)
        from ...numerics.bounds import one_ulp_condition

        n_ill = st["n"].sum() - st["n_well"].sum()
        out.update({
            "stable_fp32_all_within_ulp_bound": bool((st["n_within_bound"] == st["n"]).all()),
            "stable_fp32_frac_within_1ulp_where_well_conditioned": float(st["n_le1_well"].sum() / max(st["n_well"].sum(), 1)),
            "stable_fp32_n_well_conditioned": int(st["n_well"].sum()), "stable_fp32_n_ill_conditioned": int(n_ill),
            "stable_fp32_frac_within_1ulp_where_ill_conditioned":
                float((st["n_le1"].sum() - st["n_le1_well"].sum()) / n_ill) if n_ill else float("nan"),
            "stable_fp32_ulp_max": float(st["ulp_max"].max()), "stable_fp32_kappa_max": float(st["kappa_max"].max()),
            "one_ulp_condition": {f: one_ulp_condition(f) for f in sorted(st["format"].unique())},
        })
    # Naive with fp32 intermediates isolates the cancellation (g exact in fp32, no
    # storage rounding of g): its mean ULP error against |g-1|, g = 1 excluded.
    nv = sweep[(sweep["formula"] == "compose_naive") & (sweep["variant"] == fp32) & (sweep["g"] != 1.0)
               & np.isfinite(sweep["g"])]
    for fmt, sub in nv.groupby("format"):
        w = sub.assign(err=sub["ulp_mean"] * sub["n"])
        agg = w.groupby("gm1")[["err", "n"]].sum()
        agg = pd.DataFrame({"absd": np.abs(agg.index.to_numpy()), "err": (agg["err"] / agg["n"]).to_numpy()})
        rho = spearmanr(agg["absd"], agg["err"]).statistic
        small = agg[agg["absd"] <= agg["absd"].quantile(0.2)]["err"].mean()
        large = agg[agg["absd"] >= agg["absd"].quantile(0.8)]["err"].mean()
        out[f"naive_fp32_{fmt}"] = {"spearman_absd_vs_mean_ulp": float(rho), "mean_ulp_smallest_fifth": float(small),
                                    "mean_ulp_largest_fifth": float(large)}
    return out


def claim_markdown(h: dict) -> str:
    """Markdown stating, from :func:`headline`'s numbers, what holds, where, and what does not."""
    if "stable_fp32_all_within_ulp_bound" not in h:
        return f"Stable compose, fp32 intermediates: {h['stable_fp32_frac_within_1ulp']:.4%} of elements within 1 ulp."
    K = ", ".join(f"{f}: {k:g}" for f, k in h["one_ulp_condition"].items())
    ill = h["stable_fp32_n_ill_conditioned"]
    lines = [
        "**What holds.** The stable compose with fp32 intermediates and one final rounding is within its "
        "a-priori ulp bound on every element (" + ("yes" if h["stable_fp32_all_within_ulp_bound"] else "**NO**") + "), "
        "and within 1 ulp of the correctly rounded result on "
        f"{h['stable_fp32_frac_within_1ulp_where_well_conditioned']:.4%} of the "
        f"{h['stable_fp32_n_well_conditioned']:,} elements where the compose sum is well conditioned "
        f"(kappa_c <= {K}).",
        f"**Where it does not.** {ill:,} elements have a larger kappa_c (`(g-1)*base` and `g*s*lora` nearly cancel); "
        + (f"{h['stable_fp32_frac_within_1ulp_where_ill_conditioned']:.4%} of them are still within 1 ulp, "
           if ill else "")
        + f"the worst is {h['stable_fp32_ulp_max']:g} ulps (largest kappa_c {h['stable_fp32_kappa_max']:.3g}); "
        "beyond the condition the bound grows like `1 + (1 + 2 kappa_c) 2^(p-23)` ulps.",
        f"**Overall** {h['stable_fp32_frac_within_1ulp']:.4%} of all elements are within 1 ulp.",
    ]
    return "\n\n".join(lines)


AGREEMENT_FACTOR = 2.0  # same-dtype-baseline convention of the house tests (flash-attention style)


def agreement_verdict(df: pd.DataFrame) -> dict:
    """Loss-agreement criterion between the PEFT and ``dora_num`` backends.

    Both backends evaluate the same function in fp32 with different, equally valid
    operation orders (PEFT: dense ``W + sBA``, ``torch.linalg.norm`` (not correctly
    rounded on CPU), bias fused into the base GEMM; ours: factored norm with a
    correctly rounded sqrt, bias added after the GEMM, the contract's compose
    sequence).  At init they differ by fp32 rounding only; training then amplifies
    any difference.  The yardstick is therefore what training does to a
    difference of that size: the baseline run is our backend with every initial
    magnitude moved by one fp32 ulp (random sign).  The criterion: over the run,
    both the mean and the max of ``|L_peft - L_ours|`` are at most
    ``AGREEMENT_FACTOR`` times those of ``|L_perturbed - L_ours|``.  (At init the
    two backends' outputs are also held to an fp64 evaluation, in
    ``tests/adapters/test_train.py``.)
    """
    d_peft = (df["peft"] - df["dora_num"]).abs()
    d_base = (df["dora_num_perturbed"] - df["dora_num"]).abs()
    out = {"steps": int(len(df)), "mean_abs_delta_peft": float(d_peft.mean()), "max_abs_delta_peft": float(d_peft.max()),
           "mean_abs_delta_baseline": float(d_base.mean()), "max_abs_delta_baseline": float(d_base.max()),
           "factor": AGREEMENT_FACTOR}
    out["agree"] = bool(out["mean_abs_delta_peft"] <= AGREEMENT_FACTOR * out["mean_abs_delta_baseline"]
                        and out["max_abs_delta_peft"] <= AGREEMENT_FACTOR * out["max_abs_delta_baseline"])
    return out
