"""Notebook 02, the GPU side: recorded H200 results of the FMA/sqrt variants
against the exact CPU emulation.

The GPU suite (:func:`dora_num.studies.gpu_suite.bench_fma`) records, under
``data/gpu/``:

- ``fma_sqrt.csv``: per variant (norm assembly: contraction on/off x ``tl.sqrt``
  / ``tl.sqrt_rn`` / PTX ``sqrt.rn.f32``; compose fp32/bf16: contraction on/off)
  the bitwise agreement with the torch reference over all ``n`` seeded inputs,
  ULP histogram columns ``ulp_0 .. ulp_>4`` and PTX instruction counts;
- ``fma_sqrt_sample.npz``: the first inputs and every variant's outputs;
- ``device.json``: GPU, driver, torch/triton versions, git sha.

The inputs are seeded numpy streams (:func:`~dora_num.studies.gpu_suite.fma_inputs`,
:func:`~dora_num.studies.gpu_suite.compose_fma_inputs`), so the CPU regenerates all
of them bit for bit and *predicts* each deterministic variant exactly: contraction
off = the production sequence; contraction on = an FMA at the formula's marked
site (``"fma"``) or at its alternative (``"alt"``: the compiler contracted the
other product), see :mod:`dora_num.studies.fma_models`.  The approximate sqrt
is predicted as a set (faithful model): a disagreement-rate interval, and every
output one of the two neighbours of the exact root.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..numerics.formats import round_to, ulp_distance
from ..numerics.formulas import scale_constants
from ..repro.paths import committed_data
from . import fma_models as M
from .fma_sqrt import gpu_suite_assembly_inputs, sqrt_platform_row

GPU_FILES = ("fma_sqrt.csv", "fma_sqrt_sample.npz")
DTYPE_FMT = {"float32": "fp32", "bfloat16": "bf16"}
ULP_COLS = ("0", "1", "2", "3", "4", ">4")


class GPUDataMissing(FileNotFoundError):
    """The recorded GPU results are not in the repository."""


def gpu_dir() -> Path:
    return committed_data("gpu")


def missing_files(folder: Path | None = None) -> list[Path]:
    folder = Path(folder) if folder is not None else gpu_dir()
    return [folder / f for f in GPU_FILES if not (folder / f).is_file()]


def load(folder: Path | None = None) -> dict:
    """``{"csv": DataFrame, "sample": dict of arrays, "device": dict, "provenance": dict}``.

    Raises :class:`GPUDataMissing` naming every missing file (run
    ``python -m dora_num gpu-suite --only fma --out DIR`` on the H200, then
    ``python -m dora_num gpu-suite --ingest DIR``)."""
    folder = Path(folder) if folder is not None else gpu_dir()
    missing = missing_files(folder)
    if missing:
        raise GPUDataMissing("recorded GPU results missing: " + ", ".join(str(p) for p in missing)
                             + " (record them on the H200: python -m dora_num gpu-suite --only fma --out DIR; "
                             "then python -m dora_num gpu-suite --ingest DIR)")
    csv = pd.read_csv(folder / "fma_sqrt.csv")
    with np.load(folder / "fma_sqrt_sample.npz") as z:
        sample = {k: z[k] for k in z.files}
    dev = folder / "device.json"
    prov = folder / "fma_sqrt.csv.provenance.json"
    return {"csv": csv, "sample": sample, "device": json.loads(dev.read_text()) if dev.is_file() else {},
            "provenance": json.loads(prov.read_text()) if prov.is_file() else {}}


# --------------------------------------------------------------------------
# Predictions on the full regenerated inputs
# --------------------------------------------------------------------------

def _ulp_cols(d: np.ndarray) -> dict:
    a = np.abs(d)
    out = {f"ulp_{k}": int((a == int(k)).sum()) for k in ULP_COLS[:-1]}
    out["ulp_>4"] = int((a > 4).sum())
    return out


def _sample_terms(sample: dict) -> dict:
    """The recorded norm-assembly inputs (what the GPU saw) as formula inputs."""
    _, two_s, s_sq = scale_constants(float(sample["scale"]))
    return {"base_sq": sample["norm_base_sq"].astype(np.float64), "cross": sample["norm_cross"].astype(np.float64),
            "ba": sample["norm_ba"].astype(np.float64), "two_s": two_s, "s_sq": s_sq}


def _sample_t(sample: dict, key: str = "none") -> np.ndarray:
    """The value under the root for the recorded inputs (contraction off or on at both sites)."""
    return M.evaluate("norm_assembly", (key, key), _sample_terms(sample), sqrt=lambda x: x)


def predict_norm(n: int) -> pd.DataFrame:
    """Predicted agreement with the torch CUDA reference for every norm-assembly variant,
    on all ``n`` regenerated inputs."""
    inp = gpu_suite_assembly_inputs(n, n)
    t = {c: M.evaluate("norm_assembly", (c, c), inp.terms(), sqrt=lambda x: x) for c in ("none", "fma")}
    ref = M.sqrt_rn(t["none"])
    rows = []
    for fusion, key in ((False, "none"), (True, "fma")):
        rn, other, _ = M.sqrt_neighbours(t[key])
        for sq in ("approx", "rn", "ptx"):
            name = f"norm_fusion{'On' if fusion else 'Off'}_{sq}"
            if sq == "approx":  # faithful: each output is rn or other; the rate lies between these
                lo = float(((rn == ref) & (other == ref)).mean())
                hi = float(((rn == ref) | (other == ref)).mean())
                rows.append({"variant": name, "model": "faithful sqrt", "agreement_lo": lo, "agreement_hi": hi,
                             "exact_prediction": False})
            else:
                rows.append({"variant": name, "model": "fma at both sites" if fusion else "production sequence",
                             "agreement_lo": float((rn == ref).mean()), "agreement_hi": float((rn == ref).mean()),
                             "exact_prediction": True, **_ulp_cols(ulp_distance(ref, rn, "fp32"))})
    return pd.DataFrame(rows)


def _compose_values(rows: int, cols: int, fmt: str, choice: tuple[str, ...]):
    from .gpu_suite import SCALE, compose_fma_inputs

    base, lora, g = compose_fma_inputs(rows, cols)
    s = scale_constants(SCALE)[0]
    args = {"base": round_to(base.astype(np.float64), fmt), "lora": round_to(lora.astype(np.float64), fmt),
            "g": g.astype(np.float64)[None, :], "s": s}
    return round_to(M.evaluate("compose_stable", choice, args), fmt)


def predict_compose(rows: int = 2048, cols: int = 2048) -> pd.DataFrame:
    """Predicted agreement of the compose variants (contraction off, or on at either product)."""
    out = []
    for dn, fmt in DTYPE_FMT.items():
        ref = _compose_values(rows, cols, fmt, ("none",))
        for choice in M.placements("compose_stable"):
            v = _compose_values(rows, cols, fmt, choice)
            fusion = choice != ("none",)
            out.append({"variant": f"compose_{dn}_fusion{'On' if fusion else 'Off'}",
                        "model": M.placement_label(choice), "agreement_lo": float((v == ref).mean()),
                        "agreement_hi": float((v == ref).mean()), "exact_prediction": True,
                        **_ulp_cols(ulp_distance(ref, v, fmt))})
    return pd.DataFrame(out)


def compare_rates(csv: pd.DataFrame, pred: pd.DataFrame) -> pd.DataFrame:
    """Measured agreement (GPU, all inputs) beside each model's prediction."""
    m = pred.merge(csv[["variant", "agreement", "production", "n"]], on="variant", how="left")
    m = m.rename(columns={"agreement": "gpu_agreement"})
    tol = 0.5 / m["n"].astype(float)  # the rates are counts / n: equal counts <=> |diff| < 1/(2n)
    m["within_prediction"] = (m["gpu_agreement"] >= m["agreement_lo"] - tol) & (m["gpu_agreement"] <= m["agreement_hi"] + tol)
    return m


