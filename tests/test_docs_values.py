"""Numbers in docs/bounds.md, docs/contract.md and docs/peft.md that come from data or from a measurement are
written between ``<!-- value:NAME -->`` and ``<!-- /value -->``; each NAME is recomputed here from the
data or the test that produces it, and the text must be what it gives (a stale typed number fails).
Every test and function the documents cite must exist."""

from __future__ import annotations

import importlib
import json
import re
from functools import cache
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / "bounds.md", ROOT / "docs" / "contract.md", ROOT / "docs" / "peft.md"]
MARK = re.compile(r"<!-- value:([A-Za-z0-9_.]+) -->(.*?)<!-- /value -->", re.S)


def _g_sweep():
    return json.loads((ROOT / "data" / "01_cancellation_at_g1" / "headline.json").read_text())["g_sweep"]


def _guard_cost(ab_dtype: str) -> float:
    d = pd.read_csv(ROOT / "data" / "gpu" / "guard_cost.csv")
    r = d[(d.variant == "ratio_on_over_off") & (d.measure == "tail") & (d.ab_dtype == ab_dtype)]
    return float(r.ms.median())


@cache
def _bf16_base():
    from ops.test_split_products import _emulated_mm, _pairwise_mm, _rounding_mm, bf16_base_errors

    return tuple(bf16_base_errors(accumulate=mm) for mm in (_emulated_mm, _rounding_mm, _pairwise_mm))


def _guard_rel(d: int, r: int, rho: float) -> str:
    from ops.test_guard_fire_rate import _adapter, _rel

    W, A, B, s = _adapter(d, r, rho)
    return f"{float(_rel(W, A, B, s, 'tensor_core').max()):.2g}/{float(_rel(W, A, B, s, 'fp32').max()):.2g}"


def _products(name: str) -> pd.DataFrame:
    return pd.read_csv(ROOT / "data" / "gpu" / "products" / name)


def _tf32(column: str) -> str:
    d = _products("tf32.csv")
    on = d[d.tf32 == "allow_tf32"]
    assert (d.err_over_bound_factored_max <= 1).all() and (d.err_over_bound_dense_max <= 1).all()
    return f"{on[column].max():.2g}"


@cache
def _matrix():
    from dora_num.studies.speed import model_report as mr

    return mr.load_matrix()


def _matrix_range(column: str, *, compile_mode: str | None = None, mode: str | None = "train",
                  ckpt: bool | None = False, fmt: str = ".2g", unit: str = "") -> str:
    t = _matrix_table()
    sel = pd.Series(True, index=t.index)
    if compile_mode is not None:
        sel &= t["compile"] == compile_mode
    if mode is not None:
        sel &= t["mode"] == mode
    if ckpt is not None:
        sel &= t["checkpointing"] == ckpt
    v = t[sel][column]
    return f"{v.min():{fmt}}-{v.max():{fmt}}{unit}"


@cache
def _matrix_table():
    from dora_num.studies.speed import model_report as mr

    return mr.matrix_table(_matrix())


def _matrix_g_error(path: str) -> str:
    v = _matrix()["g_error"]
    v = v[v.what == path].value
    return f"{v.min():.2g}-{v.max():.2g}"


def _gpu_bf16_base(column: str) -> str:
    d = _products("bf16_base.csv")
    row = d[(d.adapters == "float32") & (d.rho == 1.0)]
    assert len(row) == 1
    return f"{float(row[column].iloc[0]):.2g}"


def _lemma6() -> str:
    from numerics.test_bounds_domain import former_magnitude_bound_violations

    n, total = former_magnitude_bound_violations()
    return f"{n} of {total}"


