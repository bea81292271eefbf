"""Formats as data: each format's width, numpy/ml_dtypes type and torch dtype are derived from its
bit layout; bit patterns (to_bits / from_bits) and ULP distances hold for every width, the OCP MX
sub-byte formats (fp6 e3m2 / e2m3, fp4 e2m1) included, over all of their codes and pairs of codes.
Every value is checked against the independent Fraction decoder (tests/numerics/_exact_ref.py) or
against the values the OCP MX specification lists, never against the code under test."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from dora_num.numerics import formats as fm
from dora_num.numerics.formats import (FORMATS, NARROW_FORMATS, STUDIED_FORMATS, from_bits, get_format, round_to,
                                       to_bits, ulp_distance)

from . import _exact_ref as ref

NAMES = list(FORMATS)
SMALL = [n for n in NAMES if FORMATS[n].bits <= 16]  # every code enumerable
SUB_BYTE = ["fp6_e3m2", "fp6_e2m3", "fp4_e2m1"]


def _ref_value(name: str, code: int) -> float:
    """Value of a full bit pattern (sign included) from the independent decoder; NaN for a NaN code,
    inf for the inf code."""
    eb, mb, _, kind = ref.LAYOUTS[name]
    width = 1 + eb + mb
    sign, mag = code >> (width - 1), code & ((1 << (width - 1)) - 1)
    top = ref.max_pattern(name)
    if mag <= top:
        v = float(ref.decode(name, mag))
    elif kind == "ieee" and mag == top + 1:
        v = math.inf
    else:
        return math.nan
    return -v if sign else v


# ---------------------------------------------------------------- the OCP MX formats, from the specification

# OCP Microscaling Formats (MX) v1.0, section 5.3.3: every positive value of each element format
MX_POSITIVE = {
    "fp4_e2m1": [0, 0.5, 1, 1.5, 2, 3, 4, 6],
    "fp6_e2m3": [k / 8 for k in range(8)] + [(8 + m) / 8 * 2.0**e for e in range(3) for m in range(8)],
    "fp6_e3m2": [k / 16 for k in range(4)] + [(4 + m) / 4 * 2.0**e for e in range(-2, 5) for m in range(4)],
}


@pytest.mark.parametrize("name", SUB_BYTE)
def test_mx_formats_hold_the_values_of_the_specification(name):
    f = FORMATS[name]
    want = MX_POSITIVE[name]
    assert len(want) == 2 ** (f.bits - 1) and want == sorted(want)  # no inf, no NaN: every code a number
    assert [float(ref.decode(name, k)) for k in range(ref.max_pattern(name) + 1)] == want
    codes = np.arange(1 << f.bits)
    got = from_bits(codes, f)
    assert got[: len(want)].tolist() == want and (-got[len(want):]).tolist() == want
    assert np.signbit(got[len(want)])  # the pattern 1.00..0 is -0
    assert (f.max, f.min_subnormal, f.min_normal, f.has_inf, f.saturates) == (want[-1], want[1], 2.0**f.emin, False,
                                                                              True)


@pytest.mark.parametrize("name", SUB_BYTE)
def test_mx_formats_round_and_saturate_as_ml_dtypes(name):
    """Rounding to nearest even at every midpoint and beside it, and saturation at max (round_to, as
    torch's e4m3fn and ml_dtypes' fp4/fp6 conversions) against the independent search."""
    f = FORMATS[name]
    v = np.array(MX_POSITIVE[name])
    step = v[-1] - v[-2]
    pts = np.concatenate([v, (v[1:] + v[:-1]) / 2, v[-1] + np.array([step / 2, step, 1e6, np.inf])])
    pts = np.concatenate([pts, np.nextafter(pts, 0), np.nextafter(pts, np.inf)])
    pts = np.concatenate([pts, -pts])
    want = np.array([f.max * np.sign(x) if np.isinf(x) else float(ref.round_ref(name, Fraction(x))) for x in pts])
    got = round_to(pts, f)
    np.testing.assert_array_equal(got, want)
    with np.errstate(over="ignore", invalid="ignore"):
        np.testing.assert_array_equal(pts.astype(f.np_dtype).astype(np.float64), want)  # ml_dtypes 0.7: one rounding
        assert np.array([np.nan]).astype(f.np_dtype).astype(np.float64)[0] == 0  # ml_dtypes 0.7: NaN becomes 0
    assert np.isnan(round_to(np.array([np.nan]), f)[0])  # round_to keeps NaN (to_bits refuses it)


# ---------------------------------------------------------------- derived width, types, bit patterns

@pytest.mark.parametrize("name", NAMES)
def test_width_and_types_are_derived_from_the_layout(name):
    f = FORMATS[name]
    eb, mb, bias, kind = ref.LAYOUTS[name]
    assert (f.bits, f.ebits, f.p, f.emin, f.specials) == (1 + eb + mb, eb, mb + 1, 1 - bias, kind)
    assert f.max_code == ref.max_pattern(name)
    assert f.uint_dtype.itemsize * 8 >= f.bits and (f.uint_dtype.itemsize == 1 or f.uint_dtype.itemsize * 4 < f.bits)
    if f.np_dtype is not None:  # which formats have one: the next test (a format without one: the toy below)
        fi = ml_dtypes.finfo(f.np_dtype)
        assert (fi.bits, fi.nmant, fi.minexp, float(fi.max)) == (f.bits, mb, f.emin, f.max)
        assert get_format(f.np_dtype) is f
    if f.torch_dtype is not None:
        assert torch.empty(0, dtype=f.torch_dtype).element_size() * 8 == f.bits
    assert get_format(name) is f and repr(f) == f"Format({name})"


# Each format's numpy/ml_dtypes type and torch dtype (None: there is none), written out: the derivation
# (formats._matching_dtype) is held to what a reader expects.  torch 2.13 has fp4 only packed two to a byte
# (``float4_e2m1fn_x2``) and no fp6: None for those.
TYPES = {"bf16": (ml_dtypes.bfloat16, torch.bfloat16), "fp16": (np.float16, torch.float16),
         "fp32": (np.float32, torch.float32), "fp8_e4m3fn": (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn),
         "fp8_e5m2": (ml_dtypes.float8_e5m2, torch.float8_e5m2), "fp6_e3m2": (ml_dtypes.float6_e3m2fn, None),
         "fp6_e2m3": (ml_dtypes.float6_e2m3fn, None), "fp4_e2m1": (ml_dtypes.float4_e2m1fn, None)}


def test_torch_and_numpy_types_are_the_expected_ones():
    assert {n: (f.np_dtype, f.torch_dtype) for n, f in FORMATS.items()} == TYPES
    assert (fm.FP64.np_dtype, fm.FP64.torch_dtype, fm.FP64.max) == (np.float64, torch.float64, np.finfo(np.float64).max)
    for alias, name in (("e2m1", "fp4_e2m1"), ("float6_e3m2fn", "fp6_e3m2"), ("e2m3", "fp6_e2m3")):
        assert get_format(alias) is FORMATS[name]


@pytest.mark.parametrize("name", SMALL)
def test_from_bits_decodes_every_pattern_as_the_independent_decoder_and_ml_dtypes(name):
    f = FORMATS[name]
    codes = np.arange(1 << f.bits)
    got = from_bits(codes, f)
    step = 1 if f.bits <= 8 else 97  # the 16-bit grids: every 97th pattern (all of them through the view below)
    want = np.array([_ref_value(name, int(k)) for k in codes[::step]])
    np.testing.assert_array_equal(got[::step], want)
    num = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[::step][num]), np.signbit(want[num]))
    if f.np_dtype is not None:  # a format without a numpy type: the independent decoder alone
        with np.errstate(invalid="ignore"):
            view = codes.astype(f.uint_dtype).view(f.np_dtype).astype(np.float64)
        np.testing.assert_array_equal(got, view)  # NaN where ml_dtypes/numpy have NaN, nowhere else


@pytest.mark.parametrize("name", SMALL)
def test_to_bits_inverts_from_bits(name):
    f = FORMATS[name]
    codes = np.arange(1 << f.bits)
    v = from_bits(codes, f)
    num = ~np.isnan(v)
    np.testing.assert_array_equal(to_bits(v[num], f), codes[num].astype(f.uint_dtype))
    assert to_bits(v[num], f).dtype == f.uint_dtype
    if f.specials != "none":  # one NaN pattern (the canonical quiet one) decodes to NaN
        assert np.isnan(from_bits(to_bits(np.array([np.nan]), f), f)).all()
    else:
        with pytest.raises(ValueError, match="has no NaN"):
            to_bits(np.array([np.nan]), f)
    with pytest.raises(ValueError, match="representable"):
        to_bits(np.array([f.min_subnormal / 2]), f)
    with pytest.raises(ValueError, match="bit patterns"):
        from_bits(np.array([1 << f.bits]), f)


def test_fp32_bits_against_numpy_views():
    f = FORMATS["fp32"]
    rng = np.random.default_rng(0)
    edges = np.array([0, 1, 0x7F7FFFFF, 0x7F800000, 0x80000000, 0xFF800000], dtype=np.uint64)
    codes = np.concatenate([rng.integers(0, 1 << 32, 200_000, dtype=np.uint64), edges])
    with np.errstate(invalid="ignore"):
        view = codes.astype(np.uint32).view(np.float32).astype(np.float64)
    got = from_bits(codes, f)
    np.testing.assert_array_equal(got, view)
    num = ~np.isnan(view)
    np.testing.assert_array_equal(to_bits(view[num], f), codes[num].astype(np.uint32))
    for k in (1, 0x00800000, 0x3F800000, 0x7F7FFFFF):  # a sample through the independent decoder too
        assert from_bits(np.array([k]), f)[0] == float(ref.decode("fp32", k))
    assert got[-3:].tolist() == [math.inf, -0.0, -math.inf] and np.signbit(got[-2])


def test_fp64_bits_against_numpy_views():
    rng = np.random.default_rng(1)
    codes = np.concatenate([rng.integers(0, 1 << 63, 100_000, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                            np.array([0, 1, 0x7FF0000000000000, 0xFFF0000000000000, 1 << 63], dtype=np.uint64)])
    view = codes.view(np.float64)
    got = from_bits(codes, fm.FP64)
    np.testing.assert_array_equal(got, view)
    num = ~np.isnan(view)
    np.testing.assert_array_equal(to_bits(view[num], fm.FP64), codes[num])


# ---------------------------------------------------------------- ULP distance over whole grids

@pytest.mark.parametrize("name", [n for n in NAMES if FORMATS[n].bits <= 8])
def test_ulp_distance_every_pair_of_an_8_bit_or_narrower_format(name):
    """All pairs of representable values (both signs, +-0, +-inf where the format has it): the
    distance is the difference of the independent ordinals (inf: one past max)."""
    f = FORMATS[name]
    top = ref.max_pattern(name)
    mags = [ref.decode(name, k) for k in range(top + 1)]
    vals = [float(m) for m in mags] + [-float(m) for m in mags]
    ords = [k for k in range(top + 1)] + [-k for k in range(top + 1)]
    if f.has_inf:
        vals += [math.inf, -math.inf]
        ords += [top + 1, -(top + 1)]
    a, b = np.meshgrid(np.array(vals), np.array(vals), indexing="ij")
    oa, ob = np.meshgrid(np.array(ords), np.array(ords), indexing="ij")
    np.testing.assert_array_equal(ulp_distance(a, b, f), ob - oa)


@pytest.mark.parametrize("name", SUB_BYTE)
def test_ulp_distance_rejects_what_the_sub_byte_formats_cannot_hold(name):
    f = FORMATS[name]
    with pytest.raises(ValueError, match=f"representable in {name}"):
        ulp_distance(np.array([0.0]), np.array([np.inf]), f)  # no inf: max is the last value
    with pytest.raises(ValueError, match=f"representable in {name}"):
        ulp_distance(np.array([0.0]), np.array([f.max + f.max / 8]), f)
    assert ulp_distance(np.array([-f.max]), np.array([f.max]), f)[0] == 2 * f.max_code


def test_a_format_without_a_numpy_type_works_from_its_layout(monkeypatch):
    """A toy e2m2 format (no ml_dtypes type, no torch dtype): rounding, bits and distances from the
    layout alone, against the independent decoder given the same layout."""
    toy = fm.make_format("toy_e2m2", 2, 2, specials="none")
    assert (toy.np_dtype, toy.torch_dtype, toy.bits, toy.uint_dtype, toy.max) == (None, None, 5, np.dtype("uint8"), 7.0)
    assert toy.seed == fm.name_seed("toy_e2m2")
    monkeypatch.setitem(ref.LAYOUTS, "toy_e2m2", (2, 2, 1, "none"))
    codes = np.arange(32)
    v = from_bits(codes, toy)
    np.testing.assert_array_equal(v, [_ref_value("toy_e2m2", int(k)) for k in codes])
    np.testing.assert_array_equal(to_bits(v, toy), codes)
    x = np.linspace(-9, 9, 1441)  # steps of 1/80: every tie of the grid, beside them, and overflow
    np.testing.assert_array_equal(round_to(x, toy), [float(ref.round_ref("toy_e2m2", Fraction(t))) for t in x])
    assert ulp_distance(np.array([-7.0]), np.array([7.0]), toy)[0] == 30


# ---------------------------------------------------------------- the studied formats

def test_the_studied_formats_are_one_tuple():
    assert STUDIED_FORMATS == ("bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2")
    assert NARROW_FORMATS == ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2")
    assert set(STUDIED_FORMATS) <= set(FORMATS) and not set(SUB_BYTE) & set(STUDIED_FORMATS)


def test_seeds_are_recorded_for_the_studied_formats_and_derived_from_the_name_for_new_ones():
    """The five studied formats draw with the seeds every recorded data set used (their positions in
    FORMATS when recorded); every other format's seed is a hash of its name; all distinct."""
    assert {n: FORMATS[n].seed for n in STUDIED_FORMATS} == {"bf16": 0, "fp16": 1, "fp32": 2, "fp8_e4m3fn": 3,
                                                           "fp8_e5m2": 4}
    for n in SUB_BYTE:
        assert FORMATS[n].seed == fm.name_seed(n) >= 2**32
    assert fm.name_seed("fp4_e2m1") == int.from_bytes(__import__("hashlib").sha256(b"fp4_e2m1").digest()[:8], "big")
    assert len({f.seed for f in FORMATS.values()}) == len(FORMATS)
