"""Collapse statistics and the exact double-double rounding they rely on."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from dora_num.numerics.collapse import absorption_fraction, collapse_stats, exact_zone
from dora_num.numerics.formats import FORMATS, round_dd, round_to, two_prod, two_sum

from ._exact_ref import round_ref

NAMES = list(FORMATS)


@pytest.mark.parametrize("name", NAMES)
def test_round_dd_against_reference_at_ties(name):
    f = FORMATS[name]
    rng = np.random.default_rng(11)
    v = round_to(rng.standard_normal(400) * np.exp2(rng.integers(f.emin - 2, f.emax, 400)), f)
    v = v[np.isfinite(v)]
    step = np.where(v == 0, f.min_subnormal, np.abs(v) * f.eps)  # lower bound on the spacing above |v|
    mids = v + np.sign(v + (v == 0)) * step / 2
    hi = np.concatenate([mids, mids, mids, v, [f.max + (f.max - float(round_to(np.nextafter(f.max, 0), f))) / 2] * 2])
    lo = np.concatenate([np.spacing(mids) / 4, -np.spacing(mids) / 4, np.zeros_like(mids), np.spacing(v) / 8,
                         [-1e-300, 1e-300]])
    got = round_dd(hi, lo, f)
    for h, l, r in zip(hi, lo, got):
        want = round_ref(name, Fraction(h) + Fraction(l))
        if want == "inf":
            assert r == math.copysign(math.inf, h)
        elif want == "nan":
            assert math.isnan(r)
        else:
            assert r == float(want), (name, h, l, r, float(want))


def test_error_free_transformations_are_exact():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal(5000) * 1e3, rng.standard_normal(5000) * 1e-7
    s, e = two_sum(a, b)
    p, q = two_prod(a, b)
    for i in range(0, 5000, 50):
        assert Fraction(s[i]) + Fraction(e[i]) == Fraction(a[i]) + Fraction(b[i])
        assert Fraction(p[i]) + Fraction(q[i]) == Fraction(a[i]) * Fraction(b[i])


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"])
def test_exact_zone_is_asymmetric_and_matches_rounding(name):
    f = FORMATS[name]
    lo, hi = exact_zone(f)
    assert 1 - lo == f.eps / 4 and hi - 1 == f.eps / 2
    edge = np.array([lo, np.nextafter(lo, 0), hi, np.nextafter(hi, 2)])
    np.testing.assert_array_equal(round_to(edge, f) == 1.0, [True, False, True, False])


def test_collapse_stats_counts():
    f = FORMATS["bf16"]
    # g = 1 - 3/8 eps: inside the paper's symmetric zone, but rounds to 1 - eps/2, not to 1
    g = np.array([1.0, 1 - 0.375 * f.eps, 1 + 0.49 * f.eps, 1 + 0.51 * f.eps, 0.9, 1 - 0.2 * f.eps])
    st = collapse_stats(g, f)
    assert st["n"] == 6
    assert st["frac_symmetric_zone"] == pytest.approx(4 / 6)
    assert st["frac_rounds_to_one"] == pytest.approx(3 / 6)
    assert st["frac_below_one_symmetric"] == pytest.approx(2 / 6)
    assert st["frac_below_one_rounds_to_one"] == pytest.approx(1 / 6)
    assert st["threshold_symmetric"] == 2.0**-8
    with pytest.raises(ValueError, match="g contains 1 non-finite"):
        collapse_stats(np.array([1.0, np.nan]), f)
    with pytest.raises(ValueError, match="g is empty"):
        collapse_stats(np.array([]), f)


def test_absorption_fraction():
    f = FORMATS["bf16"]
    x = round_to(np.array([1.0, 1.5, 3.0, 0.0, 1.0]), f)
    g = np.array([1 + f.eps / 2, 1 + f.eps / 2, 1 + f.eps / 2 + 2.0**-30, 1.3, 1 + f.eps])
    # 1*(1+eps/2): tie -> 1 (absorbed); 1.5*(1+eps/2) = 1.5 + 0.75 eps -> 1.5 + eps (not);
    # 3*(1+eps/2+tiny) -> just above the tie 3 + 1.5 eps -> 3 + 2 eps (not); 0 absorbed; 1*(1+eps) not
    assert absorption_fraction(g, x, f) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="x must hold values representable in bf16"):
        absorption_fraction(g, np.full(5, 1.001), f)
