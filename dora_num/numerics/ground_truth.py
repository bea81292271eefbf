"""Certified ground truth for the compose, the norms, the assembly and ``g``.

Two routes, both evaluating the formulas of :mod:`dora_num.numerics.formulas`:

1. **mpmath at two precisions** (``mp_*``): the formula under
   :class:`~dora_num.numerics.exact.MPArith` at ``precs[0]`` and ``precs[1]``
   bits; each result is rounded to the requested format (and to float64) from
   both, and the two must agree, else :class:`GroundTruthError`.
2. **vectorised double-double** (:func:`compose_exact`): the compose under
   :class:`~dora_num.numerics.exact.DDArith` with a rigorous error bound; every
   element whose correct rounding the bound cannot decide (within ``err`` of a
   rounding boundary) is recomputed by route 1.  With fp32 inputs the only
   rounding in the double-double evaluation is ``g * (s * lora)`` (72 bits),
   so ``err`` is ``~2^-100`` relative and fallbacks happen essentially only for
   inputs constructed to sit on a boundary.

Every value returned is the exact real result of the formula for the given
(float) inputs, rounded once: ``value`` to float64, ``rounded`` to the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import formulas as F
from .exact import DDArith, MPArith, certified_round, mp_to_float, to_mp
from .formats import get_format, round_fraction, round_to, to_float64

DEFAULT_PRECS = (128, 256)  # bits; raise both (notebook parameter MP_PREC) to re-check


class GroundTruthError(RuntimeError):
    """The two mpmath precisions disagree: the result is not certified."""


@dataclass
class Truth:
    value: np.ndarray  # exact result rounded to float64
    rounded: np.ndarray  # exact result rounded once to the format (float64 storage)
    n_fallback: int = 0  # elements recomputed with mpmath


def _f64(x, name):
    a = to_float64(x)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains non-finite values; ground truth needs finite inputs")
    return a


def _check_precs(precs):
    if len(precs) != 2 or precs[0] >= precs[1] or precs[0] < 64:
        raise ValueError(f"precs must be two increasing precisions >= 64 bits, got {precs!r}")
    return precs


_round_frac = np.frompyfunc(round_fraction, 2, 1)


def _certify(results: list[np.ndarray], fmt, what: str) -> Truth:
    """Round the mpmath results of both precisions; they must agree."""
    fmt = get_format(fmt)
    outs = []
    for res in results:
        res = np.asarray(res, dtype=object)
        outs.append((mp_to_float(res), np.asarray(_round_frac(res, fmt), dtype=np.float64)))
    (v0, r0), (v1, r1) = outs
    bad = ~((v0 == v1) & ((r0 == r1) | (np.isnan(r0) & np.isnan(r1))))
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        raise GroundTruthError(f"{what}: mpmath results at the two precisions disagree at flat index {i} "
                               f"({v0.ravel()[i]!r} vs {v1.ravel()[i]!r}); raise the precisions")
    return Truth(value=v1, rounded=r1)


def _mp_eval(formula, args_f64: list, scalars: list, precs, fmt, what) -> Truth:
    _check_precs(precs)
    mp_args = [to_mp(a) for a in args_f64]
    results = [formula(MPArith(p), *mp_args, *scalars) for p in precs]
    return _certify(results, fmt, what)


# ----------------------------------------------------------------- compose

def mp_compose(base, lora, g, s: float, fmt="fp32", *, precs=DEFAULT_PRECS, formula: str = "compose_stable") -> Truth:
    """Exact compose ``delta = (g-1) base + g s lora`` via mpmath at two precisions."""
    if formula not in ("compose_stable", "compose_naive"):
        raise ValueError(f"formula must be compose_stable or compose_naive, got {formula!r}")
    base, lora, g = _f64(base, "base"), _f64(lora, "lora"), _f64(g, "g")
    base, lora, g = np.broadcast_arrays(base, lora, g)
    s = F.scale_constants(s)[0]
    return _mp_eval(lambda ar, b, l, gg, ss: getattr(F, formula)(ar, b, l, gg, ar.const(ss)),
                    [base, lora, g], [s], precs, fmt, "compose")


def compose_exact(base, lora, g, s: float, fmt="fp32", *, precs=DEFAULT_PRECS) -> Truth:
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
                                                             g.ravel()[idx], s, fmt, precs=precs), base.shape)


def _dd_with_fallback(dd, fmt, mp_fn, shape) -> Truth:
    """Certified rounding of a double-double result; undecided elements go to ``mp_fn(indices)``."""
    rounded, uncertain = certified_round(dd, fmt)
    hi, lo = np.broadcast_arrays(dd.hi, dd.lo)
    # float64 value: hi = RN64(hi + lo) (TwoSum-normalised); the exact value is within
    # err (~2^-100 relative) of hi + lo, so hi is its float64 rounding except within err of a
    # float64 midpoint; that affects only reported errors (by 2^-53 relative), never `rounded`.
    value = np.broadcast_to(hi + lo, shape).copy()
    rounded = np.broadcast_to(rounded, shape).copy()
    uncertain = np.broadcast_to(uncertain, shape)
    n = int(uncertain.sum())
    if n:
        idx = np.flatnonzero(uncertain.ravel())
        t = mp_fn(idx)
        rounded.ravel()[idx], value.ravel()[idx] = t.rounded, t.value
    return Truth(value=value, rounded=rounded, n_fallback=n)


def assembly_exact(base_sq, cross, ba, s: float, fmt="fp32", *, precs=DEFAULT_PRECS) -> Truth:
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
                                                                   s, fmt, precs=precs), b.shape)


# ----------------------------------------------------------------- norms, assembly, g

def mp_factored_terms(W, A, B, *, precs=DEFAULT_PRECS) -> dict[str, Truth]:
    """Exact ``base = rowsum(W*W)``, ``cross = rowsum(B * (W A^T))``,
    ``ba = rowsum((B A A^T) * B)`` (each rounded to float64 and fp32)."""
    W, A, B = _f64(W, "W"), _f64(A, "A"), _f64(B, "B")
    out = {}
    for name, fn in (("base", lambda W, A, B: (W * W).sum(axis=1)),
                     ("cross", lambda W, A, B: (B * (W @ A.T)).sum(axis=1)),
                     ("ba", lambda W, A, B: ((B @ (A @ A.T)) * B).sum(axis=1))):
        res = []
        for p in _check_precs(precs):
            import mpmath

            with mpmath.workprec(p):
                res.append(fn(to_mp(W), to_mp(A), to_mp(B)))
        out[name] = _certify(res, "fp32", f"factored term {name}")
    return out


def mp_dense_row_norm(W, A, B, s: float, *, precs=DEFAULT_PRECS) -> Truth:
    """Exact ``||W + s B A||_row`` (rounded to float64 and fp32), ``s`` rounded to fp32."""
    import mpmath

    W, A, B = _f64(W, "W"), _f64(A, "A"), _f64(B, "B")
    s = F.scale_constants(s)[0]
    res = []
    for p in _check_precs(precs):
        ar = MPArith(p)
        with mpmath.workprec(p):
            dense = to_mp(W) + ar.const(s) * (to_mp(B) @ to_mp(A))
            res.append(ar.sqrt((dense * dense).sum(axis=1)))
    return _certify(res, "fp32", "dense row norm")


def mp_norm_assembly(base_sq, cross, ba, s: float, fmt="fp32", *, precs=DEFAULT_PRECS) -> Truth:
    """Exact ``sqrt(max(base + 2s cross + s^2 ba, 0))`` for the given (float) terms."""
    base_sq, cross, ba = (_f64(x, n) for x, n in ((base_sq, "base_sq"), (cross, "cross"), (ba, "ba")))
    _, two_s, s_sq = F.scale_constants(s)
    return _mp_eval(lambda ar, b, c, a: F.norm_assembly(ar, b, c, a, ar.const(two_s), ar.const(s_sq)),
                    [base_sq, cross, ba], [], precs, fmt, "norm assembly")


def mp_magnitude_scale(m, wnorm, eps: float, fmt="fp32", *, precs=DEFAULT_PRECS) -> Truth:
    """Exact ``g = m / max(wnorm, eps)``."""
    m, wnorm = _f64(m, "m"), _f64(wnorm, "wnorm")
    return _mp_eval(lambda ar, mm, w: F.magnitude_scale(ar, mm, w, ar.const(eps)),
                    [m, wnorm], [], precs, fmt, "magnitude scale")
