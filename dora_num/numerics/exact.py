"""Exact and certified arithmetics: mpmath at a chosen precision, and a double-double arithmetic
that carries a rigorous error bound; both evaluate the formulas of :mod:`dora_num.numerics.formulas`.

``MPArith(prec)``: every operation in mpmath at ``prec`` bits, exact for sums and products once
``prec`` covers the inputs' exponent span (:func:`exact_bits`: a proof, not a check).  ``DDArith``:
:class:`DD` triples ``(hi, lo, err)`` with ``|hi + lo - x| <= err`` (TwoSum / TwoProduct, the
dropped low-order parts bounded, ``err`` inflated by ``1 + 2^-40``).  :func:`certified_round`
flags the elements within ``err`` of a rounding boundary; the ground truth sends those to mpmath.
How ``add``, ``mul``, ``sqrt`` keep their bounds: docs/bounds.md, "Exact and certified arithmetics".
"""

from __future__ import annotations

from dataclasses import dataclass

import mpmath
import numpy as np

from .arithmetic import Arithmetic
from .formats import get_format, quantum, round_dd, two_prod, two_sum

_INFLATE = 1.0 + 2.0**-40


# ----------------------------------------------------------------- mpmath

def exponent_range(*arrays) -> tuple[int, int]:
    """``(E, L)`` over the finite nonzero float64 values of ``arrays`` and the constant 1:
    ``E = max floor(log2 |x|)`` (the top bit), ``L = min`` position of the lowest set
    bit (``x = M 2^L`` with ``M`` odd).  So ``2^L <= |x| < 2^(E+1)`` and every ``x`` is
    a multiple of ``2^L``; with 1 included, ``E >= 0 >= L``."""
    E, L = 0, 0
    for a in arrays:
        a = np.abs(np.asarray(a, dtype=np.float64)).ravel()
        a = a[np.isfinite(a) & (a > 0)]
        if a.size == 0:
            continue
        m, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1): top bit e - 1
        M = np.ldexp(m, 53).astype(np.int64)  # exact 53-bit integer significand
        low = M & -M  # its lowest set bit, a power of two
        tz = np.frexp(low.astype(np.float64))[1] - 1
        E = max(E, int(e.max()) - 1)
        L = min(L, int((e - 53 + tz).min()))
    return E, L


def exact_bits(*arrays, degree: int, n_terms: int) -> int:
    r"""A precision (bits) in which mpmath evaluates exactly every value that is a sum of at
    most ``n_terms`` products of at most ``degree`` factors taken from ``arrays`` (and 1).

    With ``(E, L)`` = :func:`exponent_range`, a product of ``j <= degree`` factors is a
    multiple of ``2^(jL) >= 2^(degree L)`` (``L <= 0``) below ``2^(j(E+1)) <= 2^(degree (E+1))``,
    so any sum of ``n`` of them is a multiple of ``2^(degree L)`` below
    ``n 2^(degree(E+1))``: an integer multiple of its lowest bit with at most
    ``degree (E + 1 - L) + ceil(log2 n)`` bits.  Every intermediate of a polynomial
    formula evaluated term by term is such a sum, so at this precision no operation
    rounds (the certificate is this count, not an agreement of two precisions).

    The ``sqrt`` and ``div`` that end a formula are then correctly rounded to ``p``
    bits; rounding that once more to float64 or a narrower format equals rounding
    the exact value once if ``p >= max(span + 4, 112)`` (docs/bounds.md, lemma 8): a
    54-bit midpoint ``m`` of float64 and the exact ``sqrt(Q)`` (``Q`` a multiple of
    ``2^(degree L)``) differ, unless equal, by at least
    ``2^(min(degree L, 2e - 106)) / (2 sqrt(Q))`` with ``e = floor(log2 sqrt Q)``, which is
    more than ``2^-p sqrt(Q)`` at that ``p``; for ``a / b`` of two floats the gap is
    ``>= 2^-108 a/b``.  The value returned includes that margin.
    """
    if degree < 1 or n_terms < 1:
        raise ValueError(f"degree and n_terms must be positive, got {degree}, {n_terms}")
    E, L = exponent_range(*arrays)
    span = degree * (E + 1 - L) + int(n_terms - 1).bit_length() + 1
    return max(span + 4, 112) + 8


_mp_sqrt = np.frompyfunc(mpmath.sqrt, 1, 1)
_mp_max = np.frompyfunc(lambda a, b: a if a >= b else b, 2, 1)
_mp_zero_to = np.frompyfunc(lambda a, b: b if a == 0 else a, 2, 1)
_mp_from_float = np.frompyfunc(lambda v: mpmath.mpf(float(v)), 1, 1)
_mp_to_float = np.frompyfunc(float, 1, 1)


