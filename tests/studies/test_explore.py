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
