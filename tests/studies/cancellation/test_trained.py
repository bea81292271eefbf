"""Notebook 01's trained adapters: the analysis functions, a live SMOKE record end to end (record in this
process, ingest, the committed-record reader), and ``dora-num collapse`` against notebook 01's table for
every committed exported adapter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from dora_num.adapters.collapse import POOLED, collapse_table
from dora_num.numerics.formats import NARROW_FORMATS
from dora_num.repro.paths import REPO_ROOT, committed_data
from dora_num.studies.cancellation import record_trained_launch as L
from dora_num.studies.cancellation import record_trained as G
from dora_num.studies.cancellation import trained as T
from dora_num.studies.cancellation import ingest_trained as R
from dora_num.studies.cancellation import runs as P

U64 = 2.0**-53
MINILM_NAMES = [f"encoder.layer.{i}.{s}" for i in range(6) for s in
                ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                 "intermediate.dense", "output.dense")]


# --------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------

def test_module_types_of_minilm():
    types = [P.module_type(n) for n in MINILM_NAMES]
    assert types == list(P.MODULE_TYPES) * 6
    with pytest.raises(ValueError, match="not one of MiniLM's encoder linears"):
        P.module_type("pooler.dense")


def _g_by_module(seed=0, spread=3e-3):
    rng = np.random.default_rng(seed)
    return {n: 1.0 + spread * rng.standard_normal(1536 if "intermediate" in n else 384) for n in MINILM_NAMES}


def test_collapse_by_type_pools_like_collapse_table():
    g = _g_by_module()
    by_type = P.collapse_by_type(g, ("bf16", "fp16"))
    full = collapse_table(g, ("bf16", "fp16"))
    a = by_type[by_type["group"] == POOLED].set_index("format")
    b = full[full["module"] == POOLED].set_index("format")
    for col in ("n", "frac_symmetric_zone", "frac_rounds_to_one", "g_std", "abs_gm1_q99"):
        np.testing.assert_array_equal(a[col].to_numpy(), b[col].to_numpy())
    assert set(by_type["group"]) == set(P.MODULE_TYPES) | {POOLED}
    assert by_type[(by_type["group"] == "intermediate") & (by_type["format"] == "bf16")]["n"].item() == 6 * 1536


def test_collapse_by_type_absorption_is_activation_weighted():
    g = {n: v for n, v in _g_by_module().items() if "layer.0." in n}
    rng = np.random.default_rng(1)
    acts = {n: rng.standard_normal((3 + i, v.size)) for i, (n, v) in enumerate(sorted(g.items()))}
    by_type = P.collapse_by_type(g, ("bf16",), activations=acts)
    per = collapse_table(g, ("bf16",), activations=acts)
    per = per[per["module"] != POOLED]
    w = per["n_activations"].to_numpy()
    pooled = by_type[by_type["group"] == POOLED]
    assert pooled["absorption"].item() == pytest.approx(float((per["absorption"] * w).sum() / w.sum()), rel=1e-15)
    assert pooled["n_activations"].item() == w.sum()


def _raw(role, name, caps: dict, spec=None, dtypes=None):
    names = list(caps[0]["m"])
    steps = sorted(caps)
    sizes = [caps[0]["m"][n].size for n in names]
    c = P.Captures(np.array(steps), names, np.concatenate([[0], np.cumsum(sizes)]),
                   np.stack([np.concatenate([caps[s]["m"][n] for n in names]) for s in steps]).astype(np.float32),
                   np.stack([np.concatenate([caps[s]["wnorm"][n] for n in names]) for s in steps]).astype(np.float32),
                   np.stack([np.concatenate([caps[s]["wnorm64"][n] for n in names]) for s in steps]),
                   np.ones(len(steps), dtype=np.int8))
    spec = spec or {"rank": 16, "lr": 1e-3, "use_rslora": False, "alpha": None}
    info = {"name": name, "role": role, "spec": {**spec, "backend": "peft" if role == "peft_twin" else "dora_num",
                                                   "perturbed": role == "ulp_twin"},
            "input_dtypes": dtypes or {}, "steps": steps[-1], "scale": 1.0}
    return R.RawRun(name, info, pd.DataFrame(), pd.DataFrame(), c, Path("."))


def test_crosscheck_ratios_and_verdict():
    """Synthetic trio: the PEFT twin differs from ours by 1.5x the ulp twin's difference in fp32-input
    modules, by a fixed 1e-3 in the bf16-input ones (layer g only)."""
    rng = np.random.default_rng(2)
    names = ["encoder.layer.0.attention.self.query", "encoder.layer.0.attention.output.dense"]
    base = {n: (1.5 + rng.random(384)).astype(np.float32) for n in names}
    caps = {k: {} for k in ("ours", "peft", "ulp")}
    for step in (0, 30, 100):
        d = 1e-4 * rng.standard_normal(384) * (step > 0)
        for who, scale in (("ours", 0.0), ("ulp", 1.0), ("peft", 1.5)):
            m = {n: (base[n] * (1 + 1e-3 + scale * d)).astype(np.float32) for n in names}
            wn = {n: base[n] * (1 + 1e-3 * (who == "peft") * ("output" in n)) for n in names}
            caps[who][step] = {"m": m, "wnorm": {n: wn[n].astype(np.float32) for n in names},
                               "wnorm64": {n: base[n].astype(np.float64) for n in names}}
    runs = {"r16_lr0.001": _raw("grid", "r16_lr0.001", caps["ours"]),
            "r16_lr0.001_peft": _raw("peft_twin", "r16_lr0.001_peft", caps["peft"],
                                     dtypes={names[0]: "float32", names[1]: "bfloat16"}),
            "r16_lr0.001_ulp": _raw("ulp_twin", "r16_lr0.001_ulp", caps["ulp"])}
    table = R.crosscheck_table(runs)
    assert set(table["step"]) == {0, 30, 100} and set(table["g"]) == {"layer", "params"}
    p = table[(table["g"] == "params") & (table["step"] == 100) & (table["group"] == "q")]
    # m stored in fp32: differences of ~2e-4 carry up to 2^-24 (|m_a| + |m_b|) ~ 3e-7, i.e. ~2e-3 relative
    assert p["ratio"].item() == pytest.approx(1.5, rel=2e-3)
    assert R.bf16_input_types(runs) == ["o"]
    v = R.crosscheck_verdict(table, R.bf16_input_types(runs))
    assert v["steps"] == [30, 100] and v["agree_g_params"] and v["agree_g_layer_fp32_inputs"]
    lay = table[(table["g"] == "layer") & (table["group"] == "o") & table["judged"]]
    assert (lay["ratio"] > P.CROSSCHECK_FACTOR).all()  # the bf16 norm: excluded from the layer verdict by design


def test_step0_table_counts_ulps_between_m_and_the_layer_norm():
    """Rows where m is k fp32 ulps from the layer's norm, counted per k (beyond ULP_BINS in two bins), against
    values built with np.nextafter; the layer's g = fl32(m / wnorm) - 1 range; the float64 g of the parameters."""
    names = ["encoder.layer.0.attention.self.query"]
    rng = np.random.default_rng(4)
    wn = (1.0 + rng.random(384)).astype(np.float32)
    m = wn.copy()
    up = np.float32(np.inf)
    moves = {1: range(0, 10), 2: range(10, 13), -1: range(13, 20), 7: range(20, 22), -5: range(22, 23)}
    for k, rows in moves.items():
        for _ in range(abs(k)):
            m[list(rows)] = np.nextafter(m[list(rows)], up if k > 0 else np.float32(0))
    caps = {0: {"m": {names[0]: m}, "wnorm": {names[0]: wn}, "wnorm64": {names[0]: wn.astype(np.float64)}},
            5: {"m": {names[0]: m}, "wnorm": {names[0]: wn}, "wnorm64": {names[0]: wn.astype(np.float64)}}}
    t = R.step0_table({"a": _raw("grid", "a", caps)})
    row = t.iloc[0]
    assert row["rows"] == 384 and row["rows_m_ne_wnorm"] == 23 and row["rows_layer_g_ne_1"] == 23
    assert row["m_minus_wnorm_ulps"] == {"<-3": 1, "-1": 7, "0": 361, "1": 10, "2": 3, ">3": 2}
    g = (m / wn).astype(np.float64) - 1
    assert row["layer_g_minus_1_min"] == g.min() < 0 < g.max() == row["layer_g_minus_1_max"]
    assert row["params_abs_g_minus_1_max"] == np.abs(m.astype(np.float64) / wn - 1).max()
    with pytest.raises(ValueError, match="positive finite"):
        R._ulps_apart(np.array([0.0], dtype=np.float32), np.array([1.0], dtype=np.float32))