VALUES = {
    "g_sweep_within_1ulp": lambda: (lambda g: f"{round(g['stable_fp32_frac_within_1ulp'] * (n := g['stable_fp32_n_well_conditioned'] + g['stable_fp32_n_ill_conditioned'])):,} of {n:,}")(_g_sweep()),
    "g_sweep_ill": lambda: f"{_g_sweep()['stable_fp32_n_ill_conditioned']:,}",
    "guard_cost_bf16": lambda: f"{100 * (_guard_cost('bfloat16') - 1):.0f}%",
    "guard_cost_fp32": lambda: f"{100 * (1 - _guard_cost('float32')):.0f}% faster",
    "lemma6_former_violations": _lemma6,
    "bf16_base_rz_median": lambda: f"{_bf16_base()[0]['factored_median']:.2g}",
    "bf16_base_rz_max": lambda: f"{_bf16_base()[0]['factored_max']:.2g}",
    "bf16_base_dense": lambda: f"{_bf16_base()[0]['dense_max']:.2g}",
    "bf16_base_rn_max": lambda: f"{_bf16_base()[1]['factored_max']:.2g}",
    "bf16_base_tree_max": lambda: f"{_bf16_base()[2]['factored_max']:.2g}",
    "bf16_base_rz_ratio": lambda: f"{_bf16_base()[0]['err_over_bound_max']:.2g}",
    "gpu_fire_rate_flagged": lambda: (lambda d: f"{int(d.flagged.sum())} rows flagged in {len(d)} cases")(
        _products("guard_fire_rate.csv")),
    "gpu_fire_rate_rel_max": lambda: f"{_products('guard_fire_rate.csv').rel_max.max():.2g}",
    # DoRA's cost over plain LoRA, ours over PEFT's (training, no checkpointing, every rank), per mode
    "matrix_cost_default": lambda: _matrix_range("cost_ours_over_peft", compile_mode="default", fmt=".2g", unit="x"),
    "matrix_cost_ro": lambda: _matrix_range("cost_ours_over_peft", compile_mode="reduce-overhead", unit="x"),
    "matrix_cost_eager": lambda: _matrix_range("cost_ours_over_peft", compile_mode="eager", unit="x"),
    "matrix_compiled_over_eager": lambda: (lambda t: (lambda v: f"{v.min():.2f}-{v.max():.2f}")(
        t[t["compile"] != "eager"].ours_over_ours_eager))(_matrix_table()),
    "matrix_compiled_rounds_slower": lambda: (lambda mr: str(len(mr.compiled_rounds_slower(_matrix()))))(
        importlib.import_module("dora_num.studies.speed.model_report")),
    "matrix_g_error_peft": lambda: _matrix_g_error("peft_compiled"),
    "matrix_g_error_ours": lambda: _matrix_g_error("dora_num_eager"),
    "gpu_bf16_base_factored": lambda: _gpu_bf16_base("rel_err_factored_max"),
    "gpu_bf16_base_dense": lambda: _gpu_bf16_base("rel_err_dense_max"),
    "gpu_bf16_base_ratio": lambda: _gpu_bf16_base("err_over_bound_factored_max"),
    "tf32_factored": lambda: _tf32("rel_err_factored_max"),
    "tf32_dense": lambda: _tf32("rel_err_dense_max"),
}
for _d in (4096, 8192, 14336, 28672):
    for _r, _rho in ((64, 0.1), (64, 0.2), (256, 0.1), (256, 0.2)):
        VALUES[f"guard_rel_{_d}_{_r}_{_rho}"] = (lambda d=_d, r=_r, rho=_rho: _guard_rel(d, r, rho))


def _marked():
    return [(p.name, m.group(1), m.group(2)) for p in DOCS for m in MARK.finditer(p.read_text())]


@pytest.mark.parametrize("doc, name, text", _marked(), ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "")
def test_marked_value_is_what_its_source_gives(doc, name, text):
    assert name in VALUES, f"{doc}: no producer registered for value {name!r}"
    assert text == VALUES[name](), f"{doc}: {name} says {text!r}, its source gives {VALUES[name]()!r}"


def test_every_registered_value_is_used():
    used = {name for _, name, _ in _marked()}
    assert set(VALUES) <= used, sorted(set(VALUES) - used)


def test_cited_tests_and_functions_exist():
    """``tests/...py::test_name`` and ``dora_num.mod:name`` references of the documents resolve."""
    text = "\n".join(p.read_text() for p in DOCS)
    missing = []
    for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text):
        f = ROOT / path
        if not f.is_file() or not re.search(rf"^def {name}\(", f.read_text(), re.M):
            missing.append(f"{path}::{name}")
    for path in re.findall(r"`(tests/[\w/]+\.py)`", text):
        if not (ROOT / path).is_file():
            missing.append(path)
    for mod, name in re.findall(r"`(dora_num(?:\.\w+)+):(\w+)(?:\.\w+)?`", text):
        try:
            if not hasattr(importlib.import_module(mod), name):
                missing.append(f"{mod}:{name}")
        except ImportError:
            missing.append(f"{mod}:{name}")
    assert not missing, missing
