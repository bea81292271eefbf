"""Notebook 02, the GPU side: recorded H200 results of the FMA/sqrt variants
against the exact CPU emulation.

The GPU suite (:func:`dora_num.studies.record_suite.bench_fma`) records, under
``data/gpu/``:

The method in full: docs/methods.md, studies/fma/gpu_vs_emulation.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pandas as pd
from tqdm.std import tqdm

from ...numerics.formats import round_to, ulp_distance
from ...numerics.formulas import scale_constants
from ...repro.paths import committed_data
from ...repro.recording import MACHINE_FILE
from .. import inputs
from .datasets import FMA
from . import models as M
from .sqrt import PROGRESS, gpu_suite_assembly_inputs

DTYPE_FMT = {"float32": "fp32", "bfloat16": "bf16"}
ULP_COLS = ("0", "1", "2", "3", "4", ">4")


def load(folder: Path | None = None) -> dict:
    """``{"csv": DataFrame, "sample": dict of arrays, "device": dict, "provenance": dict}``.

    Raises :class:`~dora_num.repro.recording.RecordedDataMissing` naming every missing
    file and how to record it (:data:`.datasets.FMA`)."""
    FMA.require(folder)
    folder = Path(folder) if folder is not None else committed_data(FMA.folder)
    variants = FMA.path("variants", folder)
    csv = pd.read_csv(variants)
    with np.load(FMA.path("sample", folder)) as z:
        sample = {k: z[k] for k in z.files}
    dev = folder / MACHINE_FILE
    prov = variants.with_name(variants.name + ".provenance.json")
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
    base, lora, g = inputs.suite_compose(rows, cols)
    s = scale_constants(inputs.SUITE_FMA_SCALE)[0]
    args = {"base": round_to(base.astype(np.float64), fmt), "lora": round_to(lora.astype(np.float64), fmt),
            "g": g.astype(np.float64)[None, :], "s": s}
    return round_to(M.evaluate("compose_stable", choice, args), fmt)


def predict_compose(rows: int = 2048, cols: int = 2048) -> pd.DataFrame:
    """Predicted agreement of the compose variants (contraction off, or on at either product)."""
    out = []
    for dn, fmt in tqdm(DTYPE_FMT.items(), desc="compose predictions: formats", **PROGRESS):
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
    """Measured agreement (GPU, all inputs) beside each model's prediction; for exact
    predictions also whether the GPU's ULP histogram (``ulp_0 .. ulp_>4``) is identical."""
    ulp = [f"ulp_{k}" for k in ULP_COLS]
    have = [c for c in ulp if c in csv.columns]
    m = pred.merge(csv[["variant", "agreement", "production", "n"] + have], on="variant", how="left",
                   suffixes=("", "_gpu"))
    m = m.rename(columns={"agreement": "gpu_agreement"})
    tol = 0.5 / m["n"].astype(float)  # the rates are counts / n: equal counts <=> |diff| < 1/(2n)
    m["within_prediction"] = (m["gpu_agreement"] >= m["agreement_lo"] - tol) & (m["gpu_agreement"] <= m["agreement_hi"] + tol)
    if have and all(c in pred.columns for c in have):
        same = np.ones(len(m), dtype=bool)
        for c in have:
            same &= (m[c].astype(float) == m[c + "_gpu"].astype(float)).to_numpy()
        m["ulp_hist_identical"] = np.where(m["exact_prediction"].astype(bool), same, None)
    return m


# --------------------------------------------------------------------------
# Bit for bit on the recorded sample
# --------------------------------------------------------------------------
#
# The suite records, for the first ``meta_sample`` inputs, the sha256 of the torch
# reference's bytes and, per variant, where it differs from the reference (flat
# indices ``<variant>__idx`` and the variant's bit patterns ``<variant>__bits``);
# the first 2^16 inputs themselves are stored as a spot check of the regeneration.

