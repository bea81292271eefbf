"""The explorer's computations (notebook 07) against the package's ground truth and bounds."""

import math

import numpy as np
import pytest

from dora_num.numerics.bounds import compose_bound, compose_condition, compose_ulp_bound, one_ulp_condition
from dora_num.numerics.ground_truth import compose_exact
from dora_num.studies import explore as X


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3fn"])
@pytest.mark.parametrize("formula", X.FORMULAS)
@pytest.mark.parametrize("arith", X.ARITHS)
def test_point_agrees_with_ground_truth_and_bound(fmt, formula, arith):
    p = X.point(fmt, formula, arith, 1 + 3e-4, 0.37, 1.5, -2e-3)
    truth = compose_exact(np.array([p["base"]]), np.array([p["lora"]]), np.array([p["g"]]), p["s"], fmt)
    assert p["exact_rounded"] == truth.rounded[0] and math.isclose(p["exact"], truth.value[0], rel_tol=1e-15)
    B = compose_bound(formula, np.array([p["base"]]), np.array([p["lora"]]), np.array([p["g"]]), p["s"], fmt, arith)[0]
    assert p["bound"] == B and p["within_bound"] and p["abs_err"] <= B
    args = (np.array([p["base"]]), np.array([p["lora"]]), np.array([p["g"]]), p["s"])
    U = compose_ulp_bound(formula, *args, fmt, arith)[0]
    assert p["ulp_bound"] == U and p["within_ulp_bound"] and p["ulp_error"] <= U
    assert p["kappa_c"] == compose_condition(*args)[0] and p["one_ulp_condition"] == one_ulp_condition(fmt)
    if formula == "compose_stable" and arith == "fp32" and p["kappa_c"] <= p["one_ulp_condition"]:
        assert p["ulp_error"] <= 1  # lemma 1's claim
    lo, hi = X.collapse_zone(fmt)
    assert p["g_rounds_to_1"] == (lo <= p["g"] <= hi)


def test_naive_collapses_inside_the_zone_and_stable_does_not():
    sw_n = X.sweep("bf16", "compose_naive", "per_op", 0.5, 3.0, 1e-3, lo_exp=-6, hi_exp=-2, n=9)
    sw_s = X.sweep("bf16", "compose_stable", "fp32", 0.5, 3.0, 1e-3, lo_exp=-6, hi_exp=-2, n=9)
    assert sw_n["err_ulps"].max() > 10 and (sw_s["err_ulps"] <= sw_s["bound_ulps"]).all()
    assert (sw_s["err_ulps"] <= 0.5 + 1e-9).all()  # stable, contract: correctly rounded on this easy input


@pytest.mark.parametrize("kwargs, match", [
    (dict(formula="compose_fast"), "formula must be"), (dict(arith="fp16"), "arith must be"),
    (dict(g=3.0), "outside"), (dict(base=float("nan")), "base must be a finite"), (dict(lora=1e6), "overflows"),
])
def test_point_refuses_bad_input(kwargs, match):
    args = dict(fmt="fp16", formula="compose_stable", arith="fp32", g=1.001, s=0.5, base=1.0, lora=1e-3) | kwargs
    with pytest.raises(ValueError, match=match):
        X.point(**args)


def _defaults():
    from dora_num.repro.notebook import notebook_parameters

    return {p.name: p.default for p in notebook_parameters("07_explore")}


def test_the_notebook_defaults_show_the_naive_collapse_and_where_the_stable_form_is_worse():
    d = _defaults()
    assert (d["FORMAT"], d["ARITH"]) == ("fp32", "fp32")  # the arithmetic where nothing hides the cancellation
    e = X.effects(X.arithmetics(d["S"], d["BASE"], d["LORA"], n=31))
    assert e["fp32/fp32"]["naive_over_stable"] > 100 and e["fp32/fp32"]["all_within_bound"]
    assert e["bf16/fp32"]["stable_max_ulps"] <= 0.5
    eager = e["bf16/per_op"]
    assert eager["stable_max_ulps"] > eager["naive_max_ulps"]  # with g stored in bf16 the stable form is the worse
    assert 0 < eager["stable_worse_points"] == eager["stable_worse_in_zone_opposite_signs"]
    pt = X.point(d["FORMAT"], d["FORMULA"], d["ARITH"], 1 + d["G_MINUS_1"], d["S"], d["BASE"], d["LORA"])
    assert pt["err_ulps"] > 100 and pt["within_bound"]


@pytest.mark.parametrize("base, lora", [(1.0, 1e-5), (-3.0, 1e-3), (1.0, -1e-4), (0.7, 1e-3)])
def test_in_the_zone_the_stable_form_is_worse_only_where_the_terms_have_opposite_signs(base, lora):
    """With s*lora below half the bf16 spacing of base, fl(s*lora + base) = base: the naive form returns
    about 0 (off by |X|) and the stable form s*lora (off by |(g-1) base|); the stable form is the worse only
    where the two terms of X have opposite signs.  (With a larger s*lora the naive form's rounding of
    s*lora + base decides, and either can be the worse.)"""
    _, _, s32, b, l_ = X._inputs("bf16", 1.0, 0.5, base, lora)
    assert abs(s32 * l_) < abs(b) * 2.0**-9
    sw = X.arithmetics(0.5, base, lora, n=31, settings=X.SETTINGS[2:])
    st = sw[sw.formula == "compose_stable"].set_index("g_minus_1")
    nv = sw[sw.formula == "compose_naive"].set_index("g_minus_1").reindex(st.index)
    worse_in_zone = (st["err_ulps"] > nv["err_ulps"]) & st["g_rounds_to_1"]
    assert not (worse_in_zone & ~st["opposite_signs"]).any()
    assert (sw["err_ulps"] <= sw["bound_ulps"]).all()


def test_widgets_are_not_built_without_a_frontend(monkeypatch, capsys):
    monkeypatch.delenv("DORA_NUM_WIDGETS", raising=False)
    assert X.widgets() is None
    assert "no live panel" in capsys.readouterr().out
