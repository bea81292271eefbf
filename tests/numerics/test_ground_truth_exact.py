"""Ground truth that cannot certify a wrong answer: wide exponent spans, results next to
float64 and format midpoints, against an independent Fraction evaluation written here
(tests/numerics/_exact_ref.py rounds by searching bit patterns; it shares no code with
dora_num).

Classes (each fails on the two-fixed-precision mpmath route that this replaces):

- a row sum whose exact value needs more bits than both fixed precisions: the tiny term
  decides a tie that both precisions see as exact (certified wrong value);
- the same with the tiny term inside the higher precision but not the lower (valid input
  raised ``GroundTruthError``);
- a square root within 2^-130 of a float64 midpoint (the double-double ``value`` was
  ``hi + lo``, not the certified float64 rounding);
- random rows with entries spread over the whole fp32 exponent range.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from dora_num.numerics import formulas as F
from dora_num.numerics.formats import FORMATS, from_bits, round_to
from dora_num.numerics.ground_truth import (assembly_exact, compose_exact, mp_compose, mp_dense_row_norm,
                                            mp_factored_terms, mp_magnitude_scale, mp_norm_assembly)

from ._exact_ref import round_float, sqrt_round_ref

Fr = Fraction


def _rows_exact(W, A, B, s):
    """Fraction ``base``, ``cross``, ``ba`` and ``||W + s BA||^2`` per row."""
    out = []
    d_out, d = W.shape
    r = A.shape[0]
    sf = Fr(F.scale_constants(s)[0])
    for j in range(d_out):
        w = [Fr(float(v)) for v in W[j]]
        b = [Fr(float(v)) for v in B[j]]
        ba = [sum(b[k] * Fr(float(A[k, i])) for k in range(r)) for i in range(d)]
        out.append({"base": sum(v * v for v in w), "cross": sum(w[i] * ba[i] for i in range(d)),
                    "ba": sum(v * v for v in ba), "q": sum((w[i] + sf * ba[i]) ** 2 for i in range(d))})
    return out


WIDE_ROWS = {  # rows whose exact sums of squares sit a hair beside a tie of fp32 or of float64
    "fp32_tie_plus_2^-320": [2.0**60, 2.0**48, 2.0**-100, 0, 0],  # 2^120 (1 + 2^-24 + 2^-320): -> up
    "tiny_inside_256_not_128": [2.0**60, 2.0**48, 2.0**-15, 0, 0],  # 2^-150 of the value (raised before)
    "float64_tie_plus_tiny": [2.0**60, 2.0**33, 2.0**33, 2.0**-100, 0],  # 2^120 (1 + 2^-53) + tiny -> up
    "sqrt_beside_fp32_midpoint": [2.0**60, 2.0**48, 2.0**48, 2.0**36, 2.0**-100],  # (midpoint)^2 + tiny
    "far_down_with_subnormal": [2.0**-60, 2.0**-72, 2.0**-140, 0, 0],
    "signs_and_min_subnormal": [-(2.0**60), 2.0**48, -(2.0**-100), 2.0**-149, 0],
}


@pytest.mark.parametrize("row", list(WIDE_ROWS))
def test_wide_span_factored_terms_and_dense_norm_are_exactly_rounded(row):
    W = np.array([WIDE_ROWS[row]])
    rng = np.random.default_rng(0)
    A = round_to(rng.standard_normal((2, W.shape[1])), "fp32")
    for B in (np.zeros((1, 2)), round_to(rng.standard_normal((1, 2)) * 2.0**-90, "fp32")):
        e = _rows_exact(W, A, B, 0.37)[0]
        terms = mp_factored_terms(W, A, B)
        dense = mp_dense_row_norm(W, A, B, 0.37)
        for k in ("base", "cross", "ba"):
            assert terms[k].value[0] == round_float("fp64", e[k]), k
            assert terms[k].rounded[0] == round_float("fp32", e[k]), k
        assert dense.value[0] == sqrt_round_ref("fp64", e["q"])
        assert dense.rounded[0] == sqrt_round_ref("fp32", e["q"])


def test_the_wide_rows_are_not_the_ties_even_neighbours():
    """The independent reference itself: these rows round *away* from the tie's even neighbour."""
    q = [sum(Fr(v) ** 2 for v in WIDE_ROWS[k]) for k in ("fp32_tie_plus_2^-320", "float64_tie_plus_tiny",
                                                           "sqrt_beside_fp32_midpoint")]
    assert round_float("fp32", q[0]) == 2.0**120 * (1 + 2.0**-23)
    assert round_float("fp64", q[1]) == 2.0**120 * (1 + 2.0**-52)
    assert sqrt_round_ref("fp32", q[2]) == 2.0**60 * (1 + 2.0**-23)


