"""An independent rounding oracle: pychop (``pychop.np.lightchop.LightChop_``, round to
nearest even, ``rmode=1``, subnormals on) beside ``dora_num.numerics.formats.round_to``
for bf16, fp16, fp8 e5m2 and fp8 e4m3fn, on > 10^6 float64 values per format: every
scale of the format, every midpoint of the 8/16-bit grids (ties) and the doubles just
beside them, subnormals, the underflow threshold, the overflow region, +-0, +-inf, NaN.

pychop's semantics, read from its source (pychop 0.6.2, ``np/lightchop.py``) and its
documentation (``Chop(exp_bits, sig_bits, rmode=1, subnormal=True)``: an IEEE-754-style
format with ``exp_bits``/``sig_bits``, all-ones exponent reserved), and where it differs
from IEEE 754 and from torch (documented here, asserted, not papered over):

1. pychop has no overflow-to-inf for values that *round* past ``max``: a value in
   ``[max + ulp/2, 2^(emax+1))`` becomes the finite ``2^(emax+1)``; IEEE 754 (and
   round_to, torch, ml_dtypes) give ``inf``.
2. A value in the all-ones-exponent binade ``[2^(emax+1), 2^(emax+2))`` becomes ``0``
   (neither its normal nor its overflow mask covers it); beyond it, ``inf``.
3. In the subnormal range pychop forms ``x / 2^emin - 1`` in float64, which is inexact
   for ``|x| < 2^(emin-1)``: a value within a few float64 ulps of a subnormal tie is
   rounded as the tie itself (a double rounding); round_to rounds the exact value.
4. There is no OCP e4m3fn in pychop's IEEE-style chop: ``(4, 3)`` is IEEE e4m3 (max 240,
   with inf).  e4m3fn equals IEEE e4m3 below 2^-6 (same subnormal grid) and has the same
   4-bit significand as ``(5, 3)`` on its normal range, so the oracle for e4m3fn is
   ``(4, 3)`` below 2^-6 and ``(5, 3)`` from 2^-6 to 464; beyond 464 e4m3fn saturates
   to 448 in torch (round_to follows torch, formats.py), which no pychop format models.

Everywhere else the two agree bit for bit (asserted).
"""

from __future__ import annotations

import numpy as np
import pytest

from dora_num.numerics.formats import FORMATS, round_to

from ._exact_ref import decode, max_pattern

pychop_np = pytest.importorskip("pychop.np.lightchop", reason="pychop (test extra) not installed")

LAYOUT = {"bf16": (8, 7), "fp16": (5, 10), "fp8_e5m2": (5, 2), "fp8_e4m3fn": (4, 3)}


def _chop(e, m):
    return pychop_np.LightChop_(e, m, rmode=1, subnormal=True, chunk_size=2**62).quantize


def _values(name, seed=0):
    f = FORMATS[name]
    rng = np.random.default_rng([seed, len(name)])
    n = 900_000
    parts = [rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(f.emin - f.p - 3, f.emax + 2.5, n)) * rng.uniform(1, 2, n)]
    top = min(max_pattern(name), 2**16 - 1)
    v = np.array([float(decode(name, k)) for k in range(0, top + 1)], dtype=np.float64) if f.bits == 8 else None
    if f.bits == 16:  # decode the 16-bit grids through numpy views (exact), cross-checked on a sample
        bits = np.arange(0, max_pattern(name) + 1, dtype=np.uint16)
        v = bits.view(f.np_dtype).astype(np.float64)
        assert all(v[k] == float(decode(name, int(k))) for k in rng.integers(0, v.size, 200))
    nxt = np.append(v[1:], v[-1] + (v[-1] - v[-2]))
    mid = (v + nxt) / 2  # every tie, exact in float64
    parts += [v, mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), -mid, -v]
    parts.append(rng.uniform(0, 4, 100_000) * f.min_subnormal)  # subnormal range and the underflow threshold
    parts.append(f.max * rng.uniform(0.99, 1.2, 20_000))  # around the overflow threshold
    parts.append(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, f.min_subnormal / 2, -f.min_subnormal / 2,
                           f.min_subnormal / 2 * (1 + 2.0**-40), f.max, -f.max, 464.0, 464.0001, 480.0]))
    return np.concatenate(parts), 2 * mid.size


def _same(a, b):
    return (a == b) | (np.isnan(a) & np.isnan(b))


@pytest.mark.parametrize("name", list(LAYOUT))
def test_pychop_agrees_with_round_to_except_the_documented_classes(name, record):
    f = FORMATS[name]
    x, n_ties = _values(name)
    assert x.size >= 1_000_000
    ours = round_to(x, f)
    with np.errstate(all="ignore"):
        if name == "fp8_e4m3fn":
            lo, hi = _chop(4, 3)(x), _chop(5, 3)(x)
            theirs = np.where(np.abs(x) < 2.0**-6, lo, hi)
        else:
            theirs = _chop(*LAYOUT[name])(x)
    ax = np.abs(x)
    top = 2.0 ** (f.emax + 1)  # the first power of two past the format's range
    if name == "fp8_e4m3fn":
        documented = ~np.isnan(x) & (ax > 464)  # saturation, no pychop counterpart (class 4)
        assert (np.abs(ours[documented]) == f.max).all()
    else:
        half_top = (f.max - float(decode(name, max_pattern(name) - 1))) / 2
        over_round = np.isfinite(x) & (ax >= f.max + half_top) & (ax < top)  # class 1
        all_ones = np.isfinite(x) & (ax >= top) & (ax < 2 * top)  # class 2
        documented = over_round | all_ones
        assert np.isinf(ours[over_round | all_ones]).all()
        assert (np.abs(theirs[over_round]) == top).all()  # class 1: a finite 2^(emax+1) instead of inf
        assert (theirs[all_ones] == 0).all()  # class 2: zero
    # class 3: subnormal values a hair beside a tie round as the tie in pychop
    q = f.min_subnormal
    t = np.where(ax < f.min_normal / 2, ax / q, 0.0)  # exact (division by a power of two)
    frac = t - np.floor(t)
    near_tie = (ax < f.min_normal / 2) & (frac != 0.5) & (np.abs(frac - 0.5) < 2.0**-40)
    tie = np.copysign((np.floor(t) + 0.5) * q, x)
    as_tie = near_tie & ~_same(ours, theirs)
    assert _same(theirs[as_tie], round_to(tie[as_tie], f)).all()  # where they differ, pychop rounded the tie
    documented = documented | as_tie
    agree = _same(ours, theirs)
    bad = ~agree & ~documented
    assert not bad.any(), (name, x[bad][:5], ours[bad][:5], theirs[bad][:5])
    zeros = ours == 0
    assert (np.signbit(ours[zeros & ~documented]) == np.signbit(x[zeros & ~documented])).all()
    record("pychop_oracle", case=name, n=int(x.size), n_agree=int(agree.sum()), n_documented=int(documented.sum()),
           n_ties=n_ties, n_rounded_as_tie=int(as_tie.sum()))
