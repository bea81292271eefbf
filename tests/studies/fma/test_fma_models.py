"""Contraction sites derived from the formulas; exact placements; square-root models.

Reference ladder: the placement arithmetic against the numerics engineer's
arithmetics (bitwise) and against exact rational arithmetic (Fractions); the
square-root checks against Python's exact integer square root.
"""

from __future__ import annotations

import inspect
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dora_num.numerics import formulas as F
from dora_num.numerics.arithmetic import TorchFP32, TorchFP32CorrectSqrt
from dora_num.numerics.emulate import FP32, FP32_FMA
from dora_num.numerics.formats import round_fraction, round_to
from dora_num.studies.fma import models as M

S_GENERAL = 48.0 / math.sqrt(24.0)  # a scale whose products round (not a power of two)


# ------------------------------------------------------------------ sites

def test_sites_are_exactly_the_muladd_calls_of_each_formula():
    """Independent count: the formula's source text, one site per ``ar.muladd(`` call."""
    for name in M.formula_names():
        src = inspect.getsource(getattr(F, name))
        n_src = len(re.findall(r"\bar\.muladd\(", src))
        assert len(M.contraction_sites([name])) == n_src, name


def test_site_list_of_the_norm_assembly_and_compose():
    by = {}
    for s in M.contraction_sites():
        by.setdefault(s.formula, []).append(s)
    assert [s.fused for s in by["norm_assembly"]] == ["fma(two_s, cross, base_sq)",
                                                      "fma(s_sq, ba, (two_s*cross + base_sq))"]
    (st_site,) = by["compose_stable"]
    assert st_site.removes == "fl((g - 1.0)*base)"
    assert st_site.alternative == ("g", "s*lora")  # both addends are products
    assert len(by["compose_naive"]) == 2 and len(by["compose_inner"]) == 1
    assert "compose_backward_elementwise" not in by and "magnitude_scale" not in by
    assert len(M.placements("norm_assembly")) == 4 and len(M.placements("compose_stable")) == 3


def test_unmarked_contractible_add_is_flagged():
    tr = M.SiteTracer("toy")
    a, b, c = (M.Node("input", (), n) for n in "abc")
    tr.add(tr.mul(a, b), c)
    assert tr.unmarked and "unrounded product a*b" in tr.unmarked[0]


# ------------------------------------------------------------------ placements

def _terms(n, s, seed=0, cancel=False):
    rng = np.random.default_rng(seed)
    _, two_s, s_sq = F.scale_constants(s)
    base = np.exp(rng.normal(0, 1, n)) * 100
    cross = base * rng.normal(0, 0.3, n) / two_s
    if cancel:
        cross = -(base / two_s) * (1 - 10.0 ** rng.uniform(-6, -1, n))
    ba = base * np.abs(rng.normal(0, 1, n)) / s_sq
    f = lambda x: round_to(x, "fp32")  # noqa: E731
    return {"base_sq": f(base), "cross": f(cross), "ba": f(ba), "two_s": two_s, "s_sq": s_sq}


@pytest.mark.parametrize("s", [0.5, S_GENERAL], ids=["pow2", "general"])
def test_no_contraction_is_the_production_sequence_bitwise(s):
    terms = _terms(4097, s)
    got = M.evaluate("norm_assembly", ("none", "none"), terms)
    t = {k: torch.from_numpy(v).float() if isinstance(v, np.ndarray) else v for k, v in terms.items()}
    want = F.norm_assembly(TorchFP32CorrectSqrt, t["base_sq"], t["cross"], t["ba"], t["two_s"], t["s_sq"])
    assert np.array_equal(got, want.double().numpy())
    assert np.array_equal(got, F.norm_assembly(FP32, *[terms[k] for k in M.formula_inputs("norm_assembly")]))


