"""Ground truth: the vectorised double-double path against mpmath at its exact precision,
at ties and boundaries; exact norms.  Wide-span and midpoint classes against an
independent Fraction evaluation: tests/numerics/test_ground_truth_exact.py."""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest

from dora_num.numerics import formulas as F
from dora_num.numerics.exact import DDArith, MPArith, certified_round, to_mp
from dora_num.numerics.formats import FORMATS, round_fraction, round_to, ulp
from dora_num.numerics.ground_truth import (assembly_exact, compose_exact, mp_compose, mp_dense_row_norm,
                                            mp_factored_terms, mp_magnitude_scale, mp_norm_assembly)

NAMES = list(FORMATS)


def _compose_cases(fmt, n, seed):
    rng = np.random.default_rng(seed)
    r = lambda x: round_to(x, fmt)  # noqa: E731
    base = r(rng.standard_normal(n))
    lora = r(rng.standard_normal(n) * 0.1)
    g = round_to(1 + rng.standard_normal(n) * 1e-3, "fp32")
    # ties: g = 1 makes delta = s*lora exactly; s = 0.5 and lora values of the format's
    # own grid half-way steps make exact midpoints of the format
    k = n // 4
    g[:k] = 1.0
    v = r(rng.standard_normal(k))
    lora[:k] = round_to(2 * (v + ulp(v, fmt) / 2), "fp32")  # with s = 0.5: delta on a midpoint
    return base, lora, g


@pytest.mark.parametrize("fmt", NAMES)
def test_compose_exact_matches_mpmath(fmt):
    base, lora, g = _compose_cases(fmt, 1500, 1)
    for s in (0.5, 0.37):
        fast = compose_exact(base, lora, g, s, fmt)
        ref = mp_compose(base, lora, g, s, fmt)
        np.testing.assert_array_equal(fast.rounded, ref.rounded)
        np.testing.assert_array_equal(fast.value, ref.value)


def test_compose_exact_at_exact_midpoints_and_with_fallback():
    """Values exactly on a bf16 midpoint (err = 0, decided by ties-to-even) and values a
    hair off a midpoint (the bound cannot decide: mpmath fallback) are both correct."""
    f = FORMATS["bf16"]
    mid = 1 + f.eps / 2  # tie between 1 and 1 + eps; even is 1
    # g = 1, s = 0.5, lora = 2*mid: delta = mid exactly
    t = compose_exact(np.zeros(1), np.array([2 * mid]), np.ones(1), 0.5, f)
    assert t.rounded[0] == 1.0 and t.n_fallback == 0
    # a product needing 72 bits just above / below the tie: g*(s*lora) with g = 1 +- 2^-23
    g = np.array([1 + 2.0**-23, 1 - 2.0**-24])
    lora = round_to(mid / (g * 0.37), "fp32")
    t = compose_exact(np.zeros(2), lora, g, 0.37, f)
    ref = mp_compose(np.zeros(2), lora, g, 0.37, f)
    np.testing.assert_array_equal(t.rounded, ref.rounded)


def test_certified_round_flags_undecidable_elements():
    from dora_num.numerics.exact import DD

    mid = 1 + FORMATS["bf16"].eps / 2
    dd = DD(np.array([mid, mid, 1.1]), np.array([0.0, 0.0, 0.0]), np.array([0.0, 1e-30, 1e-30]))
    r, unc = certified_round(dd, "bf16")
    assert list(unc) == [False, True, False] and r[0] == 1.0


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_e4m3fn"])
def test_assembly_exact_matches_mpmath_including_cancellation_and_zero(fmt):
    rng = np.random.default_rng(5)
    n, s = 1200, 0.37
    b = rng.uniform(0.1, 10, n)
    t = 1 + rng.standard_normal(n) * np.exp2(-rng.uniform(2, 25, n))
    a = b * t * t / s**2
    rho = -1 + np.exp2(-rng.uniform(1, 45, n))
    c = rho * np.sqrt(a * b)
    c[:100] = -np.sqrt(a[:100] * b[:100]) * 1.01  # Q < 0: the clamp to 0
    b[100:120] = c[100:120] = a[100:120] = 0.0  # zero rows
    b, c, a = (round_to(x, "fp32") for x in (b, c, a))
    fast = assembly_exact(b, c, a, s, fmt)
    ref = mp_norm_assembly(b, c, a, s, fmt)
    np.testing.assert_array_equal(fast.rounded, ref.rounded)
    np.testing.assert_array_equal(fast.value, ref.value)
    assert (fast.value[:120] == 0).all()