def test_crosscheck_needs_the_trio():
    assert R.crosscheck_table({}).empty and R.crosscheck_verdict(pd.DataFrame()) == {
        "criterion": P.CROSSCHECK_CRITERION, "ran": False}


def _to_bf16(v: np.ndarray) -> np.ndarray:
    """torch's round-to-nearest-even cast to bf16, back to fp32 (a reference outside this package)."""
    return torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def test_bf16_norm_rounding_prediction():
    """The predicted RMS relative error of rounding to bf16, against a direct count on values spread
    log-uniformly over an octave (2M samples: sampling error of the RMS ~0.1%)."""
    rng = np.random.default_rng(3)
    v = np.exp2(rng.random(2_000_000)).astype(np.float32)
    r = _to_bf16(v).astype(np.float64) / v - 1
    assert np.sqrt(np.mean(r**2)) == pytest.approx(P.BF16_NORM_RMS_PREDICTED, rel=0.01)


def _trained(evals_rows, outcome_rows, cfg):
    return T.Trained({"config": cfg}, pd.DataFrame(evals_rows), pd.DataFrame(), pd.DataFrame(), pd.DataFrame(),
                     {}, {}, Path("."), pd.DataFrame(outcome_rows))


@pytest.mark.parametrize("reason,eval_steps,scores,ok", [
    ("plateau", [0, 2, 4, 6], [0.5, 0.6, 0.6, 0.6], True),
    ("plateau", [0, 2, 4, 6], [0.5, 0.5, 0.6, 0.6], False),  # a gain within the last patience evaluations
    ("deadline", [0, 2, 4, 5], [0.5, 0.6, 0.7, 0.7], True),  # final evaluation off the grid
    ("deadline", [0, 4, 8, 10], [0.5, 0.6, 0.7, 0.7], False),  # reached max_steps
    ("max_steps", [0, 4, 8, 10], [0.5, 0.6, 0.7, 0.7], True),
    ("max_steps", [0, 2, 4, 6], [0.5, 0.6, 0.7, 0.7], False),  # stopped before max_steps
    ("converged", [0, 2, 4, 6], [0.5, 0.6, 0.6, 0.6], False),
], ids=["plateau", "plateau_wrong", "deadline", "deadline_wrong", "max_steps", "max_steps_wrong", "unknown"])
def test_stop_labels_are_rederived(reason, eval_steps, scores, ok):
    cfg = {"patience": 2, "eval_every": 2, "min_delta": 0.003, "max_steps": 10}
    evals = [{"run": "a", "step": s, "mrr10": v} for s, v in zip(eval_steps, scores)]
    outcome = [{"run": "a", "stop_reason": reason, "steps": eval_steps[-1]}]
    problems = T.check_stop_labels(_trained(evals, outcome, cfg))
    assert (not problems) == ok, problems