def test_random_rows_over_the_whole_fp32_range():
    rng = np.random.default_rng(1)
    n, d, r = 12, 9, 3
    W = round_to(rng.choice([-1, 1], (n, d)) * np.exp2(rng.uniform(-149, 60, (n, d))), "fp32")
    A = round_to(rng.standard_normal((r, d)) * np.exp2(rng.uniform(-40, 10, (r, d))), "fp32")
    B = round_to(rng.standard_normal((n, r)) * np.exp2(rng.uniform(-40, 10, (n, r))), "fp32")
    ref = _rows_exact(W, A, B, 2 / np.sqrt(7))
    terms = mp_factored_terms(W, A, B)
    dense = mp_dense_row_norm(W, A, B, 2 / np.sqrt(7))
    for j, e in enumerate(ref):
        for k in ("base", "cross", "ba"):
            assert terms[k].value[j] == round_float("fp64", e[k]) and terms[k].rounded[j] == round_float("fp32", e[k])
        assert dense.value[j] == sqrt_round_ref("fp64", e["q"]) and dense.rounded[j] == sqrt_round_ref("fp32", e["q"])


def _asm_ref(b, c, a, s, name):
    _, two_s, s_sq = F.scale_constants(s)
    q = Fr(b) + Fr(two_s) * Fr(c) + Fr(s_sq) * Fr(a)
    return sqrt_round_ref(name, max(q, Fr(0)))


@pytest.mark.parametrize("route", ["dd", "mp"])
def test_assembly_next_to_float64_and_fp32_midpoints(route):
    """``Q = m^2 +- 2^-129`` with ``m`` a float64 (or fp32) midpoint: the square root lies
    2^-130 beside the tie, far inside the double-double's error bound."""
    m64 = [1.0, 2.0**-52, 2.0**-104]  # (1 + 2^-53)^2 = 1 + 2^-52 + 2^-106 = b + 2s c + s^2 a at s = 0.5
    m32 = [1.0, 2.0**-23, 2.0**-46]  # (1 + 2^-24)^2
    cases = []
    for b, c, a in (m64, m32):
        for t in (1 + 2.0**-23, 1 - 2.0**-24, 1.0):
            cases.append((b, c, a * t))
    cases += [(2.0**100, -(2.0**99) * (1 - 2.0**-23), 2.0**-140), (2.0**-149, 0.0, 2.0**-149), (3.0, -1.5, 0.0)]
    b, c, a = (np.array(x) for x in zip(*cases))
    for fmt, name in (("fp32", "fp32"), ("bf16", "bf16")):
        t = assembly_exact(b, c, a, 0.5, fmt) if route == "dd" else mp_norm_assembly(b, c, a, 0.5, fmt)
        for i in range(len(cases)):
            assert t.value[i] == _asm_ref(b[i], c[i], a[i], 0.5, "fp64"), (i, cases[i])
            assert t.rounded[i] == _asm_ref(b[i], c[i], a[i], 0.5, name), (i, cases[i])
    t = assembly_exact(b, c, a, 0.5, "fp32")
    assert t.value[0] == 1 + 2.0**-52 and t.value[1] == 1.0  # just above / just below the float64 tie
    assert t.n_fallback >= 2


def test_compose_wide_span_and_midpoints_against_fractions():
    rng = np.random.default_rng(2)
    n = 400
    base = round_to(rng.choice([-1, 1], n) * np.exp2(rng.uniform(-149, 100, n)), "fp32")
    lora = round_to(rng.choice([-1, 1], n) * np.exp2(rng.uniform(-149, 100, n)), "fp32")
    g = round_to(np.exp2(rng.uniform(-30, 30, n)) * rng.choice([-1, 1], n), "fp32")
    g[:100] = round_to(1 + rng.choice([-1, 1], 100) * np.exp2(-rng.integers(1, 25, 100)), "fp32")
    # (g-1) base = 2^77 and g s lora = 2^24 (1 - 2^-46): 2^-22 below the float64 midpoint 2^77 + 2^24
    base[0], g[0], lora[0] = 2.0**100, 1 + 2.0**-23, 2.0**25 * (1 - 2.0**-23)
    s = 0.5
    for fmt in ("fp32", "bf16", "fp8_e4m3fn"):
        fast = compose_exact(base, lora, g, s, fmt)
        slow = mp_compose(base, lora, g, s, fmt)
        for i in range(n):
            x = (Fr(g[i]) - 1) * Fr(base[i]) + Fr(g[i]) * (Fr(s) * Fr(lora[i]))
            want64, want = round_float("fp64", x), round_float(fmt, x)
            assert fast.value[i] == want64 and slow.value[i] == want64, i
            assert fast.rounded[i] == want and slow.rounded[i] == want, (fmt, i)
    assert compose_exact(base[:1], lora[:1], g[:1], s).value[0] == 2.0**77


