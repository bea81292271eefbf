"""Certified ground truth for the compose, the norms, the assembly and ``g``.

Two routes over the formulas of :mod:`dora_num.numerics.formulas`: ``mp_*`` evaluates in mpmath at
``exact_bits(inputs, degree, n_terms)`` bits, enough for every sum and product to be exact (the
ending ``sqrt`` or ``div`` correctly rounded: lemma 8 of docs/bounds.md, a proof rather than the
agreement of two precisions); :func:`compose_exact` and :func:`assembly_exact` evaluate in
certified double-double and send every element whose rounding the error bound cannot decide to
the mpmath route (2,000,000 realistic bf16 elements: none).  Every value returned is the exact
result for the given float inputs rounded once: ``value`` to float64, ``rounded`` to the format.
Inputs must be finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import mpmath
import numpy as np

from . import formulas as F
from .exact import DDArith, MPArith, certified_round, exact_bits, to_mp
from .formats import FP64, get_format, round_fraction, round_to, to_float64


class GroundTruthError(RuntimeError):
    """Ground truth could not be certified (kept for callers; the routes here never raise it
    on finite inputs)."""


@dataclass
class Truth:
    value: np.ndarray  # exact result rounded once to float64
    rounded: np.ndarray  # exact result rounded once to the format (float64 storage)
    n_fallback: int = 0  # elements recomputed with mpmath
    prec: int = 0  # mpmath working precision used (route 1; 0: none needed)


def _f64(x, name):
    a = to_float64(x)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains non-finite values; ground truth needs finite inputs")
    return a


_round_frac = np.frompyfunc(round_fraction, 2, 1)


def _rounded(results, fmt, prec: int) -> Truth:
    """Round exact (or correctly rounded at ``prec``, see :func:`exact_bits`) mpmath values once."""
    fmt = get_format(fmt)
    res = np.asarray(results, dtype=object)
    value = np.asarray(_round_frac(res, FP64), dtype=np.float64)
    rounded = np.asarray(_round_frac(res, fmt), dtype=np.float64)
    return Truth(value=value, rounded=rounded, prec=prec)


def _mp_eval(formula, args_f64: list, scalars: list, fmt, *, degree: int, n_terms: int) -> Truth:
    prec = exact_bits(*args_f64, np.asarray(scalars, dtype=np.float64), degree=degree, n_terms=n_terms)
    mp_args = [to_mp(a) for a in args_f64]
    with mpmath.workprec(prec):
        res = formula(MPArith(prec), *mp_args, *scalars)
    return _rounded(res, fmt, prec)


# ----------------------------------------------------------------- compose

def mp_compose(base, lora, g, s: float, fmt="fp32", *, formula: str = "compose_stable") -> Truth:
    """Exact compose ``delta = (g-1) base + g s lora`` via mpmath (exact: degree 3, <= 4 terms)."""
    if formula not in ("compose_stable", "compose_naive"):
        raise ValueError(f"formula must be compose_stable or compose_naive, got {formula!r}")
    base, lora, g = _f64(base, "base"), _f64(lora, "lora"), _f64(g, "g")
    base, lora, g = np.broadcast_arrays(base, lora, g)
    s = F.scale_constants(s)[0]
    return _mp_eval(lambda ar, b, l, gg, ss: getattr(F, formula)(ar, b, l, gg, ar.const(ss)),
                    [base, lora, g], [s], fmt, degree=3, n_terms=4)


def compose_exact(base, lora, g, s: float, fmt="fp32") -> Truth:
    """Correctly rounded exact compose, vectorised (double-double + mpmath fallback).

    ``base``, ``lora``, ``g`` broadcast (fp32-representable values: checked, as
    the error analysis of the double-double path assumes <= 24-bit inputs);
    ``s`` is rounded to fp32 like everywhere else.  Both compose forms have the
    same exact value; the stable one is evaluated.
    """
    fmt = get_format(fmt)
    base, lora, g = _f64(base, "base"), _f64(lora, "lora"), _f64(g, "g")
    base, lora, g = np.broadcast_arrays(base, lora, g)
    for name, a in (("base", base), ("lora", lora), ("g", g)):
        if not np.array_equal(round_to(a, "fp32"), a):
            raise ValueError(f"{name} must hold fp32-representable values (round it with round_to(x, 'fp32'))")
    s = F.scale_constants(s)[0]
    dd = F.compose_stable(DDArith, base, lora, g, s)
    return _dd_with_fallback(dd, fmt, lambda idx: mp_compose(base.ravel()[idx], lora.ravel()[idx],
                                                             g.ravel()[idx], s, fmt), base.shape)


def _float64_uncertain(hi, lo, err) -> np.ndarray:
    """Where ``RN64(exact)`` may differ from ``hi = RN64(hi + lo)`` (``|exact - hi - lo| <= err``).

    ``(hi, lo)`` is TwoSum-normalised, so ``hi`` is the float64 rounding of ``hi + lo``
    and ``|lo| <= h``, ``h`` half the float64 gap on ``lo``'s side of ``hi`` (half the
    gap below for a power of two with ``lo < 0``).  A float64 midpoint can lie
    between ``hi + lo`` and the exact value only if ``h - |lo| <= err``; ``h - |lo|`` is
    exact (Sterbenz) wherever it is below ``h/2``, far above any ``err`` here.
    """
    up = np.abs(np.nextafter(hi, np.copysign(np.inf, np.where(lo == 0, 1.0, lo))) - hi)
    return (err > 0) & (up / 2 - np.abs(lo) <= err)


def _dd_with_fallback(dd, fmt, mp_fn, shape) -> Truth:
    """Certified rounding of a double-double result; elements whose rounding to ``fmt`` or to
    float64 is undecided go to ``mp_fn(indices)``."""
    rounded, uncertain = certified_round(dd, fmt)
    hi, lo, err = np.broadcast_arrays(dd.hi, dd.lo, dd.err)
    with np.errstate(invalid="ignore"):
        uncertain = uncertain | ~np.isfinite(err) | _float64_uncertain(hi, lo, err)
    value = np.broadcast_to(hi, shape).copy()
    rounded = np.broadcast_to(rounded, shape).copy()
    uncertain = np.broadcast_to(uncertain, shape)
    n = int(uncertain.sum())
    if n:
        idx = np.flatnonzero(uncertain.ravel())
        t = mp_fn(idx)
        rounded.ravel()[idx], value.ravel()[idx] = t.rounded, t.value
    return Truth(value=value, rounded=rounded, n_fallback=n)


def assembly_exact(base_sq, cross, ba, s: float, fmt="fp32") -> Truth:
    """Correctly rounded exact norm assembly, vectorised (double-double + mpmath fallback).

    Terms must be fp32-representable (the ``2s*cross`` and ``s^2*ba`` products are
    then exact in float64)."""
    fmt = get_format(fmt)
    b, c, a = (_f64(x, n) for x, n in ((base_sq, "base_sq"), (cross, "cross"), (ba, "ba")))
    b, c, a = np.broadcast_arrays(b, c, a)
    for name, x in (("base_sq", b), ("cross", c), ("ba", a)):
        if not np.array_equal(round_to(x, "fp32"), x):
            raise ValueError(f"{name} must hold fp32-representable values")
    _, two_s, s_sq = F.scale_constants(s)
    dd = F.norm_assembly(DDArith, b, c, a, two_s, s_sq)
    return _dd_with_fallback(dd, fmt, lambda idx: mp_norm_assembly(b.ravel()[idx], c.ravel()[idx], a.ravel()[idx],
                                                                   s, fmt), b.shape)


# ----------------------------------------------------------------- norms, assembly, g

def _rowwise(fn, arrays, fmt, *, degree: int, n_terms: int) -> Truth:
    """``fn`` (of mpf object arrays) evaluated at a precision that makes it exact, rounded once."""
    prec = exact_bits(*arrays, degree=degree, n_terms=n_terms)
    with mpmath.workprec(prec):
        res = fn(*(to_mp(a) for a in arrays))
    return _rounded(res, fmt, prec)


def mp_factored_terms(W, A, B) -> dict[str, Truth]:
    """Exact ``base = rowsum(W*W)``, ``cross = rowsum(B * (W A^T))``,
    ``ba = rowsum((B A A^T) * B)`` (each rounded once to float64 and fp32)."""
    W, A, B = _f64(W, "W"), _f64(A, "A"), _f64(B, "B")
    d, r = W.shape[1], A.shape[0]
    return {
        "base": _rowwise(lambda W: (W * W).sum(axis=1), [W], "fp32", degree=2, n_terms=d),
        "cross": _rowwise(lambda W, A, B: (B * (W @ A.T)).sum(axis=1), [W, A, B], "fp32", degree=3, n_terms=d * r),
        "ba": _rowwise(lambda W, A, B: ((B @ (A @ A.T)) * B).sum(axis=1), [W, A, B], "fp32", degree=4,
                       n_terms=d * r * r),
    }


def mp_dense_row_norm(W, A, B, s: float) -> Truth:
    """Exact ``||W + s B A||_row`` (rounded once to float64 and fp32), ``s`` rounded to fp32.

    ``x = W + s (BA)`` is exact (degree 3), ``sum x^2`` exact (degree 6, ``d (1 + r)^2``
    terms), the square root correctly rounded at a precision where the final
    rounding is the exact one (:func:`~dora_num.numerics.exact.exact_bits`)."""
    W, A, B = _f64(W, "W"), _f64(A, "A"), _f64(B, "B")
    s = F.scale_constants(s)[0]
    d, r = W.shape[1], A.shape[0]

    def fn(W, A, B, ss):
        ar = MPArith(mpmath.mp.prec)
        dense = W + ss[0] * (B @ A)
        return ar.sqrt((dense * dense).sum(axis=1))

    return _rowwise(fn, [W, A, B, np.array([s])], "fp32", degree=6, n_terms=d * (1 + r) ** 2)


def mp_norm_assembly(base_sq, cross, ba, s: float, fmt="fp32") -> Truth:
    """Exact ``sqrt(max(base + 2s cross + s^2 ba, 0))`` for the given (float) terms and the
    fp32 constants ``2s``, ``s^2 = fl32(s*s)`` of :func:`~dora_num.numerics.formulas.scale_constants`."""
    base_sq, cross, ba = (_f64(x, n) for x, n in ((base_sq, "base_sq"), (cross, "cross"), (ba, "ba")))
    _, two_s, s_sq = F.scale_constants(s)
    return _mp_eval(lambda ar, b, c, a, ts, ss: F.norm_assembly(ar, b, c, a, ar.const(ts), ar.const(ss)),
                    [base_sq, cross, ba], [two_s, s_sq], fmt, degree=2, n_terms=3)


def mp_magnitude_scale(m, wnorm, eps: float, fmt="fp32") -> Truth:
    """Exact ``g = m / wnorm`` (``m / eps`` where ``wnorm == 0``:
    :func:`~dora_num.numerics.formulas.magnitude_denominator`), rounded once (the quotient correctly rounded at a
    precision where that is the exact rounding: :func:`~dora_num.numerics.exact.exact_bits`)."""
    m, wnorm = _f64(m, "m"), _f64(wnorm, "wnorm")
    return _mp_eval(lambda ar, mm, w, e: F.magnitude_scale(ar, mm, w, ar.const(e)),
                    [m, wnorm], [float(eps)], fmt, degree=1, n_terms=1)


def mp_dense_row_norm_sq(W, A, B, s: float) -> list:
    """Exact ``Q_j = ||W_j + s (BA)_j||^2`` per row as a ``Fraction`` (``s`` rounded to fp32): every
    product and sum exact at :func:`~dora_num.numerics.exact.exact_bits`, so no rounding at all."""
    W, A, B = _f64(W, "W"), _f64(A, "A"), _f64(B, "B")
    s = F.scale_constants(s)[0]
    d, r = W.shape[1], A.shape[0]
    arrays = [W, A, B, np.array([s])]
    with mpmath.workprec(exact_bits(*arrays, degree=6, n_terms=d * (1 + r) ** 2)):
        Wm, Am, Bm, sm = (to_mp(a) for a in arrays)
        dense = Wm + sm[0] * (Bm @ Am)
        Q = (dense * dense).sum(axis=1) if W.shape[0] else np.zeros(0, dtype=object)
    return [Fraction(int(q.man)) * Fraction(2) ** int(q.exp) if q else Fraction(0) for q in Q]


def rn64_over_sqrt(num: Fraction, Q: Fraction) -> float:
    """``RN64(num / sqrt(Q))`` for rationals ``num`` and ``Q > 0``, rounded once: a float64 estimate,
    then the two float64 neighbours bracketing the exact value and the midpoint between them,
    decided by exact rational comparisons of squares (``y^2 Q`` against ``num^2``).  ``num = Q``
    gives ``RN64(sqrt(Q))``; ``num = m`` gives the exact ``g = m / ||W + sBA||`` rounded once."""
    import math
    import struct

    if Q <= 0:
        raise ValueError("Q must be positive")
    a = abs(num)
    if a == 0:
        return 0.0 * (1 if num >= 0 else -1)
    # |num| / sqrt(Q) >= y  <=>  num^2 >= y^2 Q for y >= 0
    below = lambda y: Fraction(y) ** 2 * Q <= a * a  # noqa: E731
    est = math.exp(math.log(a.numerator) - math.log(a.denominator)
                   - 0.5 * (math.log(Q.numerator) - math.log(Q.denominator)))
    lo = est
    while not below(lo):
        lo = math.nextafter(lo, 0.0)
    while below(math.nextafter(lo, math.inf)):
        lo = math.nextafter(lo, math.inf)
    hi = math.nextafter(lo, math.inf)  # lo <= exact < hi
    if Fraction(lo) ** 2 * Q == a * a:
        out = lo
    else:
        mid = (Fraction(lo) + Fraction(hi)) / 2
        c = mid * mid * Q - a * a
        if c == 0:  # a tie: to even
            out = hi if struct.unpack("<q", struct.pack("<d", lo))[0] & 1 else lo
        else:
            out = hi if c < 0 else lo
    return out if num > 0 else -out