def to_mp(x) -> np.ndarray:
    """float64 array -> object array of ``mpf`` (exact conversion)."""
    return _mp_from_float(np.asarray(x, dtype=np.float64)).astype(object)


def mp_to_float(x) -> np.ndarray:
    """Object array of ``mpf`` -> float64 (round-to-nearest)."""
    return np.asarray(_mp_to_float(np.asarray(x, dtype=object)), dtype=np.float64)


class MPArith(Arithmetic):
    """mpmath at ``prec`` bits, one (tiny) rounding per operation."""

    def __init__(self, prec: int):
        if not isinstance(prec, int) or prec < 53:
            raise ValueError(f"prec must be an int >= 53 bits, got {prec!r}")
        self.prec = prec
        self.name = f"mpmath-{prec}"

    def __repr__(self) -> str:
        return f"MPArith({self.prec})"

    def _w(self, fn, *args):
        with mpmath.workprec(self.prec):
            return fn(*args)

    def const(self, x: float):
        return mpmath.mpf(float(x))

    def add(self, a, b):
        return self._w(lambda: a + b)

    def sub(self, a, b):
        return self._w(lambda: a - b)

    def mul(self, a, b):
        return self._w(lambda: a * b)

    def div(self, a, b):
        return self._w(lambda: a / b)

    def neg(self, a):
        return -a if isinstance(a, np.ndarray) else self._w(lambda: -a)

    def muladd(self, a, b, c):
        return self._w(lambda: a * b + c)

    def maximum(self, a, b):
        b = mpmath.mpf(b) if isinstance(b, (int, float)) else b
        return self._w(lambda: _mp_max(a, b))

    def zero_to(self, a, b):
        b = mpmath.mpf(b) if isinstance(b, (int, float)) else b
        return _mp_zero_to(a, b)

    def sqrt(self, a):
        return self._w(lambda: _mp_sqrt(a))


# ----------------------------------------------------------------- double-double

@dataclass
class DD:
    hi: np.ndarray
    lo: np.ndarray
    err: np.ndarray

    @classmethod
    def of(cls, x) -> "DD":
        x = np.asarray(x, dtype=np.float64)
        z = np.zeros_like(x)
        return cls(x, z, z)

    def __neg__(self) -> "DD":
        return DD(-self.hi, -self.lo, self.err)


def _dd(x) -> DD:
    return x if isinstance(x, DD) else DD.of(x)