# --------------------------------------------------------------------------
# A live SMOKE record, end to end
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):  # (slow: 3 MiniLM runs and an ingest, ~40 s on the 2-core CI machine)
    """The cross-check trio at SMOKE sizes, recorded in this process, packed like a launch, ingested."""
    root = tmp_path_factory.mktemp("trained-smoke")
    torch_threads = torch.get_num_threads()
    try:
        files = G.record_inline(P.smoke_plan()[:3], "smoke", G.SMOKE_CPU, root / "launch", log=lambda m: None)
        R.ingest(files, root / "trained", keep=root / "full", log=lambda m: None)
    finally:
        torch.set_num_threads(torch_threads)
    return SimpleNamespace(files=files, dest=root / "trained", raw=R.load_raw(root / "full"),
                           tr=T.load_trained(root / "trained"), root=root)


@pytest.mark.slow
def test_smoke_record_is_complete_and_labelled(smoke):
    tr = smoke.tr
    assert sorted(tr.outcome["run"]) == sorted(s.name for s in P.smoke_plan()[:3]) and not tr.manifest["missing_runs"]
    assert T.check_stop_labels(tr) == []
    assert tr.manifest["compact_certified"], tr.manifest["compact_differences"]
    mismatch = T.check_final_against_record(tr)
    assert mismatch.empty, mismatch.to_string()
    n_caps = {r.name: len(r.captures.steps) for r in smoke.raw.runs.values()}
    assert len(tr.collapse) == sum(n_caps.values()) * (len(P.MODULE_TYPES) + 1) * len(NARROW_FORMATS)
    s0 = T.step0(tr).set_index("role")  # on one device m is the forward's own norm: g = 1 exactly at step 0
    assert s0.loc["grid", "rows_m_ne_wnorm"] == 0 and s0.loc["grid", "rows_layer_g_ne_1"] == 0
    assert s0.loc["ulp_twin", "rows_m_ne_wnorm"] == s0.loc["ulp_twin", "rows"]
    for r in smoke.raw.runs.values():
        assert r.captures.steps[0] == 0 and r.captures.steps[-1] == r.final_step
        assert r.info["g_is_quotient"] is (None if r.info["role"] == "peft_twin" else True)
        assert set(r.evals["step"]) >= {0, r.final_step}


