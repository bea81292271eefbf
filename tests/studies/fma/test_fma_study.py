"""The CPU study, the GPU-data comparison (on synthetic recordings built from the
emulation, with known corruptions) and the propagation to a DoRALinear."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from dora_num.ops.layer import DoRALinear
from dora_num.ops.norm import factored_row_norm
from dora_num.studies import inputs
from dora_num.repro.paths import RecordedDataMissing
from dora_num.studies.fma import gpu_vs_emulation as G
from dora_num.studies.fma import models as M
from dora_num.studies.fma import propagation as P
from dora_num.studies.fma import sqrt as S

S_GENERAL = 48.0 / math.sqrt(24.0)


# ------------------------------------------------------------------ study

def test_assembly_study_claims():
    sets = {"adv": S.AssemblyInputs(**inputs.fma_assembly(6000, S_GENERAL, 0)),
            "gpu": S.AssemblyInputs(**inputs.fma_assembly(3000, 0.5, 1))}  # a power-of-two scale
    res = S.assembly_study(sets)
    summ = res["summary"][res["summary"]["category"].isna()]
    prod = summ[summ["production"].astype(bool)]
    assert len(prod) == 2 and (prod["agree_vs_production"] == 1).all()
    # a power-of-two scale makes both products exact: no assembly placement changes anything
    gpu = summ[(summ["set"] == "gpu") & (summ["sqrt"] == "rn")]
    assert (gpu["agree_vs_production"] == 1).all()
    # adversarial cancellation: contracting the cross term removes the dominant rounding, so results
    # change and get closer to the exact norm
    cat = res["summary"].dropna(subset=["category"])
    cancel = cat[(cat["category"] == "cancel") & (cat["set"] == "adv")].set_index("placement")
    assert cancel.loc["s0:fma", "agree_vs_production"] < 0.5
    assert cancel.loc["s0:fma", "correctly_rounded"] > cancel.loc["none", "correctly_rounded"]
    # the worst faithful sqrt moves every inexact root by exactly one ulp
    worst = summ[(summ["sqrt"] == "faithful_other") & (summ["placement"] == "none")]
    assert (worst["max_abs_ulp_vs_production"] == 1).all()
    # explanation: a site whose product is exact (q = 0) never changes
    ex = res["explain"]
    assert (ex.loc[ex["mean_q"] == 0, "site_result_changed"] == 0).all()


def test_compose_study_claims():
    res = S.compose_study({"adv": S.ComposeInputs(**inputs.fma_compose(4000, S_GENERAL, 1))})
    summ = res["summary"].set_index(["formula", "fmt", "placement"])
    assert summ.loc[("compose_stable", "fp32", "none"), "agree_vs_production"] == 1
    # inner contracted = the exact value rounded once
    assert summ.loc[("compose_inner", "fp32", "s0:fma"), "correctly_rounded"] == 1
    assert summ.loc[("compose_stable", "fp32", "s0:alt"), "agree_vs_production"] < 1
    assert set(res["hist"]["vs"]) == {"production", "exact"}


def test_captured_terms_are_the_production_norms_terms():
    torch.manual_seed(0)
    lin = torch.nn.Linear(63, 37, bias=False)
    layer = DoRALinear.from_linear(lin, 5, 10.0, use_rslora=True)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    b, c, a, w = S.layer_terms(layer)
    assert np.array_equal(w, factored_row_norm(lin.weight, layer.lora_A, layer.lora_B, layer.scale).double().numpy())
    _, two_s, s_sq = S.scale_constants(layer.scale)
    got = M.evaluate("norm_assembly", ("none", "none"), {"base_sq": b, "cross": c, "ba": a, "two_s": two_s, "s_sq": s_sq})
    assert np.array_equal(got, w)


# ------------------------------------------------------------------ GPU data (synthetic recordings)

def _fake_gpu(folder, n=8192, alt_fp32=False, approx_flip=0.2, comp_rows=64):
    """A recording in fma.record_fma.bench_fma's format, produced by the emulation itself:
    the compose contracted at the marked product (fp32) / the other one (bf16), and
    tl.sqrt returning the other neighbour on a seeded fraction of inexact roots."""
    SEED, FMA_SCALE = inputs.SUITE_SEED, inputs.SUITE_FMA_SCALE
    b, c, a = inputs.suite_assembly(n)
    inp = S.gpu_suite_assembly_inputs(n, n)
    t = {k: M.evaluate("norm_assembly", (k, k), inp.terms(), sqrt=lambda x: x) for k in ("none", "fma")}
    ref = M.sqrt_rn(t["none"])
    flip = np.random.default_rng(9).random(n) < approx_flip
    save = {"meta_norm_seed": np.int64(SEED), "meta_norm_n": np.int64(n), "meta_sample": np.int64(n),
            "meta_scale": np.float32(FMA_SCALE), "norm_base_sq": b[:1024], "norm_cross": c[:1024], "norm_ba": a[:1024],
            "norm_ref_spot": ref[:1024].astype(np.float32), "norm_ref_sha256": np.bytes_(G._sha(ref, "fp32"))}
    csv = []

    def diff(name, out, want, fmt):
        idx = np.nonzero(out != want)[0].astype(np.int32)
        save[f"{name}__idx"] = idx
        save[f"{name}__bits"] = G._bits_of(out[idx], fmt)

    for fusion, key in ((False, "none"), (True, "fma")):
        rn, other, _ = M.sqrt_neighbours(t[key])
        for sq in ("approx", "rn", "ptx"):
            out = np.where(flip, other, rn) if sq == "approx" else rn
            name = f"norm_fusion{'On' if fusion else 'Off'}_{sq}"
            diff(name, out, ref, "fp32")
            csv.append({"op": "norm_assembly", "variant": name, "n": n, "agreement": float((out == ref).mean()),
                        "production": (not fusion and sq == "rn"), "ptx_fma.rn.f32": 2 if fusion else 0})
    base, lora, g = inputs.suite_compose(comp_rows, 2048)
    save.update(meta_compose_seed=np.int64(SEED + 3), meta_compose_shape=np.array([comp_rows, 2048]),
                compose_g=g, compose_base_spot=base.ravel()[:1024], compose_lora_spot=lora.ravel()[:1024])
    for dn, fmt in G.DTYPE_FMT.items():
        ch = ("alt",) if (alt_fp32 or fmt == "bf16") else ("fma",)
        ref_full = G._compose_values(comp_rows, 2048, fmt, ("none",)).ravel()
        on_full = G._compose_values(comp_rows, 2048, fmt, ch).ravel()
        ref_c, on = ref_full[:n], on_full[:n]  # the first meta_sample are recorded
        save[f"compose_ref_{dn}_sha256"] = np.bytes_(G._sha(ref_c, fmt))
        diff(f"compose_{dn}_fusionOff", ref_c, ref_c, fmt)
        diff(f"compose_{dn}_fusionOn", on, ref_c, fmt)
        csv.append({"op": "compose", "variant": f"compose_{dn}_fusionOff", "n": ref_full.size, "agreement": 1.0,
                    "production": True, "ptx_fma.rn.f32": 0})
        csv.append({"op": "compose", "variant": f"compose_{dn}_fusionOn", "n": ref_full.size,
                    "agreement": float((on_full == ref_full).mean()), "production": False, "ptx_fma.rn.f32": 1})
    np.savez_compressed(folder / "fma_sqrt_sample.npz", **save)
    pd.DataFrame(csv).to_csv(folder / "fma_sqrt.csv", index=False)
    (folder / "device.json").write_text(json.dumps({"device": {"name": "synthetic"}}))
    return folder


@pytest.fixture(scope="module")
def fake_gpu(tmp_path_factory):
    return _fake_gpu(tmp_path_factory.mktemp("gpu"))


def _evaluate(folder):
    gpu = G.load(folder)
    csv = gpu["csv"]
    n = int(csv.loc[csv["op"] == "norm_assembly", "n"].iloc[0])
    pred = pd.concat([G.predict_norm(n), G.predict_compose(64, 2048)], ignore_index=True)
    rates = G.compare_rates(csv, pred)
    checks = G.sample_checks(gpu["sample"])
    return gpu, rates, checks


def test_gpu_comparison_accepts_a_consistent_recording(fake_gpu):
    gpu, rates, checks = _evaluate(fake_gpu)
    assert G.headline_failures(gpu["csv"], rates, checks) == []
    on = checks[checks["output"] == "compose_float32_fusionOn"].set_index("model")["bitwise"]
    assert on["s0:fma"] == 1.0 and on["s0:alt"] < 1.0  # the emulation tells which product was contracted
    tm = G.threshold_model(gpu["sample"])
    assert 0 <= tm["tau_ulp"] <= 0.5 and 0 <= tm["test_accuracy"] <= 1


def test_gpu_comparison_rejects_a_corrupted_recording(fake_gpu, tmp_path):
    folder = _fake_gpu(tmp_path)
    with np.load(folder / "fma_sqrt_sample.npz") as z:
        save = {k: z[k].copy() for k in z.files}
    save["norm_fusionOn_rn__bits"][0] += 1  # one recorded output one ulp off the emulation
    save["norm_fusionOff_approx__bits"][0] += 2  # a tl.sqrt output neither neighbour of the root
    np.savez_compressed(folder / "fma_sqrt_sample.npz", **save)
    csv = pd.read_csv(folder / "fma_sqrt.csv")
    csv.loc[csv["variant"] == "norm_fusionOff_rn", "agreement"] = 0.999
    csv.to_csv(folder / "fma_sqrt.csv", index=False)
    gpu, rates, checks = _evaluate(folder)
    bad = "\n".join(G.headline_failures(gpu["csv"], rates, checks))
    assert "production variant norm_fusionOff_rn" in bad
    assert "norm_fusionOn_rn: no emulated model reproduces" in bad
    assert "norm_fusionOff_approx: some outputs are not faithful" in bad


def test_missing_gpu_data_names_every_file_and_how_to_record_it(tmp_path):
    with pytest.raises(RecordedDataMissing, match="fma_sqrt.csv.*fma_sqrt_sample.npz.*dora-num record fma"):
        G.load(tmp_path)


# ------------------------------------------------------------------ propagation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_variants(dtype, small_layer):
    layer = small_layer(96, 48, 8, 16.0, dtype=dtype, bias=True, seed=1, b_std=0.3, m_noise=1e-3, use_rslora=True,
                   compose_path="eager")
    x = torch.randn(40, 96).to(dtype)
    outs = P.layer_outputs(layer, x)  # raises unless injected/emulated production == the real layer
    assert set(outs) == set(P.G_VARIANTS) | set(P.COMPOSE_VARIANTS)
    wn = P.wnorm_variants(layer)
    same = wn["approx_sqrt_worst"] == wn["production"]
    t = P.wnorm_variants(layer)["production"]
    assert (np.abs(wn["approx_sqrt_worst"] - t) <= np.spacing(t.astype(np.float32)).astype(np.float64)).all()
    assert not same.all()
    tab = P.propagation_table({"l": layer}, {"l": x.float()}, act_scales=(1.0, 62.0))
    assert (tab.loc[tab["variant"] == "production", "changed"] == 0).all()
    assert (tab["cosine_vs_production"] > 0.999).all()