class DDArith(Arithmetic):
    """Certified double-double: exact sums/products up to a tracked error bound."""

    name = "double-double"

    @staticmethod
    def const(x: float) -> DD:
        return DD.of(float(x))

    @staticmethod
    def neg(a) -> DD:
        return -_dd(a)

    @staticmethod
    def add(a, b) -> DD:
        a, b = _dd(a), _dd(b)
        s, e = two_sum(a.hi, b.hi)
        t1, r1 = two_sum(e, a.lo)
        t, r2 = two_sum(t1, b.lo)
        hi, lo = two_sum(s, t)
        err = (a.err + b.err + np.abs(r1) + np.abs(r2)) * _INFLATE
        return DD(hi, lo, err)

    @staticmethod
    def sub(a, b) -> DD:
        return DDArith.add(a, -_dd(b))

    @staticmethod
    def mul(a, b) -> DD:
        a, b = _dd(a), _dd(b)
        p, e = two_prod(a.hi, b.hi)
        x1, x2, x3 = a.hi * b.lo, a.lo * b.hi, a.lo * b.lo
        t = e + ((x1 + x2) + x3)
        hi, lo = two_sum(p, t)
        mag_a = np.abs(a.hi) + np.abs(a.lo) + a.err
        mag_b = np.abs(b.hi) + np.abs(b.lo) + b.err
        rounded = (x1 != 0) | (x2 != 0) | (x3 != 0)  # else t = e exactly
        err = (mag_a * b.err + mag_b * a.err + a.err * b.err
               + np.where(rounded, 2.0**-50 * (np.abs(e) + np.abs(x1) + np.abs(x2) + np.abs(x3)), 0.0)) * _INFLATE
        return DD(hi, lo, err)

    @staticmethod
    def muladd(a, b, c) -> DD:
        return DDArith.add(DDArith.mul(a, b), c)

    @staticmethod
    def maximum(a, b) -> DD:
        """``max(a, b)``; where the order is undecided within the error bounds the
        result gets ``err = inf`` (so it is flagged and recomputed with mpmath)."""
        a, b = _dd(a), _dd(b)
        d = DDArith.sub(a, b)
        a_big = d.hi - d.err > 0
        b_big = d.hi + d.err < 0
        unsure = ~(a_big | b_big)
        pick = lambda x, y: np.where(a_big, x, y)  # noqa: E731
        err = np.where(unsure, np.inf, pick(a.err, b.err))
        return DD(pick(a.hi, b.hi), pick(a.lo, b.lo), err)

    @staticmethod
    def zero_to(a, b) -> DD:
        """``b`` where ``a`` is exactly 0 (``hi = lo = err = 0``), else ``a``; where ``a`` may be 0
        within its error bound the result gets ``err = inf`` (undecided: flagged, recomputed with mpmath)."""
        a, b = _dd(a), _dd(b)
        zero = (a.hi == 0) & (a.lo == 0) & (a.err == 0)
        unsure = ~zero & (np.abs(a.hi) <= a.err)
        pick = lambda x, y: np.where(zero, y, x)  # noqa: E731
        return DD(pick(a.hi, b.hi), pick(a.lo, b.lo), np.where(unsure, np.inf, pick(a.err, b.err)))

    @staticmethod
    def sqrt(a) -> DD:
        """One Newton step from the correctly rounded float64 sqrt.

        ``r = sqrt(hi)``; ``c = (hi - r^2 + lo) / (2r)`` with ``r^2`` exact by
        TwoProduct; result ``r + c``.  Truncation error of the Newton step
        ``(sqrt(x) - r)^2 / (2r) <= c'^2 / r`` (``|sqrt(x) - r| <= 1.01 |c|``
        as ``|c| << r``), evaluation error of ``c`` ``<= 2^-49 |c| + 2^-52 (|hi - r^2| + |lo|)/(2r)``,
        input error ``err / (sqrt(hi - err) + sqrt(hi))``.  ``a <= 0`` within its
        error: ``err = inf`` (undecided; flagged), exact 0 gives 0.
        """
        a = _dd(a)
        hi, lo, err = np.broadcast_arrays(a.hi, a.lo, a.err)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.sqrt(np.maximum(hi, 0.0))
            p, e = two_prod(r, r)
            d1 = (hi - p) - e  # hi - p exact (Sterbenz: p within a few ulps of hi)
            num = d1 + lo
            c = np.where(r > 0, num / (2 * r), 0.0)
            h, l = two_sum(r, c)
            lo_in = np.sqrt(np.maximum(hi - err, 0.0))
            e_in = np.where(lo_in + r > 0, err / (lo_in + r), np.inf)
            e_tr = np.where(r > 0, (1.03 * c) ** 2 / r + 2.0**-49 * np.abs(c)
                            + 2.0**-52 * (np.abs(d1) + np.abs(lo)) / (2 * r), 0.0)
            out_err = (e_in + e_tr) * _INFLATE
        zero = (hi == 0) & (lo == 0) & (err == 0)
        bad = ~zero & (hi - err <= 0)
        out_err = np.where(zero, 0.0, np.where(bad, np.inf, out_err))
        return DD(np.where(zero, 0.0, h), np.where(zero, 0.0, l), out_err)

    @staticmethod
    def div(a, b):
        raise NotImplementedError("DDArith has no certified division; evaluate g with MPArith")


def certified_round(x: DD, fmt) -> tuple[np.ndarray, np.ndarray]:
    """``(rounded, uncertain)``: ``RN_fmt(hi + lo)`` and a mask of elements where a
    rounding boundary (a midpoint of ``fmt``, including the overflow threshold)
    lies within ``err`` of ``hi + lo``, so the exact value might round differently.

    The distance to the two midpoints around ``hi`` in ``hi``'s binade is
    computed as ``(hi - m) + lo`` (error ``<= 2^-52 (|hi - m| + |lo|)``, added to
    the margin); the nearest midpoint of a neighbouring binade is at least
    ``quantum/4`` away, far beyond any ``err`` that can occur here (checked:
    such elements are flagged too).  ``err == 0`` elements are exact and certain.
    """
    fmt = get_format(fmt)
    hi, lo, err = (np.asarray(v, dtype=np.float64) for v in (x.hi, x.lo, x.err))
    hi, lo, err = np.broadcast_arrays(hi, lo, err)
    finite = np.isfinite(hi) & np.isfinite(lo) & np.isfinite(err)
    hi_s = np.where(finite, hi, 0.0)
    lo_s = np.where(finite, lo, 0.0)
    r = round_dd(hi_s, lo_s, fmt)
    q = quantum(hi_s, fmt)
    k = np.floor(hi_s / q)
    d = np.full(hi.shape, np.inf)
    for off in (-0.5, 0.5, 1.5):
        m = (k + off) * q
        dm = hi_s - m
        d = np.minimum(d, np.abs(dm + lo_s) - 2.0**-52 * (np.abs(dm) + np.abs(lo_s)))
    uncertain = ~finite | ((err > 0) & ((d <= err) | (err >= q / 8)))
    return np.where(finite, r, np.nan), uncertain