@pytest.mark.slow
def test_smoke_ingest_writes_the_recorded_data_vocabulary(smoke):
    """Every file of the record has a sidecar in :mod:`dora_num.repro.recording`'s vocabulary: the measuring
    machine's device (from a run's own sidecar), the commit and versions it ran, the archives it came in."""
    from dora_num.repro.provenance import read_provenance

    run_side = read_provenance(next(iter(smoke.raw.runs.values())).folder / "run.json")
    files = sorted(p for p in smoke.dest.rglob("*") if p.is_file() and not p.name.endswith(".provenance.json"))
    assert {p.relative_to(smoke.dest).as_posix() for p in files} >= {T.TRAINED.relpath(r) for r in (*T.READ, "crosscheck")}
    for p in files:
        side = read_provenance(p)
        assert side["device"] == run_side["device"] and side["producer"].startswith("dora-num record adapters-gpu")
        assert {"measured_at_git_sha", "measured_versions", "measured_argv", "measured_from", "plan"} <= set(side["extra"])
        assert side["extra"]["measured_versions"] == run_side["versions"]
        assert side["extra"]["measured_from"] == [smoke.files.name]
        assert set(side["inputs"]) == {q.name for q in smoke.files.glob("part-*.tar")}


@pytest.mark.slow
def test_smoke_init_is_shared_and_g_is_one(smoke):
    """Step 0: our layer's g is 1 exactly (m is its own norm); the ulp twin's m is one fp32 ulp away from
    ours in every row; PEFT got our A, B = 0, m, so its parameters' g is ours bit for bit."""
    runs = {r.info["role"]: r.captures for r in smoke.raw.runs.values()}
    ours, ulp, peft = runs["grid"], runs["ulp_twin"], runs["peft_twin"]
    assert np.all(ours.m[0] / ours.wnorm[0] == np.float32(1))
    np.testing.assert_array_equal(ours.m[0], ours.wnorm[0])
    up, down = np.nextafter(ours.m[0], np.float32(np.inf)), np.nextafter(ours.m[0], np.float32(0))
    assert np.all((ulp.m[0] == up) | (ulp.m[0] == down))
    np.testing.assert_array_equal(peft.m[0], ours.m[0])
    np.testing.assert_array_equal(peft.wnorm64[0], ours.wnorm64[0])


