"""The reviewer's kit (dn.check_bounds, dora-num bounds check): each check against the lemma it names,
row-aligned columns, the rules printed, elements without a bound named, exit codes, PEFT adapters read
directly, float64 inputs charged their rounding.  Exact oracles are written here (rationals)."""

import math
import subprocess
import sys
from fractions import Fraction as Fr

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

import dora_num as dn
from conftest import SmallLayer
from dora_num.check import BoundsCheckError, check_bounds

CHECKS = ["factored row norm, bare", "factored row norm, guarded", "dense row norm", "magnitude division",
          "g end to end", "compose_stable", "compose_naive"]
LEMMAS = {"factored row norm, bare": {"4"}, "dense row norm": {"5"}, "magnitude division": {"6"},
          "compose_stable": {"1"}, "compose_naive": {"2"}}


_layer = SmallLayer.factors  # the shared hand-made factors (tests/conftest.py)


def _exact_norm(W, A, B, s) -> list[Fr]:
    """``||W_j + s (BA)_j||^2`` per row in rationals (``s = fl32(scale)``)."""
    sf = Fr(float(np.float32(s)))
    Af = [[Fr(v) for v in row] for row in A.double().tolist()]
    out = []
    for j, wrow in enumerate(W.double().tolist()):
        b = [Fr(v) for v in B[j].double().tolist()]
        out.append(sum((Fr(w) + sf * sum(b[k] * Af[k][i] for k in range(len(b)))) ** 2 for i, w in enumerate(wrow)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_bound_holds_on_a_hand_made_layer(dtype, small_layer):
    t = small_layer.factors(dtype=dtype)
    rep = check_bounds(**t, scale=0.37)
    assert list(rep.table["check"]) == CHECKS
    assert rep.ok, rep.to_string()
    assert (rep.table["err_over_bound"] <= 1).all() and (rep.table["err_over_bound"] > 0).all()
    n_el = t["x"].shape[0] * t["W"].shape[0]
    assert list(rep.table["n"]) == [24] * 5 + [n_el] * 2
    assert set(rep.worst["check"]) == set(CHECKS)
    assert rep.verdict == (f"VERDICT: PASS - {5 * 24 + 2 * n_el:,} within their bounds, 0 without a finite bound "
                           "(listed with the reason), 0 not checked") and rep.exit_code == 0
    assert rep.to_string().rstrip().endswith(rep.verdict)


def test_columns_are_those_of_one_element():
    """computed, exact, abs_err, bound and err/bound of a table row all belong to its worst element: the
    same element as rank 1 of the worst table, abs_err = |computed - exact|, err/bound = abs_err / bound."""
    rep = check_bounds(**_layer(), scale=0.37)
    for row in rep.table.itertuples():
        assert row.abs_err == abs(row.computed - row.exact)
        assert row.err_over_bound == row.abs_err / row.bound
        first = rep.worst[(rep.worst["check"] == row.check) & (rep.worst["rank"] == 1)].iloc[0]
        assert (first["at"], first["computed"], first["exact"], first["bound"]) == (
            row.worst_at, row.computed, row.exact, row.bound)


def test_bare_and_guarded_norms_each_against_their_own_lemma():
    """A row that the update cancels to kappa ~ 4e6: the bare factored norm's error there (about 1e-5,
    exact oracle here) is checked against lemma 4, the guarded value (recomputed in float64) against
    lemma 5', and "g end to end" gets a finite bound from the guard's guarantee on that row."""
    t = _layer(d_out=8)
    W, A, B = t["W"], t["A"], t["B"]
    s = float(np.float32(0.37))
    V = s * (B.double() @ A.double())
    N = torch.randn(W.shape[1], generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    W[5] = (-V[5] + 5e-4 * V[5].norm() * N / N.norm()).float()  # ||W_5 + sBA_5|| ~ 5e-4 ||sBA_5||
    rep = check_bounds(**t, scale=0.37, top=8)  # every row in the worst table
    assert rep.ok, rep.to_string()
    q = _exact_norm(W[5:6], A, B[5:6], 0.37)[0]
    bare = float(dn.factored_row_norm(W, A, B, 0.37, on_cancellation="off")[5])
    err_bare = abs(bare - math.sqrt(q))
    assert err_bare > 1e-7 * math.sqrt(q)  # the bare formula loses digits here
    row5 = rep.worst[rep.worst["at"] == "row 5"].set_index("check")
    assert row5.loc["factored row norm, bare", "abs_err"] == pytest.approx(err_bare, rel=1e-6)
    assert row5.loc["factored row norm, bare", "lemma"] == "4"
    assert row5.loc["factored row norm, guarded", "lemma"] == "5'"
    assert row5.loc["factored row norm, guarded", "abs_err"] <= 2**-24 * math.sqrt(q) * 1.01
    assert row5.loc["g end to end", "lemma"] == "6 with 5'" and np.isfinite(row5.loc["g end to end", "bound"])
    tab = rep.table.set_index("check")
    assert tab.loc["factored row norm, guarded", "lemma"] == "4', 5'"
    for check, want in LEMMAS.items():
        assert set(tab.loc[check, "lemma"].split(", ")) == want
    assert all(isinstance(v, str) and v for v in tab["model"])


def test_header_prints_the_constants_the_arithmetic_and_the_rules():
    rep = check_bounds(**_layer(), scale=2 / math.sqrt(7))
    s = float(np.float32(2 / math.sqrt(7)))
    text = "\n".join(rep.header)
    assert f"s = fl32(scale) = {s!r}, 2s = {2 * s!r}, s^2 = fl32(s*s) = {float(np.float32(s) * np.float32(s))!r}" in text
    assert f"eps = {float(np.float32(1e-12))!r} (zero rows only)" in text
    assert "fp32 intermediates, no FMA contraction, correctly rounded sqrt and division" in text
    assert "|computed - exact| > bound (1 + 2^-50) + c 2^-52 |exact|" in text
    assert "factored norm products: U, G: IEEE fp32 GEMMs" in text


def test_rows_without_a_finite_bound_are_named_with_the_reason():
    """A row whose squares sum past fp32 (entries 1.7e19 at d_in = 40: the fp32 intermediates may
    overflow, the norm 1.1e20 fits): the bare and dense norms have no finite bound there, said so with
    the reason; the guarded norm (formed in float64) keeps one, within it."""
    t = _layer(d_out=6)
    t["W"][2] = 1.7e19
    t["x"] = None
    rep = check_bounds(**t, scale=0.37)
    assert rep.ok, rep.to_string()
    nb = rep.no_bound.set_index("check")
    assert nb.loc["factored row norm, bare", "at"] == "row 2"
    assert "may overflow" in nb.loc["factored row norm, bare", "reason"]
    assert nb.loc["dense row norm", "at"] == "row 2"
    assert "factored row norm, guarded" not in nb.index
    assert "2 without a finite bound (listed with the reason)" in rep.verdict and rep.verdict.startswith("VERDICT: PASS")
    assert "elements without a finite bound:" in rep.to_string()


def test_full_precision_markdown_and_csv(tmp_path):
    rep = check_bounds(**_layer(), scale=0.37)
    v = float(rep.table.loc[0, "computed"])
    assert repr(v) in rep.to_string(digits=None) and repr(v) not in rep.to_string()
    md = rep.to_markdown(digits=None)
    assert md.startswith(f"**{rep.verdict}**") and "| check | lemma | model | r | scale | n | within |" in md and repr(v) in md
    paths = rep.to_csv(tmp_path / "rep.csv")
    back = pd.read_csv(paths[0], comment="#")
    assert list(back["check"]) == CHECKS and back["computed"].tolist() == rep.table["computed"].tolist()
    assert pd.read_csv(paths[1], comment="#")["err_over_bound"].tolist() == rep.worst["err_over_bound"].tolist()


def test_float64_inputs_are_charged_their_rounding():
    """float64 W, A, B, m (not fp32 values): the operators compute with their fp32 roundings; the exact
    values are of the float64 inputs, each bound charges the rounding; no violation on a correct
    computation (lemma 6 once ignored the rounding of m: 12 of 64 rows reported)."""
    g = torch.Generator().manual_seed(3)
    d_out, d_in, r = 64, 48, 4
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    A = torch.randn(r, d_in, generator=g, dtype=torch.float64) / d_in**0.5
    B = torch.randn(d_out, r, generator=g, dtype=torch.float64) * 0.05
    m = torch.linalg.vector_norm(W + 0.37 * B @ A, dim=1) * (1 + 1e-3 * torch.randn(d_out, generator=g, dtype=torch.float64))
    rep = check_bounds(W, A, B, m, scale=0.37, max_rows=64)
    assert rep.ok, rep.to_string()
    assert any("float64 inputs: rounded to fp32 once" in h for h in rep.header)
    # the magnitude division's exact value is of the float64 m: m / w^ in rationals, rounded once
    w_hat = dn.factored_row_norm(W.float(), A.float(), B.float(), 0.37).double()
    j = 7
    worst = rep.worst.set_index(["check", "at"])
    if ("magnitude division", f"row {j}") in worst.index:
        assert worst.loc[("magnitude division", f"row {j}"), "exact"] == float(Fr(float(m[j])) / Fr(float(w_hat[j])))


def test_numpy_inputs_give_the_same_report(small_layer):
    import ml_dtypes

    t = small_layer.factors(dtype=torch.bfloat16)
    arr = {k: v.float().numpy().astype(ml_dtypes.bfloat16) for k, v in t.items()}
    a = check_bounds(**arr, scale=0.37).table
    b = check_bounds(**t, scale=0.37).table
    assert a.equals(b)


def test_rows_are_sampled_with_the_most_ill_conditioned_first(small_layer):
    t = small_layer.factors(d_out=70)
    rep = check_bounds(**t, scale=0.37, max_rows=8)
    assert rep.table.loc[0, "n"] == 8 and any("8 of 70 rows" in h for h in rep.header)
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
    assert rep.ok and rep.table.drop(columns="module").equals(check_bounds(**t, scale=0.37).table.drop(columns="module"))
    if names == "peft":
        return  # the CLI runs once, on the canonical file
    out = tmp_path / "report.csv"
    cmd = [sys.executable, "-m", "dora_num", "bounds", "check", str(f), "--out", str(out), "--format", "markdown"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| factored row norm, bare | 4 |" in proc.stdout and "**VERDICT: PASS" in proc.stdout
    assert out.is_file() and (tmp_path / "report_worst.csv").is_file() and (tmp_path / "report_no_bound.csv").is_file()
    assert list(pd.read_csv(out, comment="#")["check"]) == CHECKS


def _peft_adapter(tmp_path):
    """A PEFT DoRA adapter folder of the tests' tiny two-linear model, and its base weights file."""
    from safetensors.torch import save_file as save

    from adapters._tiny import make_base, make_dora

    from dora_num.adapters.peft_io import export_peft_dora

    base = make_base()
    model = make_dora(base)
    adir = export_peft_dora(model, tmp_path / "adapter", base_model_name_or_path="tiny")
    wfile = tmp_path / "base.safetensors"
    save({k: v.contiguous() for k, v in base.state_dict().items()}, str(wfile))
    return adir, wfile


def test_peft_adapter_folder_and_file_are_read_directly(tmp_path):
    adir, wfile = _peft_adapter(tmp_path)
    rep = check_bounds(file=adir, base=wfile)
    assert rep.ok, rep.to_string()
    assert set(rep.table["module"]) == {"encoder.q", "encoder.up"} and len(rep.table) == 2 * 5
    one = check_bounds(file=adir / "adapter_model.safetensors", base=wfile, module="up")
    assert set(one.table["module"]) == {"encoder.up"}
    assert one.table.equals(rep.table[rep.table["module"] == "encoder.up"].reset_index(drop=True))
    with pytest.raises(BoundsCheckError, match="no module of .* matches \\['nope'\\]"):
        check_bounds(file=adir, base=wfile, module="nope")
    with pytest.raises(BoundsCheckError, match="base model of .* is 'tiny', not a folder on disk: pass --base"):
        check_bounds(file=adir)
    proc = subprocess.run([sys.executable, "-m", "dora_num", "bounds", "check", str(adir), "--base", str(wfile),
                           "--module", "encoder.q"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "encoder.q" in proc.stdout and "encoder.up" not in proc.stdout and "VERDICT: PASS" in proc.stdout


def test_exit_codes_without_traceback(tmp_path, capsys):
    """0: every value within its bound; 1: a bound violated (here a dense norm made wrong on purpose, through
    the kit's operator seam); 2: unusable input, one line naming it, no traceback."""
    from dora_num.__main__ import main
    from dora_num.check import EXIT_FAIL

    f = tmp_path / "layer.safetensors"
    save_file({k: v.contiguous() for k, v in _layer().items()}, str(f), metadata={"scale": "0.37"})
    assert main(["bounds", "check", str(f)]) == 0
    wrong = check_bounds(file=f, operators={"dense_row_norm": lambda *a, **k: dn.dense_row_norm(*a, **k) * (1 + 2.0**-10)})
    assert wrong.exit_code == EXIT_FAIL and wrong.verdict.startswith("VERDICT: FAIL - ")
    assert wrong.table.set_index("check").loc["dense row norm", "violations"] > 0
    for bad in (tmp_path / "missing.safetensors", tmp_path):
        proc = subprocess.run([sys.executable, "-m", "dora_num", "bounds", "check", str(bad)], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("dora-num bounds check: ") and len(proc.stderr.strip().splitlines()) == 1


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
    g_rows = rep.table.set_index("check").loc[["magnitude division", "g end to end"]]
    assert (g_rows["no_bound"] == 0).all() and (g_rows["err_over_bound"] > 0).all(), g_rows


@pytest.mark.gpu
def test_cuda_kit_applies_the_operators_product_model():
    """A bf16 base with fp32 adapters (PEFT's default) on CUDA: the factored norm's products are the split
    of A into bf16 pieces, and the kit's bound for it is the split model's (named in the row)."""
    t = _layer(d_out=64, d_in=256)
    W, A, B, m = t["W"].bfloat16().cuda(), t["A"].cuda(), t["B"].cuda(), t["m"].cuda()
    rep = check_bounds(W, A, B, m, scale=0.37)
    assert rep.ok, rep.to_string()
    assert "split into 3 bf16 pieces" in rep.table.set_index("check").loc["factored row norm, bare", "model"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_device_checks_the_tail_the_layer_runs(tmp_path, dtype, capsys):
    """A layer file checked with --device cuda: the operators run on the GPU (tensor-core or split products,
    the Triton tail: the "as run" row), every check within its bound, and the compose rows carry the
    GPU-formed base, lora and g, re-checked here in rationals (the exact value rounded once to float64)."""
    from dora_num.__main__ import main

    t = _layer(d_out=64, d_in=256)
    t["W"], t["x"] = t["W"].to(dtype), t["x"].to(dtype)
    f = tmp_path / "layer.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, str(f), metadata={"scale": "0.37"})
    rep = check_bounds(file=f, device="cuda")
    assert rep.exit_code == 0, rep.to_string()
    assert any(h.startswith("device: cuda (") for h in rep.header)
    tab = rep.table.set_index("check")
    assert tab.loc["factored row norm, as run", "within"] == 64
    assert "tensor" in tab.loc["factored row norm, bare", "model"].lower() or "split" in tab.loc[
        "factored row norm, bare", "model"]
    comp = rep.elements[rep.elements["check"] == "compose_stable"]
    s = Fr(float(np.float32(0.37)))
    for row in comp.itertuples():
        X = (Fr(row.g) - 1) * Fr(row.base) + Fr(row.g) * (s * Fr(row.lora))
        assert float(X) == row.exact and Fr(abs(row.computed - row.exact)) <= Fr(row.bound)
    assert main(["bounds", "check", str(f), "--device", "cuda", "--out", str(tmp_path / "r.csv")]) == 0
    assert "device: cuda" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_kit_checks_the_tensor_core_tail_when_the_layer_takes_it(b_dtype):
    """Under ``OpConfig.tail_bg = "tensor_core"`` the "as run" row on CUDA is the tail with ``B G`` from bf16 pieces
    on tensor cores, held to that route's bound (named in the row and the report), every row within it."""
    from dora_num.ops.config import override

    t = _layer(d_out=64, d_in=256)
    W, A, B, m = t["W"].bfloat16().cuda(), t["A"].cuda(), t["B"].to(b_dtype).cuda(), t["m"].cuda()
    with override(tail_bg="tensor_core"):
        rep = check_bounds(W, A, B, m, scale=0.37)
    assert rep.ok, rep.to_string()
    row = rep.table.set_index("check").loc["factored row norm, as run"]
    assert "bf16 pieces" in row["model"] and row["within"] == 64, row
    assert any("tail: B G from bf16 pieces" in h for h in rep.to_string().splitlines())


@pytest.mark.slow
def test_readme_kit_example_is_current(tmp_path):
    """The README's kit example on the committed trained adapter: the same checks, lemmas, counts, violations
    and verdicts as a fresh run (the float columns depend on the CPU's fp32 GEMMs in their last digits)."""
    import re
    from pathlib import Path

    from dora_num.__main__ import main as dora_num_cli

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme.split("<!-- kit-example:start -->")[1].split("<!-- kit-example:end -->")[0]
    base = tmp_path / "minilm_bf16"
    assert dora_num_cli(["record", "carry", str(base)]) == 0  # the bf16-rounded MiniLM the adapter was trained on
    adapter = root / "data" / "adapters" / "trained" / "exported" / "r16_lr0.001"
    one = check_bounds(file=adapter, base=base, module="encoder.layer.0.attention.self.query", top=1)
    assert f"**{one.verdict}**" in block
    rows = [ln.split(" | ") for ln in block.splitlines() if ln.startswith("| encoder.")]
    table = [r for r in rows if len(r) == 17]
    assert [(r[1], r[2], r[6], r[7], r[8], r[9], r[10]) for r in table] == [
        (t.check, t.lemma, str(t.n), str(t.within), str(t.violations), str(t.no_bound), str(t.not_checked))
        for t in one.table.itertuples()]
    every = check_bounds(file=adapter, base=base)
    assert re.search(r"<!-- kit-all -->`(.*?)`<!-- /kit-all -->", readme).group(1) == every.verdict


# ---------------------------------------------------------------------------
# verdicts that cannot lie, exit codes, overflow listed, provenance, FTZ, inputs of every element
# (oracles: integers and Fraction, isqrt brackets; none of the package's code)
# ---------------------------------------------------------------------------

FP32_MAX = Fr((2**24 - 1) * 2**104)


def _rn64_over_sqrt(num: Fr, Q: Fr) -> float:
    """RN64(num / sqrt(Q)), num, Q > 0, from integers alone: the 53-bit significand by isqrt of a floor
    (floor(sqrt(x)) = isqrt(floor(x))), then the half-way point compared exactly (squares)."""
    t2 = num * num / Q  # the square of the quotient
    e = (t2.numerator.bit_length() - t2.denominator.bit_length()) // 2 - 53
    while True:
        N = math.isqrt(math.floor(t2 / Fr(2) ** (2 * e)))
        if N >= 2**53:
            e += 1
        elif N < 2**52:
            e -= 1
        else:
            break
    half = (Fr(2 * N + 1, 2)) ** 2 * Fr(2) ** (2 * e)
    up = half < t2 or (half == t2 and N % 2 == 1)
    return math.ldexp(N + up, e)


def _main_code(capsys, *argv):
    from dora_num.__main__ import main

    code = main(["bounds", "check", *map(str, argv)])
    err = capsys.readouterr().err
    return code, err


def test_a_nan_computed_value_is_a_violation(small_layer):
    """A NaN out of the operator under test (one row of the dense norm) is outside every finite bound: FAIL,
    exit 1; every other row is within its bound against the exact norm (rationals, isqrt bracket here)."""
    t = {**small_layer.factors(), "x": None}

    def nan_row(W, A, B, s):
        out = dn.dense_row_norm(W, A, B, s).clone()
        out[3] = float("nan")
        return out

    rep = check_bounds(**t, scale=0.37, operators={"dense_row_norm": nan_row})
    row = rep.table.set_index("check").loc["dense row norm"]
    assert (row["violations"], row["within"], row["no_bound"]) == (1, 23, 0)
    assert rep.exit_code == 1 and rep.verdict.startswith("VERDICT: FAIL - 1 values outside")
    el = rep.elements[rep.elements["check"] == "dense row norm"].set_index("row")
    assert el.loc[3, "status"] == "violation"
    Q = _exact_norm(t["W"], t["A"], t["B"], 0.37)
    assert [el.loc[j, "exact"] for j in range(24)] == [_rn64_over_sqrt(q, q) for q in Q]


@pytest.mark.parametrize("argv, match", [
    (["--scale", "3.5e38"], "rounds to infinity in fp32"),
    (["--eps", "0"], "eps = 0.0 is not usable"), (["--eps", "-1"], "eps = -1.0 is not usable"),
    (["--eps", "nan"], "eps = nan is not usable"), (["--eps", "1e-50"], "eps = 1e-50 is not usable"),
    (["--eps", "1e300"], "eps = 1e[+]300 is not usable"), (["--rows", "-3"], "positive integer, got -3"),
    (["--rows", "0"], "positive integer, got 0"), (["--top", "-1"], "non-negative integer, got -1"),
    (["--module", "q"], "names modules of a PEFT adapter"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_unusable_input_exits_2_in_one_line(tmp_path, capsys, argv, match):
    """The crashes of the kit (a traceback and exit 1, the code of a violation) are exit 2, one line."""
    import re

    f = tmp_path / "layer.safetensors"
    save_file({k: v.contiguous() for k, v in _layer().items()}, str(f))
    scale = [] if "--scale" in argv else ["--scale", "0.37"]
    code, err = _main_code(capsys, f, *scale, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(match, err), err


def test_internal_error_has_its_own_exit_code(tmp_path, capsys):
    """An exception that is not a verdict on the input (here arguments the parser would never give) is
    exit 4, one line: never 1, the code of a violation."""
    import argparse

    from dora_num.check import EXIT_INTERNAL, _cmd_check

    f = tmp_path / "layer.safetensors"
    save_file({k: v.contiguous() for k, v in _layer().items()}, str(f))
    args = argparse.Namespace(path=str(f), scale=0.37, base=None, module=None, rows=None, top=5, max_bytes=None,
                              eps=None, device=None)
    assert _cmd_check(args) == EXIT_INTERNAL == 4
    err = capsys.readouterr().err
    assert err.startswith("dora-num bounds check: internal error") and len(err.strip().splitlines()) == 1


def test_nothing_within_a_bound_is_not_a_pass(tmp_path, capsys):
    """scale = 2e19: fl32(s)^2 overflows fp32 (rationals here), so no bare factored norm has a finite bound:
    INCOMPLETE, exit 3, and the report prints words, not NaN."""
    s32 = Fr(float(np.float32(2e19)))
    assert s32 * s32 > FP32_MAX
    f = tmp_path / "layer.safetensors"
    save_file({k: v.contiguous() for k, v in _layer().items()}, str(f), metadata={"scale": "2e19"})
    rep = check_bounds(file=f)
    bare = rep.table.set_index("check").loc["factored row norm, bare"]
    assert (bare["within"], bare["no_bound"], bare["violations"]) == (0, 24, 0)
    assert rep.exit_code == 3 and rep.verdict.startswith("VERDICT: INCOMPLETE - no violation")
    body = rep.to_string().split("\n")[len(rep.header):]  # the tables (the header's rules mention NaN)
    assert not any("nan" in ln.lower() for ln in body), body
    assert "no element with a finite bound" in rep.to_string()
    assert _main_code(capsys, f)[0] == 3


def test_overflow_is_listed_not_fatal(small_layer):
    """Row 2 has entries 3e38 (its norm exceeds fp32: rationals), row 5 a g = m / w beyond fp32, and token 1 an
    x W^T beyond fp16: each is listed without a finite bound, with its reason; everything else is checked."""
    t = small_layer.factors(dtype=torch.float16)
    W, A, B, m, x = (t[k].float() for k in "WABmx")
    W[2] = 3e38
    W[5], B[5], m[5] = 2.0**-60, 0.0, 3e38
    x = x.half()
    x[1] = 60000.0
    rep = check_bounds(W, A, B, m, x, scale=0.37)
    assert rep.ok, rep.to_string()
    q2 = sum(Fr(float(v)) ** 2 for v in W[2].tolist())  # B A adds at most 1e3 to an entry of 3e38
    assert q2 > FP32_MAX**2
    g5 = Fr(float(m[5])) ** 2 / sum(Fr(float(v)) ** 2 for v in W[5].tolist())
    assert g5 > FP32_MAX**2
    base1 = [sum(Fr(float(xv)) * Fr(float(wv)) for xv, wv in zip(x[1].tolist(), W[j].tolist())) for j in range(24)]
    over = {j for j, v in enumerate(base1) if abs(v) >= 65520}
    assert over
    nb = rep.no_bound
    comp = nb[nb["check"] == "compose_stable"]
    assert {a for a in comp["at"] if a.startswith("token 1,")} >= {f"token 1, output {j}" for j in over}
    assert any("x W^T overflows float16" == r for r in comp["reason"])
    assert (rep.table.set_index("check").loc["compose_stable", "within"] > 0)
    assert "row 2" in set(nb[nb["check"] == "factored row norm, guarded"]["at"])
    assert "row 5" in set(nb[nb["check"] == "magnitude division"]["at"])


def test_g_end_to_end_exact_is_rounded_once():
    """The exact column of "g end to end" is RN64(m / ||W + sBA||), not m / RN64(||W + sBA||): on these
    rows (an isqrt bracket here) the two differ, and the kit prints the first."""
    g = torch.Generator().manual_seed(11)
    d_out, d_in, r = 64, 12, 2
    W = torch.randn(d_out, d_in, generator=g)
    A = torch.randn(r, d_in, generator=g)
    B = torch.randn(d_out, r, generator=g) * 0.1
    m = torch.randn(d_out, generator=g).abs() + 0.5
    rep = check_bounds(W, A, B, m, scale=0.37)
    el = rep.elements[rep.elements["check"] == "g end to end"].set_index("row")
    Q = _exact_norm(W, A, B, 0.37)
    once = [_rn64_over_sqrt(Fr(float(m[j])), Q[j]) for j in range(d_out)]
    twice = [float(m[j]) / _rn64_over_sqrt(Q[j], Q[j]) for j in range(d_out)]
    assert sum(a != b for a, b in zip(once, twice)) > 0  # the double rounding is visible on this layer
    assert [el.loc[j, "exact"] for j in range(d_out)] == once


def test_provenance_and_pasteable_csv(tmp_path, capsys):
    """Every report names the package version and commit, torch and the device; the CSV carries the header
    block (# lines: verdict, scale, dtypes, arithmetic, rows) and r and scale per module."""
    import dora_num

    rep = check_bounds(**_layer(), scale=0.37)
    head = "\n".join(rep.header)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert f"dora_num {dora_num.__version__} (commit {sha}" in head and f"torch {torch.__version__}" in head
    assert "device: cpu" in head
    text = rep.csv_text()
    block = [ln for ln in text.splitlines() if ln.startswith("# ")]
    assert block[-1] == "# " + rep.verdict and any("scale 0.37" in ln for ln in block)
    assert any(ln.startswith("# inputs: W [d_out, d_in] = [24, 40] float32") for ln in block)
    assert any(ln.startswith("# rows: ") for ln in block) and any(ln.startswith("# arithmetic: ") for ln in block)
    (tmp_path / "t.csv").write_text(text)
    back = pd.read_csv(tmp_path / "t.csv", comment="#")
    assert set(back["r"]) == {4} and set(back["scale"]) == {0.37}
    f = tmp_path / "layer.safetensors"
    save_file({k: v.contiguous() for k, v in _layer().items()}, str(f), metadata={"scale": "0.37"})
    from dora_num.__main__ import main

    assert main(["bounds", "check", str(f), "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# dora_num ") and "# VERDICT: PASS" in out


def test_flush_to_zero_is_named_before_checking(small_layer):
    """With subnormals flushed (torch.set_flush_denormal), 2^-70 * 2^-70 (= 2^-140 > 0 in rationals) vanishes:
    the kit refuses, naming flush-to-zero, instead of reporting a lemma failure."""
    assert Fr(2) ** -70 * Fr(2) ** -70 == Fr(1, 2**140) > 0
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        with pytest.raises(BoundsCheckError, match="flush-to-zero .* gradual underflow"):
            check_bounds(**small_layer.factors(), scale=0.37)
    finally:
        torch.set_flush_denormal(False)
    assert check_bounds(**small_layer.factors(), scale=0.37).ok


def test_every_element_with_its_inputs_rechecked_offline(tmp_path, small_layer):
    """FILE_elements.csv holds every checked element and its inputs; the compose rows (base, lora, g as the
    kit formed them) re-check offline: the exact (g - 1) base + g (s lora) in rationals, rounded once to
    float64, is the exact column, and the error is within the printed bound."""
    rep = check_bounds(**small_layer.factors(dtype=torch.bfloat16), scale=0.37)
    paths = rep.to_csv(tmp_path / "rep.csv")
    el = pd.read_csv(paths[3], comment="#")
    comp = el[el["check"] == "compose_stable"]
    assert len(comp) == 6 * 24 and {"base", "lora", "g", "token", "output"} <= set(comp.columns)
    s = Fr(float(np.float32(0.37)))
    for row in comp.itertuples():
        gq = Fr(row.g)
        X = (gq - 1) * Fr(row.base) + gq * (s * Fr(row.lora))
        assert float(X) == row.exact and Fr(abs(row.computed - row.exact)) <= Fr(row.bound)
    assert set(el[el["check"] == "magnitude division"]["row"]) == set(range(24))


def test_compose_of_fp32_adapters_is_the_fp32_compose(small_layer):
    """bf16 W and x with fp32 A, B (PEFT's layout): DoRALinear composes in fp32 (x cast to A's dtype), so the
    kit checks that compose: lora = (x A^T) B^T in fp32, results not rounded to bf16."""
    t = small_layer.factors(dtype=torch.bfloat16)
    A, B = t["A"].float() * (1 + 2.0**-12), t["B"].float() * (1 + 2.0**-12)  # not bf16 values
    rep = check_bounds(t["W"], A, B, t["m"].float(), t["x"], scale=0.37)
    assert rep.ok, rep.to_string()
    comp = rep.elements[rep.elements["check"] == "compose_stable"]
    lora = torch.nn.functional.linear(torch.nn.functional.linear(t["x"].float(), A), B)
    assert comp["lora"].tolist() == lora.double().flatten().tolist()
    as_bf16 = torch.tensor(comp["computed"].to_numpy()).bfloat16().double().numpy()
    assert (as_bf16 != comp["computed"].to_numpy()).any()  # fp32 results, not a bf16 compose
    assert "no final rounding (fp32 output)" in rep.table.set_index("check").loc["compose_stable", "model"]


def test_fp32_output_compose_bound_has_no_final_rounding():
    """Lemma 1 for fp32 output: E_w = E_pre + u (|X| + E_pre), no rounding after it (transcribed here in
    rationals from docs/bounds.md, g in [1/2, 2], no FMA); the printed bound is that, up to its float64
    inflation, not 1.5 times it."""
    from dora_num.numerics.bounds import compose_bound

    u, eta = Fr(1, 2**24), Fr(1, 2**150)
    base, lora, g = np.array([1.5, -3.25, 1e-3]), np.array([0.75, 2.5, -7.0]), np.array([1.25, 0.75, 1.0 + 2**-20])
    s = 0.5
    got = compose_bound("compose_stable", base, lora, g, s, "fp32", "fp32")
    for j in range(3):
        P, T = abs((Fr(g[j]) - 1) * Fr(base[j])), abs(Fr(g[j]) * Fr(s) * Fr(lora[j]))
        X = abs((Fr(g[j]) - 1) * Fr(base[j]) + Fr(g[j]) * Fr(s) * Fr(lora[j]))
        E_pre = u * P + ((1 + u) ** 2 - 1) * T + (abs(Fr(g[j])) * (1 + u) + 2) * eta
        E_w = E_pre + u * (X + E_pre)
        assert E_w <= Fr(got[j]) <= E_w * (1 + Fr(1, 2**30)), (j, float(Fr(got[j]) / E_w))


def test_rows_sample_keeps_zero_rows_and_extremes():
    """Sampled (max_rows=40 of 400): the zero row, the smallest and largest norms, the largest kappa and
    g = 1 + 2^-23 (smallest |g - 1|) are always among the checked rows; the magnitude division covers every
    row; the rows not checked are counted.  Small layers: every row by default."""
    g = torch.Generator().manual_seed(5)
    d_out, d_in, r = 400, 16, 2
    W = torch.randn(d_out, d_in, generator=g)
    A = torch.randn(r, d_in, generator=g) / 4
    B = torch.randn(d_out, r, generator=g) * 0.01
    W[17], B[17] = 0.0, 0.0
    W[55] *= 2.0**-100
    B[55] = 0.0
    W[100] *= 2.0**90
    s = float(np.float32(0.37))
    W[200] = (-s * (B[200:201].double() @ A.double())[0] + 1e-6).float()  # W + sBA cancels
    wn = dn.factored_row_norm(W, A, B, 0.37)
    m = wn * 1.25
    m[300] = torch.nextafter(wn[300], torch.tensor(2.0) * wn[300])  # g = 1 + ulp
    rep = check_bounds(W, A, B, m, scale=0.37, max_rows=40)
    el = rep.elements
    rows = set(el[el["check"] == "dense row norm"]["row"])
    assert {17, 55, 100, 200, 300} <= rows and len(rows) <= 40 + 6
    assert set(el[el["check"] == "magnitude division"]["row"]) == set(range(d_out))
    assert rep.table.set_index("check").loc["dense row norm", "not_checked"] == d_out - len(rows)
    assert any("zero rows" in h and "largest kappa" in h for h in rep.header)
    every = check_bounds(W[:60], A, B[:60], m[:60], scale=0.37)
    assert set(every.elements[every.elements["check"] == "dense row norm"]["row"]) == set(range(60))
    assert any("every row (60)" in h for h in every.header)


def test_missing_base_names_the_real_command(tmp_path):
    """The committed adapters name their base as a sentence: the kit's message gives the command that
    makes it (dora-num record carry DIR) and --base DIR."""
    import json

    adir, _ = _peft_adapter(tmp_path)
    cfg = json.loads((adir / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "all-MiniLM-L6-v2, bf16-rounded copy"
    (adir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(BoundsCheckError, match=r"`dora-num record carry DIR`, then pass --base DIR"):
        check_bounds(file=adir)


def test_peft_report_gives_r_and_scale_per_module(tmp_path):
    import json

    adir, wfile = _peft_adapter(tmp_path)
    cfg = json.loads((adir / "adapter_config.json").read_text())
    rep = check_bounds(file=adir, base=wfile)
    r = cfg["r"]
    want = Fr(cfg["lora_alpha"]) / (Fr(math.isqrt(r)) if cfg.get("use_rslora") else Fr(r))
    assert set(rep.table["r"]) == {r} and set(rep.table["scale"]) == {float(want)}