def test_contract_everywhere_is_the_numerics_fma_arithmetic_bitwise():
    terms = _terms(4097, S_GENERAL, cancel=True)
    got = M.evaluate("norm_assembly", ("fma", "fma"), terms)
    want = F.norm_assembly(FP32_FMA, *[terms[k] for k in M.formula_inputs("norm_assembly")])
    assert np.array_equal(got, want)


def _fr(x):
    return Fraction(float(x))


def test_placements_against_exact_rationals():
    """Each placement of the stable compose, element by element, from exact rationals."""
    rng = np.random.default_rng(1)
    n = 300
    base = round_to(rng.normal(0, 1, n) * 10.0 ** rng.integers(-2, 3, n), "fp32")
    lora = round_to(rng.normal(0, 1, n), "fp32")
    g = round_to(1 + 1e-3 * rng.normal(0, 1, n), "fp32")
    s = F.scale_constants(S_GENERAL)[0]
    args = {"base": base, "lora": lora, "g": g, "s": s}
    out = {c: M.evaluate("compose_stable", c, args) for c in M.placements("compose_stable")}
    r = lambda x: Fraction(round_fraction(x, "fp32"))  # noqa: E731
    for i in range(n):
        b, lo, gg = _fr(base[i]), _fr(lora[i]), _fr(g[i])
        gm1 = r(gg - 1)
        sl = r(_fr(s) * lo)
        t = r(gg * sl)
        p = r(gm1 * b)
        assert out[("none",)][i] == round_fraction(p + t, "fp32")
        assert out[("fma",)][i] == round_fraction(gm1 * b + t, "fp32")
        assert out[("alt",)][i] == round_fraction(gg * sl + p, "fp32")


def test_site_records_removed_rounding_is_exact():
    terms = _terms(257, S_GENERAL)
    recs = []
    M.evaluate("norm_assembly", ("none", "none"), terms, records=recs)
    for i in range(257):
        exact = Fraction(terms["two_s"]) * _fr(terms["cross"][i])
        assert Fraction(float(recs[0]["removed"][i])) == abs(exact - Fraction(round_fraction(exact, "fp32")))


def test_power_of_two_scale_makes_assembly_contraction_invisible():
    terms = _terms(10_000, 0.5, cancel=True)
    none = M.evaluate("norm_assembly", ("none", "none"), terms)
    assert np.array_equal(M.evaluate("norm_assembly", ("fma", "fma"), terms), none)
    terms = _terms(10_000, S_GENERAL, cancel=True)  # ... and visible otherwise (the test can fail)
    assert not np.array_equal(M.evaluate("norm_assembly", ("fma", "fma"), terms),
                              M.evaluate("norm_assembly", ("none", "none"), terms))


@pytest.mark.parametrize("choice,msg", [
    (("none",), "more contraction sites"),
    (("none", "none", "none"), "3 choices given"),
    (("fused", "none"), "'none', 'fma' or 'alt'"),
    (("alt", "none"), "addend to be a product"),
])
def test_bad_placements_raise(choice, msg):
    with pytest.raises(ValueError, match=msg):
        M.evaluate("norm_assembly", choice, _terms(3, S_GENERAL))


# ------------------------------------------------------------------ square roots

def _exact_rn_sqrt(x: float) -> float:
    """Correctly rounded fp32 sqrt by exact integer arithmetic: x = M 2^E, scale to
    an even exponent with >= 60 bits, isqrt, then round the remainder exactly."""
    if x == 0:
        return 0.0
    fr = Fraction(x)
    k = 0
    while fr < Fraction(1 << 120):
        fr *= 4
        k += 1
    num = fr.numerator // fr.denominator  # fr is an integer for float inputs scaled up this far
    assert Fraction(num) == fr
    root = math.isqrt(num)
    exact_lo, exact_hi = Fraction(root, 2**k), Fraction(root + 1, 2**k)
    # sqrt(x) lies in [exact_lo, exact_hi), an interval far narrower than an fp32 ulp/2^30
    a, b = round_fraction(exact_lo, "fp32"), round_fraction(exact_hi, "fp32")
    assert a == b, "interval straddles a rounding boundary (cannot happen: roots are never midpoints)"
    return a