@pytest.mark.slow
def test_smoke_peft_norm_is_bf16_where_its_input_is(smoke):
    """PEFT's forward under bf16 autocast: the norm it divides by is bf16-valued exactly in the modules
    whose input is bf16 (attention output, MLP output), fp32 elsewhere."""
    peft = next(r for r in smoke.raw.runs.values() if r.info["role"] == "peft_twin")
    dt = peft.info["input_dtypes"]
    assert {P.module_type(n) for n, d in dt.items() if d == "bfloat16"} == {"o", "output"}
    for step_row in range(len(peft.captures.steps)):
        wn = peft.captures.split(peft.captures.wnorm[step_row])
        for n, v in wn.items():
            is_bf16 = np.array_equal(_to_bf16(v), v)
            assert is_bf16 == (dt[n] == "bfloat16"), n


@pytest.mark.slow
def test_smoke_export_loads_in_ours_and_peft(smoke):
    from peft import PeftModel

    from dora_num.adapters.model import load_base_model
    from dora_num.adapters.peft_io import load_peft_dora

    (name, adir), = smoke.tr.exported().items()
    raw = smoke.raw.runs[name]
    final_m = raw.captures.split(raw.captures.m[raw.captures.row(raw.final_step)])
    base, _ = load_base_model()
    states = {s.name: s for s in load_peft_dora(adir, base)}
    assert sorted(states) == sorted(final_m)
    for n, s in states.items():
        np.testing.assert_array_equal(s.m.numpy(), final_m[n])
    pm = PeftModel.from_pretrained(load_base_model()[0], str(adir))
    for n in final_m:
        lyr = pm.base_model.model.get_submodule(n)
        assert torch.equal(lyr.lora_magnitude_vector["default"].weight, states[n].m)
        assert torch.equal(lyr.lora_B["default"].weight, states[n].B)


@pytest.mark.slow
def test_smoke_collapse_cli_matches_the_recorded_table(smoke, tmp_path):
    """The same check as for committed adapters, on the SMOKE export: ``dora-num collapse`` on the file
    against the table from the recorded capture."""
    table = T.exported_tables(smoke.tr, tmp_path)
    (adapter,) = table["adapter"].unique()
    assert_cli_matches(Path(adapter), table[table["adapter"] == adapter], tmp_path)


# --------------------------------------------------------------------------
# dora-num collapse on every committed exported adapter, against notebook 01's table
# --------------------------------------------------------------------------

NOTEBOOK_TABLE = committed_data("01_cancellation_at_g1", "exported_adapters_collapse.csv.xz")


def committed_adapters() -> list[Path]:
    """Every exported adapter committed with the H200 record."""
    exp = committed_data(T.TRAINED.folder, "exported")
    return sorted(p for p in exp.iterdir() if (p / "adapter_config.json").is_file()) if exp.is_dir() else []