# --------------------------------------------------------------------------
# Bit for bit on the recorded sample
# --------------------------------------------------------------------------

def sample_checks(sample: dict, n_total: int | None = None) -> pd.DataFrame:
    """Per recorded output: fraction equal, bit for bit, to each emulated model.
    ``inputs_regenerated``: the recorded inputs are the first ones of the suite's
    ``n_total`` seeded inputs (None: not checked)."""
    rows = []
    terms = _sample_terms(sample)
    n = terms["base_sq"].size
    same_inputs = None
    if n_total is not None:
        inp = gpu_suite_assembly_inputs(n, n_total)
        same_inputs = bool(np.array_equal(inp.base_sq, terms["base_sq"]) and np.array_equal(inp.cross, terms["cross"])
                           and np.array_equal(inp.ba, terms["ba"]))
    t = {k: _sample_t(sample, k) for k in ("none", "fma")}
    ref = sample["norm_ref_torch_cuda"].astype(np.float64)
    rows.append({"output": "norm_ref_torch_cuda", "model": "production sequence", "n": n, "inputs_regenerated": same_inputs,
                 "bitwise": float((M.sqrt_rn(t["none"]) == ref).mean()), "faithful": None})
    for key in sample:
        if not key.startswith("norm_fusion"):
            continue
        fusion = "fusionOn" in key
        tt = t["fma" if fusion else "none"]
        got = sample[key].astype(np.float64)
        if key.endswith("_approx"):
            chk = M.check_faithful(tt, got)
            rows.append({"output": key, "model": "faithful sqrt" + (" after fma" if fusion else ""), "n": n,
                         "inputs_regenerated": same_inputs, "bitwise": float((got == M.sqrt_rn(tt)).mean()),
                         "faithful": float(1 - chk.n_outside / max(chk.n, 1))})
        else:
            rows.append({"output": key, "model": "fma at both sites" if fusion else "production sequence", "n": n,
                         "inputs_regenerated": same_inputs, "bitwise": float((got == M.sqrt_rn(tt)).mean()),
                         "faithful": None})
    base, lora, g = (sample[k].astype(np.float64) for k in ("compose_base", "compose_lora", "compose_g"))
    s = scale_constants(float(sample["scale"]))[0]
    for dn, fmt in DTYPE_FMT.items():
        args = {"base": round_to(base, fmt), "lora": round_to(lora, fmt), "g": g[None, :], "s": s}
        for key in (f"compose_ref_{dn}", f"compose_{dn}_fusionOff", f"compose_{dn}_fusionOn"):
            if key not in sample:
                continue
            got = sample[key].astype(np.float64)
            choices = [("none",)] if not key.endswith("fusionOn") else [("fma",), ("alt",)]
            for ch in choices:
                v = round_to(M.evaluate("compose_stable", ch, args), fmt)
                rows.append({"output": key, "model": M.placement_label(ch), "n": int(got.size),
                             "inputs_regenerated": None, "bitwise": float((v == got).mean()), "faithful": None})
    return pd.DataFrame(rows)