def _bits_of(values: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "fp32":
        return values.astype(np.float32).view(np.uint32)
    return values.astype(ml_dtypes.bfloat16).view(np.uint16)  # exact: the values are bf16 numbers


def _from_bits(bits: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "fp32":
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return bits.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def _sha(values: np.ndarray, fmt: str) -> str:
    return hashlib.sha256(np.ascontiguousarray(_bits_of(values, fmt)).tobytes()).hexdigest()


def reconstruct(sample: dict) -> dict:
    """Every recorded variant's outputs on the first ``meta_sample`` inputs, rebuilt from
    the emulated reference (valid only where ``ref_sha_ok``) and the recorded differences,
    plus the emulated values each model predicts.  Keys: ``norm`` / ``compose_<dtype>``
    -> ``{"ref", "ref_sha_ok", "spot_inputs_ok", "outputs": {variant: array}, "models": {...}}``."""
    m = int(sample["meta_sample"])
    n = int(sample["meta_norm_n"])
    inp = gpu_suite_assembly_inputs(min(m, n), n)
    spot = sample["norm_base_sq"].size
    spot_ok = bool(np.array_equal(inp.base_sq[:spot], sample["norm_base_sq"])
                   and np.array_equal(inp.cross[:spot], sample["norm_cross"])
                   and np.array_equal(inp.ba[:spot], sample["norm_ba"]))
    t = {k: M.evaluate("norm_assembly", (k, k), inp.terms(), sqrt=lambda x: x) for k in ("none", "fma")}
    ref = M.sqrt_rn(t["none"])
    out = {"norm": {"ref": ref, "x": t, "spot_inputs_ok": spot_ok,
                    "ref_sha_ok": _sha(ref, "fp32") == sample["norm_ref_sha256"].item().decode(),
                    "outputs": {}, "models": {}}}
    rows, cols = (int(v) for v in sample["meta_compose_shape"])
    for dn, fmt in DTYPE_FMT.items():
        vals = {ch: _compose_values(rows, cols, fmt, ch).ravel()[:m] for ch in M.placements("compose_stable")}
        key = f"compose_ref_{dn}_sha256"
        out[f"compose_{dn}"] = {"ref": vals[("none",)], "fmt": fmt, "outputs": {},
                                "ref_sha_ok": key in sample and _sha(vals[("none",)], fmt) == sample[key].item().decode(),
                                "models": {M.placement_label(ch): v for ch, v in vals.items()}}
    b0, l0, _ = inputs.suite_compose(rows, cols)
    spot_c = sample["compose_base_spot"].size
    ok_c = bool(np.array_equal(b0.ravel()[:spot_c], sample["compose_base_spot"])
                and np.array_equal(l0.ravel()[:spot_c], sample["compose_lora_spot"]))
    for key in sample:
        if not key.endswith("__idx"):
            continue
        var = key[: -len("__idx")]
        grp = "norm" if var.startswith("norm_") else "compose_" + var.split("_")[1]
        g = out[grp]
        fmt = g.get("fmt", "fp32")
        v = g["ref"].copy()
        v[sample[key]] = _from_bits(sample[var + "__bits"], fmt)
        g["outputs"][var] = v
        if grp != "norm":
            g["spot_inputs_ok"] = ok_c
    return out


def sample_checks(sample: dict, rec: dict | None = None) -> pd.DataFrame:
    """Per recorded output: fraction of the first ``meta_sample`` elements equal, bit for bit,
    to each emulated model (faithful fraction for ``tl.sqrt``).  ``rec``: :func:`reconstruct`'s
    result, if already computed."""
    rec = reconstruct(sample) if rec is None else rec
    rows = []
    nrm = rec["norm"]
    rows.append({"output": "norm_reference_torch_cuda", "model": "production sequence", "n": nrm["ref"].size,
                 "inputs_regenerated": nrm["spot_inputs_ok"], "ref_sha256_matches": nrm["ref_sha_ok"],
                 "bitwise": 1.0 if nrm["ref_sha_ok"] else 0.0, "faithful": None})
    for var, got in nrm["outputs"].items():
        fusion = "fusionOn" in var
        x = nrm["x"]["fma" if fusion else "none"]
        base = {"output": var, "n": got.size, "inputs_regenerated": nrm["spot_inputs_ok"],
                "ref_sha256_matches": nrm["ref_sha_ok"]}
        if var.endswith("_approx"):
            chk = M.check_faithful(x, got)
            rows.append({**base, "model": "faithful sqrt" + (" after fma at both sites" if fusion else ""),
                         "bitwise": float((got == M.sqrt_rn(x)).mean()),
                         "faithful": float(1 - chk.n_outside / max(chk.n, 1))})
        else:
            rows.append({**base, "model": "fma at both sites" if fusion else "production sequence",
                         "bitwise": float((got == M.sqrt_rn(x)).mean()), "faithful": None})
    for dn in DTYPE_FMT:
        g = rec[f"compose_{dn}"]
        rows.append({"output": f"compose_reference_{dn}", "model": "none", "n": g["ref"].size,
                     "inputs_regenerated": g.get("spot_inputs_ok"), "ref_sha256_matches": g["ref_sha_ok"],
                     "bitwise": 1.0 if g["ref_sha_ok"] else 0.0, "faithful": None})
        for var, got in g["outputs"].items():
            models = {"none": g["models"]["none"]} if var.endswith("fusionOff") else \
                {k: v for k, v in g["models"].items() if k != "none"}
            for label, v in models.items():
                rows.append({"output": var, "model": label, "n": got.size, "inputs_regenerated": g.get("spot_inputs_ok"),
                             "ref_sha256_matches": g["ref_sha_ok"], "bitwise": float((v == got).mean()),
                             "faithful": None})
    return pd.DataFrame(rows)


def threshold_model(sample: dict, key: str = "norm_fusionOff_approx", rec: dict | None = None) -> dict:
    """How well 'differs iff the exact root is within tau ulps of the rounding boundary'
    describes the recorded ``tl.sqrt``: tau fitted on even elements, tested on odd ones.
    (On the recorded H200 sample, ``data/gpu/fma_sqrt_sample.npz``, it does not:
    ``tl.sqrt`` errs by up to ~0.94 ulp.)"""
    rec = (reconstruct(sample) if rec is None else rec)["norm"]
    x = rec["x"]["none"]
    d = M.midpoint_distance(x)
    differs = rec["outputs"][key] != M.sqrt_rn(x)
    fit, test = slice(0, None, 2), slice(1, None, 2)
    taus = np.quantile(d, np.linspace(0, 1, 401))
    acc = [((d[fit] < tau) == differs[fit]).mean() for tau in taus]
    tau = float(taus[int(np.argmax(acc))])
    pred = d[test] < tau
    act = differs[test]
    return {"tau_ulp": tau, "fit_accuracy": float(max(acc)), "test_accuracy": float((pred == act).mean()),
            "test_rate_measured": float(act.mean()), "test_rate_predicted": float(pred.mean()),
            "max_distance_of_a_disagreement": float(d[differs].max()) if differs.any() else 0.0,
            "min_distance_of_an_agreement": float(d[~differs].min()) if (~differs).any() else 0.5}


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
        ok = grp["within_prediction"].astype(bool)
        if "ulp_hist_identical" in grp:  # an exact prediction must also give the GPU's ULP histogram
            ok &= grp["ulp_hist_identical"].map(lambda x: x is None or (x == x and bool(x)))
        if not ok.any():
            bad.append(f"{v}: GPU agreement {grp['gpu_agreement'].iloc[0]:.6f} (or its ULP histogram) outside every "
                       "model's prediction "
                       + ", ".join(f"{m}: [{lo:.6f}, {hi:.6f}]" for m, lo, hi in
                                   zip(grp["model"], grp["agreement_lo"], grp["agreement_hi"])))
    if not checks["inputs_regenerated"].fillna(True).astype(bool).all():
        bad.append("the recorded spot inputs are not the suite's seeded inputs (the CPU regenerated others)")
    if not checks["ref_sha256_matches"].astype(bool).all():
        bad.append("the torch reference's recorded sha256 differs from the emulated production sequence")
    for out, grp in checks.groupby("output"):
        faithful = grp["faithful"].dropna()
        if len(faithful):
            if (faithful < 1).any():
                bad.append(f"{out}: some outputs are not faithful roots (faithful fraction {faithful.min():.6f})")
        elif not (grp["bitwise"] == 1.0).any():
            bad.append(f"{out}: no emulated model reproduces the recorded sample bit for bit "
                       f"(best {grp['bitwise'].max():.6f})")
    return bad