def assert_cli_matches(adapter: Path, table: pd.DataFrame, tmp: Path) -> None:
    """Run ``python -m dora_num collapse`` on ``adapter`` and hold it to ``table`` (notebook 01's rows for
    that adapter): zone counts and absorption exactly, except for rows the table marks as lying within
    twice ``g_abs_error_bound`` of a zone end (``n_near_zone_end``: there two correct float64 evaluations of
    g may fall on either side); g's moments within twice that bound (each evaluation is within it of the
    exact g) plus the float64 rounding of the statistics themselves."""
    from dora_num.studies.record_carry import write_minilm_bf16

    (base,) = table["base"].unique()
    cmd = [sys.executable, "-m", "dora_num", "collapse", str(adapter), "--out", str(tmp / "cli.csv")]
    if base == "bf16-rounded":
        cmd += ["--base", str(write_minilm_bf16(tmp / "minilm-bf16"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    cli = pd.read_csv(tmp / "cli.csv").set_index(["module", "format"]).sort_index()
    nb = table.set_index(["module", "format"]).sort_index()
    assert list(cli.index) == list(nb.index)
    np.testing.assert_array_equal(cli["n"], nb["n"])
    near = nb["n_near_zone_end"].to_numpy()
    for col in P.ZONE_COLUMNS:
        dc = np.rint(np.abs(cli[col] - nb[col]) * nb["n"]).to_numpy()
        assert np.all(dc <= near), (col, cli.index[dc > near].tolist())
    tol = 2 * nb["g_abs_error_bound"].to_numpy() + 64 * U64
    for col in ("g_mean", "g_std", "abs_gm1_median", "abs_gm1_max", "abs_gm1_q10", "abs_gm1_q50", "abs_gm1_q90",
                "abs_gm1_q99"):
        d = np.abs(cli[col].to_numpy() - nb[col].to_numpy())
        assert np.all(d <= tol), (col, float(d.max()), float(tol.min()))
    exact = near == 0
    np.testing.assert_array_equal(cli["n_activations"].to_numpy(), nb["n_activations"].to_numpy())
    np.testing.assert_array_equal(cli["absorption"].to_numpy()[exact], nb["absorption"].to_numpy()[exact])


@pytest.mark.slow
@pytest.mark.parametrize("adapter", committed_adapters(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_collapse_cli_matches_notebook_01(adapter, tmp_path):
    # a committed export comes with notebook 01's numbers for it (python -m dora_num reproduce --only 01)
    assert NOTEBOOK_TABLE.is_file(), f"{NOTEBOOK_TABLE.relative_to(REPO_ROOT)} missing beside a committed export"
    table = pd.read_csv(NOTEBOOK_TABLE)
    rows = table[table["adapter"] == str(adapter.relative_to(REPO_ROOT))]
    assert not rows.empty, f"notebook 01's table has no rows for {adapter.relative_to(REPO_ROOT)}: regenerate it"
    assert_cli_matches(adapter, rows, tmp_path)


def test_notebook_table_covers_every_committed_adapter():
    """Once notebook 01 has written its table, it covers every committed exported adapter (a new export
    without the notebook's numbers beside it fails here)."""
    assert committed_adapters(), "no exported adapter is committed (notebook 01 and the collapse CLI test read them)"
    assert NOTEBOOK_TABLE.is_file(), f"{NOTEBOOK_TABLE.relative_to(REPO_ROOT)} missing beside the committed exports"
    listed = set(pd.read_csv(NOTEBOOK_TABLE)["adapter"])
    assert {str(p.relative_to(REPO_ROOT)) for p in committed_adapters()} == listed


def test_compact_g_keeps_every_zone_count_at_the_zone_ends():
    """g - 1 just beyond bf16's rounds-to-one ends (2^-8, -2^-9) and just inside fp16's symmetric end
    (2^-11), by less than half an fp32 ulp of g - 1: float32 alone rounds them onto the ends and moves them
    across (what a CPU-trained smoke run hit once); the compact form keeps them exact."""
    from dora_num.numerics.collapse import zone_masks
    from dora_num.studies.cancellation.runs import compact_gm1, expand_gm1

    near = [2.0**-8 * (1 + 2.0**-30), 2.0**-11 * (1 - 2.0**-30), -(2.0**-9) * (1 + 2.0**-30)]  # exact in float64
    gm1 = np.array(near + [0.25, -0.003, 1e-5]).reshape(2, 3)
    packed = compact_gm1(gm1)
    assert sorted(packed["exact_idx"].tolist()) == [0, 1, 2]
    back = expand_gm1(**packed)
    f32_only = gm1.astype(np.float32).astype(np.float64)
    moved = []
    for fmt in ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"):
        want, got, f32 = zone_masks(1.0 + gm1, fmt), zone_masks(1.0 + back, fmt), zone_masks(1.0 + f32_only, fmt)
        for k in want:
            assert (want[k] == got[k]).all(), (fmt, k, want[k], got[k])
            moved += [(fmt, k)] if not (want[k] == f32[k]).all() else []
    assert ("bf16", "frac_rounds_to_one") in moved and ("fp16", "frac_symmetric_zone") in moved, moved
