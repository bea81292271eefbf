"""Formats: constants, exact rounding, ulp and ULP distance against an independent
integer implementation (tests/numerics/_exact_ref.py), plus the facts about
ml_dtypes / torch that the module docstring states."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from packaging.version import Version

from dora_num.numerics.formats import FORMATS, get_format, round_fraction, round_to, ulp, ulp_distance

from ._exact_ref import LAYOUTS, decode, max_pattern, ordinal_ref, round_ref

NAMES = list(FORMATS)
TYPED = [n for n in NAMES if FORMATS[n].np_dtype is not None]  # the formats numpy or ml_dtypes has a type of


def _ref_float(name, x: float) -> float:
    r = round_ref(name, Fraction(x))
    if r == "inf":
        return math.copysign(math.inf, x)
    if r == "nan":
        return math.nan
    return math.copysign(float(r), x) if r == 0 else float(r)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


# ---------------------------------------------------------------- constants

@pytest.mark.parametrize("name", NAMES)
def test_constants_match_bit_layout(name):
    f = FORMATS[name]
    eb, mb, bias, kind = LAYOUTS[name]
    assert f.p == mb + 1 and f.bits == 1 + eb + mb
    assert Fraction(f.max) == decode(name, max_pattern(name))
    assert Fraction(f.min_subnormal) == decode(name, 1)
    assert Fraction(f.min_normal) == decode(name, 1 << mb)
    one = 1 << mb  # pattern index of 1.0 counted from the smallest normal binade
    one_bits = (bias << mb)
    assert decode(name, one_bits) == 1 and one > 0
    assert Fraction(f.spacing_above_one) == decode(name, one_bits + 1) - 1 == Fraction(f.eps)
    assert Fraction(f.spacing_below_one) == 1 - decode(name, one_bits - 1)
    assert f.u == f.eps / 2 and f.has_inf == (kind == "ieee")


@pytest.mark.parametrize("name", TYPED)
def test_constants_match_ml_dtypes_finfo(name):
    f = FORMATS[name]
    fi = ml_dtypes.finfo(f.np_dtype)
    assert (f.eps, f.max, f.min_normal, f.min_subnormal) == (float(fi.eps), float(fi.max),
                                                            float(fi.smallest_normal), float(fi.smallest_subnormal))
    assert f.spacing_below_one == float(fi.epsneg)


def test_get_format_accepts_names_and_dtypes():
    assert get_format("bf16") is get_format(torch.bfloat16) is get_format(ml_dtypes.bfloat16) is get_format("bfloat16")
    assert get_format(np.float16) is FORMATS["fp16"] and get_format(torch.float32) is FORMATS["fp32"]
    with pytest.raises(ValueError, match="unknown format name 'fp12'"):
        get_format("fp12")
    with pytest.raises(ValueError, match="torch dtype torch.int8"):
        get_format(torch.int8)


# ---------------------------------------------------------------- rounding

def _all_values(name):
    """Every non-negative finite value of an 8/16-bit format, from the independent decoder."""
    return np.array([float(decode(name, k)) for k in range(max_pattern(name) + 1)])


@pytest.mark.parametrize("name", [n for n in NAMES if FORMATS[n].bits <= 16])
def test_round_exhaustive_values_midpoints_and_neighbours(name):
    """Every value, every midpoint (a tie) and points just beside each midpoint, both signs."""
    f = FORMATS[name]
    v = _all_values(name)
    top_step = v[-1] - v[-2]
    nxt = np.append(v[1:], v[-1] + top_step)
    mid = (v + nxt) / 2  # exact in float64
    even_low = (np.arange(v.size) % 2 == 0)
    want_mid = np.where(even_low, v, nxt)
    tiny = np.spacing(mid)
    want_below, want_above = v, nxt
    # the step past the top is overflow (e4m3fn: saturation to 448, as torch)
    over = np.inf if f.has_inf else f.max
    for arr in (want_mid, want_above):
        arr[-1] = over if arr[-1] > f.max else arr[-1]
    for sign in (1.0, -1.0):
        np.testing.assert_array_equal(round_to(sign * v, f), sign * v)
        np.testing.assert_array_equal(round_to(sign * mid, f), sign * want_mid)
        np.testing.assert_array_equal(round_to(sign * (mid - tiny), f), sign * want_below)
        np.testing.assert_array_equal(round_to(sign * (mid + tiny), f), sign * want_above)


_EXAMPLES = [0.0, -0.0, 1.0, 1 + 2.0**-8, 1 + 2.0**-8 + 2.0**-40, 1 - 2.0**-9, 1 - 2.0**-9 - 2.0**-50,
             1 + 2.0**-11, 1 + 2.0**-24, 1 - 2.0**-25, 448.0, 464.0, 464.0001, 480.0, 57344.0, 61440.0,
             61439.99, 65504.0, 65520.0, 65519.99, 3.3895313892515355e38, 3.4028234663852886e38,
             3.402823567797337e38, 2.0**-149, 2.0**-150, 2.0**-150 * 1.5, 2.0**-133, 2.0**-134 * 3,
             2.0**-24, 2.0**-25, 2.0**-9, 2.0**-10, 2.0**-17, 2.0**-16 * 0.75, 5e-324, 1e300, -1e-300]


def _examples(f):
    for x in _EXAMPLES:
        f = example(x=x)(f)
    return f


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False))
@_examples
def test_round_matches_integer_reference(x):
    for name in NAMES:
        got = float(round_to(np.array([x]), name)[0])
        want = _ref_float(name, x)
        assert _same(got, want), (name, x.hex(), got, want)
        if not math.isnan(want):
            assert round_fraction(Fraction(x), name) == want


@pytest.mark.parametrize("name", NAMES)
def test_round_specials(name):
    f = FORMATS[name]
    r = round_to(np.array([np.inf, -np.inf, np.nan, -0.0]), f)
    if f.has_inf:
        assert r[0] == np.inf and r[1] == -np.inf
    else:  # torch saturates infinities too
        assert r[0] == f.max and r[1] == -f.max
    assert np.isnan(r[2]) and r[3] == 0 and np.signbit(r[3])
    assert round_to(np.array([-1e-300]), f)[0] == 0 and np.signbit(round_to(np.array([-1e-300]), f)[0])


@pytest.mark.parametrize("name", NAMES)
def test_round_random_bulk_against_reference(name):
    """Bulk vectorised rounding vs the scalar reference on values at every scale of the format."""
    f = FORMATS[name]
    rng = np.random.default_rng(7)
    x = rng.standard_normal(1500) * np.exp2(rng.uniform(f.emin - f.p - 2, f.emax + 1.5, 1500))
    got = round_to(x, f)
    want = np.array([_ref_float(name, float(v)) for v in x])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", [n for n in TYPED if n != "fp32"])
def test_ml_dtypes_is_exact_from_float32_and_its_float64_conversion_is_as_documented(name):
    """The fact behind not using ml_dtypes' float64 conversion (module docstring): exact from float32;
    from float64 through float32 (double rounding) before 0.7, rounded once from 0.7 (the lock's)."""
    f = FORMATS[name]
    rng = np.random.default_rng(3)
    x32 = (rng.standard_normal(200_000) * np.exp2(rng.uniform(f.emin - f.p, min(f.emax, 126), 200_000))).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        via_ml = x32.astype(f.np_dtype).astype(np.float64)
    ours = round_to(x32.astype(np.float64), f)
    if f.specials != "nan":  # IEEE overflow to inf; the MX formats saturate in ml_dtypes as in round_to
        np.testing.assert_array_equal(via_ml, ours)
        assert f.has_inf or (np.abs(ours) == f.max).sum() > 100
    else:  # e4m3fn: ml_dtypes gives NaN beyond 464 where torch (and round_to) saturate to 448
        inside = np.abs(x32) <= 464
        assert (~inside).sum() > 100
        np.testing.assert_array_equal(via_ml[inside], ours[inside])
        assert np.isnan(via_ml[~inside]).all() and (np.abs(ours[~inside]) == f.max).all()
    if f.np_dtype is not np.float16:  # numpy's float64 -> float16 is direct (single rounding)
        x = 1 + f.eps / 2 + 2.0**-40  # just above the tie 1 + eps/2; via float32 it becomes the tie
        double_rounds = Version(ml_dtypes.__version__) < Version("0.7")
        assert float(np.float64(x).astype(f.np_dtype)) == (1.0 if double_rounds else 1 + f.eps)
        assert round_to(np.array([x]), f)[0] == 1 + f.eps


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_torch_conversion_matches(name):
    f = FORMATS[name]
    rng = np.random.default_rng(5)
    x = rng.standard_normal(100_000) * np.exp2(rng.uniform(f.emin - f.p, min(f.emax, 126), 100_000))
    x32 = x.astype(np.float32)
    t = torch.from_numpy(x32).to(f.torch_dtype).double().numpy()
    np.testing.assert_array_equal(t, round_to(x32.astype(np.float64), f))


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp8_e5m2"])
@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_torch_fp8_conversion_matches_including_overflow(name, src):
    """torch 2.13's conversion to fp8: round to nearest even; e4m3fn saturates every |x| > 448
    (464, 480, ..., inf) to 448, e5m2 overflows to inf (module docstring); round_to follows it."""
    f = FORMATS[name]
    rng = np.random.default_rng(11)
    x = rng.standard_normal(200_000) * np.exp2(rng.uniform(f.emin - f.p - 1, f.emax + 3, 200_000))
    edge = np.array([440, 448, 449, 463.9, 464, 464.1, 479, 480, 500, 1e4, 57344, 61439, 61440, 65504, 1e30,
                     np.inf, -np.inf, np.nan, -464, -465, 0.0, -0.0, f.min_subnormal / 2, f.min_subnormal * 0.51])
    x = np.concatenate([x, edge, -x[:1000]])
    xs = torch.from_numpy(x).to(src)
    want = xs.to(f.torch_dtype).double().numpy()
    got = round_to(xs.double().numpy(), f)
    np.testing.assert_array_equal(got, want)
    num = ~np.isnan(want)  # the sign of a NaN carries no meaning
    assert np.array_equal(np.signbit(got[num]), np.signbit(want[num]))


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"])
def test_torch_float64_conversion_double_rounds_through_float32(name):
    """The fact in the module docstring: torch converts float64 -> 16/8-bit through float32."""
    f = FORMATS[name]
    x = 1 + f.eps / 2 + 2.0**-40  # just above the tie 1 + eps/2: one rounding gives 1 + eps
    assert round_to(np.array([x]), f)[0] == 1 + f.eps
    assert torch.tensor([x], dtype=torch.float64).to(f.torch_dtype).double().item() == 1.0
    assert torch.tensor([x], dtype=torch.float64).float().to(f.torch_dtype).double().item() == 1.0


# ---------------------------------------------------------------- ulp, distance

@pytest.mark.parametrize("name", NAMES)
def test_ulp_values(name):
    f = FORMATS[name]
    x = np.array([1.0, np.nextafter(1.0, 0), 0.0, f.min_normal, f.min_subnormal, f.max, -2.0, np.inf])
    below = 1 - decode(name, (LAYOUTS[name][2] << LAYOUTS[name][1]) - 1)  # eps/2; eps where 1 is the min normal
    want = [f.eps, float(below), f.min_subnormal, f.min_subnormal * 1.0, f.min_subnormal, None, 2 * f.eps, None]
    got = ulp(x, f)
    assert got[0] == want[0] and got[1] == want[1] and got[2] == want[2]
    assert got[3] == f.min_normal * f.eps and got[4] == f.min_subnormal and got[6] == 2 * f.eps
    assert got[5] == f.max - float(decode(name, max_pattern(name) - 1)) and np.isnan(got[7])


@settings(max_examples=150, deadline=None)
@given(i=st.integers(min_value=-(2**31), max_value=2**31), j=st.integers(min_value=-(2**31), max_value=2**31))
@example(i=0, j=1)
@example(i=-1, j=1)
@example(i=-(2**31), j=2**31)
def test_ulp_distance_matches_ordinals(i, j):
    for name in NAMES:
        top = max_pattern(name)
        ki, kj = i % (top + 1) * (1 if i >= 0 else -1), j % (top + 1) * (1 if j >= 0 else -1)
        a = float(decode(name, abs(ki))) * (-1 if ki < 0 else 1)
        b = float(decode(name, abs(kj))) * (-1 if kj < 0 else 1)
        d = int(ulp_distance(np.array([a]), np.array([b]), name)[0])
        assert d == ordinal_ref(name, Fraction(b)) - ordinal_ref(name, Fraction(a))


def test_ulp_distance_zero_inf_and_errors():
    f = FORMATS["bf16"]
    assert ulp_distance(np.array([-0.0]), np.array([0.0]), f)[0] == 0
    assert ulp_distance(np.array([-f.min_subnormal]), np.array([f.min_subnormal]), f)[0] == 2
    assert ulp_distance(np.array([f.max]), np.array([np.inf]), f)[0] == 1
    assert ulp_distance(np.array([1.0]), np.array([1 - f.spacing_below_one]), f)[0] == -1
    with pytest.raises(ValueError, match="b must hold values representable in bf16"):
        ulp_distance(np.array([1.0]), np.array([1.001]), f)
    with pytest.raises(ValueError, match="a contains NaN"):
        ulp_distance(np.array([np.nan]), np.array([1.0]), f)