def test_magnitude_scale_exact_over_a_wide_range():
    rng = np.random.default_rng(3)
    m = round_to(np.exp2(rng.uniform(-149, 127, 300)) * rng.choice([-1, 1], 300), "fp32")
    w = round_to(np.exp2(rng.uniform(-149, 127, 300)), "fp32")
    w[:20] = 0.0  # a zero row: g = m / eps (eps guards zero rows only)
    w[20:40] = round_to(np.exp2(rng.uniform(-149, -60, 20)), "fp32")  # nonzero below eps: g = m / w
    eps = 1e-12
    t = mp_magnitude_scale(m, w, eps, "fp32")
    for i in range(300):
        q = Fr(m[i]) / (Fr(w[i]) if w[i] != 0 else Fr(eps))
        assert t.value[i] == round_float("fp64", q) and t.rounded[i] == round_float("fp32", q), i


from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_fp32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(row=st.lists(_fp32, min_size=1, max_size=6))
@example(row=WIDE_ROWS["fp32_tie_plus_2^-320"])
@example(row=WIDE_ROWS["tiny_inside_256_not_128"])
@example(row=[2.0**-149, 2.0**-149, 3.0 * 2.0**-149])
@example(row=[0.0, -0.0])
def test_row_sum_of_squares_and_norm_exactly_rounded_for_any_fp32_row(row):
    """Property: for any fp32 row, the precision chosen from the span makes the mp route exact."""
    W = np.array([row], dtype=np.float64)
    A, B = np.zeros((1, W.shape[1])), np.zeros((1, 1))
    q = sum(Fr(v) ** 2 for v in row)
    t = mp_factored_terms(W, A, B)["base"]
    assert t.value[0] == round_float("fp64", q) and t.rounded[0] == round_float("fp32", q)
    n = mp_dense_row_norm(W, A, B, 0.5)
    assert n.value[0] == sqrt_round_ref("fp64", q) and n.rounded[0] == sqrt_round_ref("fp32", q)


@pytest.mark.parametrize("fmt", ["fp6_e3m2", "fp6_e2m3", "fp4_e2m1"])
def test_compose_and_assembly_ground_truth_in_the_sub_byte_formats(fmt):
    """Every (base, lora) pair of an OCP MX fp6/fp4 format at g on and beside the format's rounding
    boundaries near 1 (both routes), and assembly terms whose root crosses the format's ties and its
    saturation at max, rounded to the format as the Fraction reference rounds (saturating: no inf)."""
    codes = np.arange(1 << FORMATS[fmt].bits)
    vals = from_bits(codes, fmt)
    base, lora = (x.ravel() for x in np.meshgrid(vals, vals, indexing="ij"))
    s = 0.37
    sf = Fr(F.scale_constants(s)[0])
    for g in (1.0, float(np.float32(1 + 2.0**-10)), 1 + FORMATS[fmt].eps / 2, 1 - FORMATS[fmt].spacing_below_one / 2,
              0.5, 2.0):
        gg = np.full(base.shape, g)
        fast = compose_exact(base, lora, gg, s, fmt)
        slow = mp_compose(base[::7], lora[::7], gg[::7], s, fmt)
        want = [(Fr(g) - 1) * Fr(b) + Fr(g) * (sf * Fr(l_)) for b, l_ in zip(base, lora)]
        assert fast.rounded.tolist() == [round_float(fmt, x) for x in want], g
        assert fast.value[::7].tolist() == [round_float("fp64", x) for x in want[::7]], g  # fp64's search is slow
        assert slow.rounded.tolist() == fast.rounded[::7].tolist()
    top = FORMATS[fmt].max
    q = np.concatenate([(vals[vals >= 0] + np.append(vals[vals >= 0][1:], 2 * top)) / 2, [top * top * 4]])
    b = q**2  # the root of b + 2s*0 + s^2*0 is a tie of the format, or beyond max
    for c_ in (0.0, 2.0**-30):
        t = assembly_exact(b, np.full(b.shape, c_), np.zeros(b.shape), s, fmt)
        assert t.rounded.tolist() == [_asm_ref(bi, c_, 0.0, s, fmt) for bi in b], c_