def test_dd_arith_evaluates_the_same_formula_as_mpmath():
    """Unrounded values: DDArith's hi+lo is within its certified err of the mpmath value (at 300
    bits, exact for these inputs).  Realistic fp32 inputs: the compose is exact in double-double
    (err == 0, so hi + lo must equal the exact value); a 2^63 base against a 72-bit 2^-10 term
    needs more than 106 contiguous bits: err > 0 and still bounds the gap."""
    rng = np.random.default_rng(9)
    base, lora = round_to(rng.standard_normal(300), "fp32"), round_to(rng.standard_normal(300), "fp32")
    g = round_to(1 + rng.standard_normal(300) * 1e-2, "fp32")
    base[:100] = 2.0**63
    lora[:100] = round_to(rng.uniform(1, 2, 100) * 2.0**-9, "fp32")
    g[:100] = 1 + 2.0**-23
    dd = F.compose_stable(DDArith, base, lora, g, F.scale_constants(0.37)[0])
    with mpmath.workprec(300):
        mp = F.compose_stable(MPArith(300), to_mp(base), to_mp(lora), to_mp(g), mpmath.mpf(F.scale_constants(0.37)[0]))
        for i in range(300):
            gap = abs(mpmath.mpf(dd.hi[i]) + mpmath.mpf(dd.lo[i]) - mp[i])
            assert gap <= dd.err[i], (i, gap, dd.err[i])
    assert (dd.err[:100] > 0).all() and (dd.err[100:] == 0).all()
    assert (dd.err <= 2.0**-95 * (np.abs(base) + np.abs(lora))).all()


def test_exact_norms_and_g():
    rng = np.random.default_rng(4)
    W = round_to(rng.standard_normal((5, 12)), "fp32")
    A = round_to(rng.standard_normal((3, 12)), "fp32")
    B = round_to(rng.standard_normal((5, 3)), "fp32")
    s = 0.37
    sf = F.scale_constants(s)[0]
    dense = mp_dense_row_norm(W, A, B, s)
    terms = mp_factored_terms(W, A, B)
    # independent check with Fractions: ||W + s BA||^2 and the factored identity
    for j in range(5):
        x = [Fraction(W[j, i]) + Fraction(sf) * sum(Fraction(B[j, k]) * Fraction(A[k, i]) for k in range(3))
             for i in range(12)]
        q = sum(v * v for v in x)
        assert round_fraction(q, "fp32") == round_fraction(Fraction(dense.value[j]) ** 2, "fp32") or \
            abs(float(q) - dense.value[j] ** 2) <= 4 * 2.0**-53 * float(q)
        base = sum(Fraction(v) ** 2 for v in W[j])
        assert terms["base"].value[j] == float(base)
    asm = mp_norm_assembly(round_to(terms["base"].value, "fp32"), round_to(terms["cross"].value, "fp32"),
                           round_to(terms["ba"].value, "fp32"), s)
    np.testing.assert_allclose(asm.value, dense.value, rtol=1e-6)  # fp32-rounded terms: rel. 2^-24 kappa
    g = mp_magnitude_scale(dense.value * 1.001, dense.value, 1e-12, "fp32")
    assert np.all(np.abs(g.value - 1.001) < 1e-12)
    with pytest.raises(ValueError, match="W contains non-finite"):
        mp_dense_row_norm(W * np.inf, A, B, s)
