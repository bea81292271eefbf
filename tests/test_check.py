"""The reviewer's kit (dn.check_bounds, dora-num bounds check) on a layer made by hand."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import dora_num as dn
from dora_num.check import BoundsCheckError, check_bounds

FORMULAS = ["factored row norm", "dense row norm", "magnitude division", "g end to end", "compose_stable",
            "compose_naive"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_bound_holds_on_a_hand_made_layer(dtype, small_layer):
    t = small_layer.factors(dtype=dtype)
    rep = check_bounds(**t, scale=0.37)
    assert list(rep.table["formula"]) == FORMULAS
    assert rep.ok, rep.to_string()
    assert (rep.table["tightness"] <= 1).all() and (rep.table["tightness"] > 0).all()
    n_el = t["x"].shape[0] * t["W"].shape[0]
    assert list(rep.table["n"]) == [24] * 4 + [n_el] * 2
    assert set(rep.worst["formula"]) == set(FORMULAS)
    assert "compose_stable" in rep.to_string()


def test_numpy_inputs_give_the_same_report(small_layer):
    import ml_dtypes

    t = small_layer.factors(dtype=torch.bfloat16)
    arr = {k: v.float().numpy().astype(ml_dtypes.bfloat16) for k, v in t.items()}
    a = check_bounds(**arr, scale=0.37).table
    b = check_bounds(**t, scale=0.37).table
    assert a.drop(columns="checked").equals(b.drop(columns="checked"))


def test_rows_are_sampled_with_the_most_ill_conditioned_first(small_layer):
    t = small_layer.factors(d_out=70)
    rep = check_bounds(**t, scale=0.37, max_rows=8)
    assert rep.table.loc[0, "n"] == 8 and "8 of 70 rows" in rep.table.loc[0, "checked"]
    assert any("row 3" == w for w in rep.worst["at"])  # the cancelling row is among those checked


@pytest.mark.parametrize("names", ["canonical", "peft"])
def test_safetensors_file_and_cli(tmp_path, names, small_layer):
    t = small_layer.factors()
    if names == "peft":
        keys = {"W": "model.layer.base_layer.weight", "A": "model.layer.lora_A.default.weight",
                "B": "model.layer.lora_B.default.weight", "m": "model.layer.lora_magnitude_vector.default.weight",
                "x": "activations"}
        meta = None
    else:
        keys, meta = {k: k for k in t}, {"scale": "0.37"}
    f = tmp_path / "layer.safetensors"
    save_file({keys[k]: v.contiguous() for k, v in t.items()}, str(f), metadata=meta)
    scale = None if meta else 0.37
    rep = check_bounds(file=f, scale=scale)
    assert rep.ok and rep.table.equals(check_bounds(**t, scale=0.37).table)
    if names == "peft":
        return  # the CLI runs once, on the canonical file
    out = tmp_path / "report.csv"
    cmd = [sys.executable, "-m", "dora_num", "bounds", "check", str(f), "--out", str(out)]
    if scale:
        cmd += ["--scale", "0.37"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "factored row norm" in proc.stdout and out.is_file() and (tmp_path / "report_worst.csv").is_file()
    import pandas as pd

    assert list(pd.read_csv(out)["formula"]) == FORMULAS


@pytest.mark.parametrize("case, kwargs, match", [
    ("B shape", dict(B=torch.zeros(24, 5)), r"B has shape \(24, 5\)"),
    ("m shape", dict(m=torch.ones(23)), r"m must be \[d_out\]"),
    ("x shape", dict(x=torch.ones(6, 39)), r"x must be \[\.\.\., d_in\]"),
    ("int dtype", dict(W=torch.ones(24, 40, dtype=torch.int32)), r"W has dtype torch.int32"),
    ("NaN", dict(A=torch.full((4, 40), float("nan"))), r"A contains 160 NaN"),
    ("Inf", dict(x=torch.full((6, 40), float("inf"))), r"x contains 0 NaN and 240 Inf"),
    ("float64 x", dict(x=torch.ones(6, 40, dtype=torch.float64)), r"x is float64"),
    ("list", dict(m=[1.0] * 24), r"m must be a torch tensor or a numpy array"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_tensors_are_named(case, kwargs, match, small_layer):
    with pytest.raises(BoundsCheckError, match=match):
        check_bounds(**{**small_layer.factors(), **kwargs}, scale=0.37)


def test_bad_scale_and_missing_inputs(small_layer):
    t = small_layer.factors()
    with pytest.raises(BoundsCheckError, match="scale is required"):
        check_bounds(**t)
    with pytest.raises(BoundsCheckError, match="scale must be finite"):
        check_bounds(**t, scale=float("inf"))
    with pytest.raises(BoundsCheckError, match="W, A, B and m are required"):
        check_bounds(W=t["W"], A=t["A"], B=t["B"], scale=1.0)
    with pytest.raises(BoundsCheckError, match="either file= or the tensors"):
        check_bounds(file="x.safetensors", W=t["W"], scale=1.0)


def test_bad_files_are_named(tmp_path, small_layer):
    t = small_layer.factors()
    with pytest.raises(BoundsCheckError, match="no such file"):
        check_bounds(file=tmp_path / "missing.safetensors", scale=1.0)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(BoundsCheckError, match="not a readable safetensors file"):
        check_bounds(file=junk, scale=1.0)
    f = tmp_path / "nox.safetensors"
    save_file({k: v for k, v in t.items() if k != "m"}, str(f))
    with pytest.raises(BoundsCheckError, match=r"no tensor for m: .* the file holds \['A', 'B', 'W', 'x'\]"):
        check_bounds(file=f, scale=1.0)
    save_file({**t, "weight": t["W"].clone()}, str(f))
    with pytest.raises(BoundsCheckError, match="several tensors could be W"):
        check_bounds(file=f, scale=1.0)
    save_file(t, str(f), metadata={"scale": "0.5"})
    with pytest.raises(BoundsCheckError, match="scale=0.37 given but the file says 0.5"):
        check_bounds(file=f, scale=0.37)
    with pytest.raises(BoundsCheckError, match="above the limit"):
        check_bounds(file=f, scale=0.5, max_bytes=100)
    proc = subprocess.run([sys.executable, "-m", "dora_num", "bounds", "check", str(junk), "--scale", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "not a readable safetensors file" in proc.stderr


def test_public_name():
    assert dn.check_bounds is check_bounds


def test_rows_below_eps_keep_a_finite_division_bound(small_layer):
    """A zero row of W + sBA (norm 0: g = m / eps) and a row with a nonzero norm below eps (g = m /
    wnorm: eps guards zero rows only): the end-to-end bound of lemma 6 is finite there and holds."""
    t = small_layer.factors()
    t["W"][5] = 0.0
    t["B"][5] = 0.0
    t["m"][5] = 3e-13  # g = m / eps ~ 0.3
    t["W"][7] *= 1e-14
    t["B"][7] = 0.0
    t["m"][7] = 1e-13
    rep = check_bounds(**t, scale=0.37, eps=1e-12)
    assert rep.ok, rep.to_string()
    g_rows = rep.table.set_index("formula").loc[["magnitude division", "g end to end"]]
    assert (g_rows["no_finite_bound"] == 0).all() and (g_rows["tightness"] > 0).all(), g_rows