SPECIAL = [0.0, 1.0, 2.0, 4.0, 0.25, 2.0**-149, 2.0**-126, 3 * 2.0**-140, float(np.finfo(np.float32).max),
           float(np.nextafter(np.float32(1), np.float32(2))), float(np.nextafter(np.float32(4), np.float32(0)))]


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, max_value=float(np.finfo(np.float32).max), width=32, allow_subnormal=True))
@example(2.0**-149)
@example(float(np.finfo(np.float32).max))
@example(2.0)
def test_sqrt_models_against_integer_square_roots(x):
    want = _exact_rn_sqrt(x)
    rn, other, exact = M.sqrt_neighbours(np.array([x]))
    assert rn[0] == want
    assert M.sqrt_is_correctly_rounded(np.array([x]), rn)[0]
    if not exact[0]:
        assert not M.sqrt_is_correctly_rounded(np.array([x]), other)[0]
        # the exact root lies between rn and other
        lo, hi = sorted((Fraction(float(rn[0])), Fraction(float(other[0]))))
        assert lo * lo < Fraction(x) < hi * hi
        assert 0 < M.midpoint_distance(np.array([x]))[0] <= 0.5


def test_sqrt_special_values_and_bulk_check():
    x = np.array(SPECIAL)
    assert [float(v) for v in M.sqrt_rn(x)] == [_exact_rn_sqrt(v) for v in SPECIAL]
    rng = np.random.default_rng(3)
    bits = rng.integers(1, 0x7F800000, 2000, dtype=np.uint32).view(np.float32).astype(np.float64)
    rn = M.sqrt_rn(bits)
    assert M.sqrt_is_correctly_rounded(bits, rn).all()
    assert [float(v) for v in rn[:200]] == [_exact_rn_sqrt(float(v)) for v in bits[:200]]
    off = np.nextafter(rn.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    assert not M.sqrt_is_correctly_rounded(bits, off).any()


def test_check_faithful_counts():
    x = round_to(np.random.default_rng(4).uniform(1, 4, 1000), "fp32")
    rn, other, exact = M.sqrt_neighbours(x)
    mixed = np.where(np.arange(1000) % 2 == 0, rn, other)
    mixed[7] = float(np.nextafter(np.float32(max(rn[7], other[7])), np.float32(np.inf)))  # neither neighbour
    c = M.check_faithful(x, mixed)
    assert c.n_outside == 1 and c.n_rn + c.n_other + c.n_outside == 1000
    assert c.rate_bounds == (0.0, float((~exact).mean()))


@pytest.mark.parametrize("fn", [M.sqrt_rn, M.sqrt_neighbours, M.midpoint_distance])
def test_sqrt_models_reject_non_fp32_input(fn):
    with pytest.raises(ValueError, match="x must hold fp32 values"):
        fn(np.array([0.1]))


def test_torch_cpu_sqrt_is_not_correctly_rounded_here_but_numpy_is():
    """The platform fact the table reports (docs/platform.md), decided exactly."""
    x = round_to(np.random.default_rng(5).uniform(1, 4, 100_000), "fp32")
    x32 = x.astype(np.float32)
    assert M.sqrt_is_correctly_rounded(x, np.sqrt(x32).astype(np.float64)).all()
    torch_ok = M.sqrt_is_correctly_rounded(x, torch.sqrt(torch.from_numpy(x32)).double().numpy())
    assert 0.0 < 1 - torch_ok.mean() < 0.5
    assert M.sqrt_is_correctly_rounded(x, TorchFP32CorrectSqrt.sqrt(torch.from_numpy(x32)).double().numpy()).all()
    assert TorchFP32.sqrt is not TorchFP32CorrectSqrt.sqrt