def platform_rows(sample: dict) -> pd.DataFrame:
    """GPU rows of the sqrt platform table: each recorded root of the values under the
    root (fusion off), against the exact result."""
    x = _sample_t(sample)
    impls = {"torch.sqrt (CUDA)": "norm_ref_torch_cuda", "Triton tl.sqrt": "norm_fusionOff_approx",
             "Triton tl.sqrt_rn": "norm_fusionOff_rn", "inline PTX sqrt.rn.f32": "norm_fusionOff_ptx"}
    return pd.DataFrame([sqrt_platform_row(impl, "norm_assembly_inputs (GPU sample)", x, sample[k].astype(np.float64))
                         for impl, k in impls.items() if k in sample])


def threshold_model(sample: dict, key: str = "norm_fusionOff_approx") -> dict:
    """How well 'differs iff the exact root is within tau ulps of the rounding boundary'
    describes the recorded ``tl.sqrt``: tau fitted on even elements, tested on odd ones."""
    x = _sample_t(sample)
    d = M.midpoint_distance(x)
    differs = sample[key].astype(np.float64) != M.sqrt_rn(x)
    fit, test = slice(0, None, 2), slice(1, None, 2)
    taus = np.unique(np.concatenate([[0.0], d[fit][differs[fit]], [0.5]]))
    acc = [((d[fit] < tau) == differs[fit]).mean() for tau in taus]
    tau = float(taus[int(np.argmax(acc))])
    pred = d[test] < tau
    act = differs[test]
    return {"tau_ulp": tau, "fit_accuracy": float(max(acc)), "test_accuracy": float((pred == act).mean()),
            "test_rate_measured": float(act.mean()), "test_rate_predicted": float(pred.mean()),
            "max_distance_of_a_disagreement": float(d[differs].max()) if differs.any() else 0.0}


def ptx_table(csv: pd.DataFrame) -> pd.DataFrame:
    cols = ["variant"] + [c for c in csv.columns if c.startswith("ptx_")]
    return csv[cols].copy()


def headline_failures(csv: pd.DataFrame, rates: pd.DataFrame, checks: pd.DataFrame) -> list[str]:
    """Everything the notebook's last cell asserts about the GPU, as failure messages."""
    bad = []
    for _, r in csv[csv["production"].astype(bool)].iterrows():
        if r["agreement"] != 1.0:
            bad.append(f"production variant {r['variant']} agrees on {r['agreement']:.6%} of inputs, not 100%")
    # each non-production variant: its rate within the prediction of at least one model
    for v, grp in rates[~rates["production"].astype(bool)].groupby("variant"):
        if not grp["within_prediction"].any():
            bad.append(f"{v}: GPU agreement {grp['gpu_agreement'].iloc[0]:.6f} outside every model's prediction "
                       + ", ".join(f"{m}: [{lo:.6f}, {hi:.6f}]" for m, lo, hi in
                                   zip(grp["model"], grp["agreement_lo"], grp["agreement_hi"])))
    if (checks["inputs_regenerated"] == False).any():  # noqa: E712 - None means not checked
        bad.append("the recorded norm inputs are not the suite's seeded inputs (the CPU regenerated others)")
    for out, grp in checks.groupby("output"):
        faithful = grp["faithful"].dropna()
        if len(faithful):
            if (faithful < 1).any():
                bad.append(f"{out}: some outputs are not faithful roots (faithful fraction {faithful.min():.6f})")
        elif not (grp["bitwise"] == 1.0).any():
            bad.append(f"{out}: no emulated model reproduces the recorded sample bit for bit "
                       f"(best {grp['bitwise'].max():.6f})")
    return bad
