"""Binary floating-point formats: constants, exact rounding, ulp, ULP distance.

A format of precision ``p`` and minimum normal exponent ``emin`` has quantum
``ulp(x) = 2^(max(e, emin) - p + 1)`` for ``2^e <= |x| < 2^(e+1)``, unit roundoff ``u = 2^-p`` and
``eps = 2^(1-p)``; ``g`` rounds to exactly 1 iff ``1 - eps/4 <= g <= 1 + eps/2``, an asymmetric
collapse zone.  :func:`round_to` rounds float64 values once to nearest even (``rint(x / q) * q``,
``q`` a power of two); overflow follows torch, which the operator converts with (fp8 e4m3fn
saturates at 448, and the bounds return ``inf`` where a result may).  What torch and ml_dtypes do
on overflow and from float64 (measured, held by tests/numerics/test_formats.py): docs/platform.md,
"Rounding to a format".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import ml_dtypes
import numpy as np
import torch


@dataclass(frozen=True)
class Format:
    """A binary floating-point format (all numeric fields are Python floats/ints)."""

    name: str
    bits: int
    torch_dtype: torch.dtype | None
    np_dtype: type
    p: int  # significand precision, implicit bit included
    emin: int  # exponent of the smallest normal
    emax: int  # exponent of the largest finite binade
    has_inf: bool
    u: float  # unit roundoff 2^-p
    eps: float  # machine epsilon 2^(1-p) = spacing above one
    spacing_below_one: float  # 2^-p
    spacing_above_one: float  # 2^(1-p)
    max: float  # largest finite value (e4m3fn: 448, also where torch saturates)
    min_normal: float
    min_subnormal: float

    @property
    def uint_dtype(self) -> type:
        return {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[self.bits]

    @property
    def saturates(self) -> bool:
        """Overflow gives ``±max`` (torch's e4m3fn conversion) instead of ``±inf``."""
        return not self.has_inf

    def __repr__(self) -> str:  # short: formats appear in test ids and tables
        return f"Format({self.name})"


def _make(name, bits, torch_dtype, np_dtype, p, emin, emax, has_inf, max_significand=None) -> Format:
    # max_significand: the largest finite significand M (default 2^p - 1); e4m3fn
    # reserves S.1111.111 for NaN, so its largest is 1.110b = 14 (in units of 2^-3).
    M = (1 << p) - 1 if max_significand is None else max_significand
    return Format(
        name=name, bits=bits, torch_dtype=torch_dtype, np_dtype=np_dtype, p=p, emin=emin, emax=emax,
        has_inf=has_inf, u=2.0 ** -p, eps=2.0 ** (1 - p), spacing_below_one=2.0 ** -p,
        spacing_above_one=2.0 ** (1 - p), max=float(M * 2.0 ** (emax - p + 1)),
        min_normal=2.0 ** emin, min_subnormal=2.0 ** (emin - p + 1),
    )


FORMATS: dict[str, Format] = {
    "bf16": _make("bf16", 16, torch.bfloat16, ml_dtypes.bfloat16, 8, -126, 127, True),
    "fp16": _make("fp16", 16, torch.float16, np.float16, 11, -14, 15, True),
    "fp32": _make("fp32", 32, torch.float32, np.float32, 24, -126, 127, True),
    "fp8_e4m3fn": _make("fp8_e4m3fn", 8, getattr(torch, "float8_e4m3fn", None), ml_dtypes.float8_e4m3fn,
                        4, -6, 8, False, max_significand=14),
    "fp8_e5m2": _make("fp8_e5m2", 8, getattr(torch, "float8_e5m2", None), ml_dtypes.float8_e5m2, 3, -14, 15, True),
}

# float64 as a Format, for rounding exact values to float64 (ground truth's ``value``); not one
# of the storage formats studied, so not in FORMATS.
FP64 = _make("fp64", 64, torch.float64, np.float64, 53, -1022, 1023, True)

_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
            "float8_e4m3fn": "fp8_e4m3fn", "e4m3fn": "fp8_e4m3fn", "e4m3": "fp8_e4m3fn",
            "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2"}


def get_format(name_or_dtype) -> Format:
    """A :class:`Format` from its name ("bf16", ...), an alias, a torch dtype or a numpy/ml_dtypes dtype."""
    if isinstance(name_or_dtype, Format):
        return name_or_dtype
    if isinstance(name_or_dtype, str):
        key = _ALIASES.get(name_or_dtype.lower(), name_or_dtype.lower())
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(f"unknown format name {name_or_dtype!r}; known: {sorted(FORMATS)} (+ aliases {sorted(_ALIASES)})")
    if isinstance(name_or_dtype, torch.dtype):
        for f in FORMATS.values():
            if f.torch_dtype is not None and f.torch_dtype == name_or_dtype:
                return f
        raise ValueError(f"torch dtype {name_or_dtype} is not one of the formats {sorted(FORMATS)}")
    try:
        dt = np.dtype(name_or_dtype)
    except TypeError:
        raise TypeError(f"name_or_dtype must be a format name, torch dtype or numpy dtype, got {name_or_dtype!r}") from None
    for f in FORMATS.values():
        if np.dtype(f.np_dtype) == dt:
            return f
    raise ValueError(f"numpy dtype {dt} is not one of the formats {sorted(FORMATS)}")


def to_float64(x) -> np.ndarray:
    """``x`` (a torch tensor of any device and float dtype, a numpy array, a number) as a
    float64 numpy array; exact for every format here (each embeds in float64)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _as_f64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = to_float64(x)
    a = np.asarray(x)
    if a.dtype.kind not in "fiu" and a.dtype not in (np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
                                                      np.dtype(ml_dtypes.float8_e5m2)):
        raise TypeError(f"{name} must be a real numeric array, got dtype {a.dtype}")
    return a.astype(np.float64)


def _exponent(ax: np.ndarray) -> np.ndarray:
    """``floor(log2(ax))`` for finite ``ax > 0`` (exact, via frexp)."""
    _, E = np.frexp(ax)
    return E.astype(np.int64) - 1


def quantum(x, fmt) -> np.ndarray:
    """The format's spacing at ``x``: ``2^(max(e, emin) - p + 1)``, ``e = floor(log2|x|)``.

    Defined for every finite float64 ``x`` (the binade of ``x``, unbounded above:
    beyond ``max`` it continues the top binade's exponent growth); ``x = 0``
    gives ``min_subnormal``; non-finite ``x`` gives NaN.
    """
    fmt = get_format(fmt)
    a = np.abs(_as_f64(x, "x"))
    finite = np.isfinite(a)
    safe = np.where(finite & (a > 0), a, 1.0)
    e = np.maximum(_exponent(safe), fmt.emin)
    q = np.ldexp(1.0, (e - fmt.p + 1).astype(np.int32))
    q = np.where(a == 0, fmt.min_subnormal, q)
    return np.where(finite, q, np.nan)


def ulp(x, fmt) -> np.ndarray:
    """``ulp(x)`` in the format (float64 array): the spacing of the binade holding ``|x|``.

    ``ulp(1) = eps``; ``ulp(1 - tiny) = eps/2``; subnormals and 0 give
    ``min_subnormal``; beyond ``max`` the top binade's ``ulp(max)`` (values there
    round to inf, or saturate to ``max`` in e4m3fn, but the spacing of the format
    stops growing); non-finite: NaN.
    """
    fmt = get_format(fmt)
    q = quantum(x, fmt)
    return np.minimum(q, 2.0 ** (fmt.emax - fmt.p + 1))


def round_to(x, fmt) -> np.ndarray:
    """Round float64 values to nearest-even in ``fmt``; returned as float64.

    Exactly one rounding (see module docstring).  Overflow gives ``±inf``
    (e4m3fn: ``±448``, as torch; ``±inf`` inputs too); NaN stays NaN.
    """
    fmt = get_format(fmt)
    a = _as_f64(x, "x")
    finite = np.isfinite(a)
    q = quantum(np.where(finite, a, 0.0), fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.rint(a / q) * q
    over = finite & (np.abs(r) > fmt.max)
    if fmt.has_inf:
        r = np.where(over, np.copysign(np.inf, a), r)
        r = np.where(finite, r, a)
    else:  # saturate, as torch's conversion does
        r = np.where(over | np.isinf(a), np.copysign(fmt.max, a), r)
        r = np.where(np.isnan(a), np.nan, r)
    # keep the sign of zero (rint(-0.3) = -0.0 already; an underflow to 0 keeps x's sign)
    return np.where(r == 0, np.copysign(0.0, a), r)


def round_fraction(x: Fraction, fmt) -> float:
    """Exact round-to-nearest-even of a rational (or int/float/mpf) scalar into ``fmt``.

    Used by the ground truth to round exact values that float64 cannot hold
    (``fmt`` may be :data:`FP64`).  Overflow as :func:`round_to`.
    """
    fmt = get_format(fmt)
    if not isinstance(x, Fraction):
        try:
            import mpmath

            if isinstance(x, mpmath.mpf):
                if not mpmath.isfinite(x):
                    if fmt.has_inf or mpmath.isnan(x):
                        return float(x)
                    return math.copysign(fmt.max, float(x))
                sgn, man, exp, _ = x._mpf_  # man_exp drops the sign
                x = (-1 if sgn else 1) * Fraction(int(man)) * (Fraction(2) ** int(exp)) if man else Fraction(0)
        except ImportError:  # pragma: no cover
            pass
        x = Fraction(x)
    if x == 0:
        return 0.0
    sign = -1 if x < 0 else 1
    a = abs(x)
    # e = floor(log2 a)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    qe = max(e, fmt.emin) - fmt.p + 1
    scaled = a / (Fraction(2) ** qe)
    n, rem = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * rem
    if twice > scaled.denominator or (twice == scaled.denominator and n % 2 == 1):
        n += 1
    val = Fraction(n) * Fraction(2) ** qe
    if val > Fraction(fmt.max):
        return sign * (float("inf") if fmt.has_inf else fmt.max)
    return sign * float(val)


def _ordinal(x: np.ndarray, fmt: Format, name: str) -> np.ndarray:
    """Signed ordinal of representable values: ``sign(x) * bits(|x|)`` (monotone; ±0 -> 0)."""
    if np.isnan(x).any():
        raise ValueError(f"{name} contains NaN; ULP distance is undefined for NaN")
    r = round_to(x, fmt)
    bad = ~((r == x) | (np.isinf(x) & fmt.has_inf))
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        raise ValueError(f"{name} must hold values representable in {fmt.name}; "
                         f"{name}.flat[{i}] = {x.ravel()[i]!r} is not (round it with round_to first)")
    bits = np.abs(x).astype(fmt.np_dtype).view(fmt.uint_dtype).astype(np.int64)
    return np.where(np.signbit(x), -bits, bits)


def ulp_distance(a, b, fmt) -> np.ndarray:
    """Signed number of representable steps from ``a`` to ``b`` in ``fmt`` (int64).

    ``ulp_distance(a, b) = ord(b) - ord(a)`` where ``ord`` numbers the
    representable values in increasing order with ``ord(±0) = 0`` (so the count
    is correct across zero and ±0 are one value); ``+inf`` is one step above
    ``max``.  Both inputs must be representable (raise otherwise) and not NaN.
    Use ``np.abs`` for an unsigned count.
    """
    fmt = get_format(fmt)
    a64, b64 = _as_f64(a, "a"), _as_f64(b, "b")
    try:
        a64, b64 = np.broadcast_arrays(a64, b64)
    except ValueError:
        raise ValueError(f"a and b must broadcast, got shapes {a64.shape} and {b64.shape}") from None
    return _ordinal(b64, fmt, "b") - _ordinal(a64, fmt, "a")


# --------------------------------------------------------------------------
# Error-free transformations (float64) and exact rounding of a double-double.
# --------------------------------------------------------------------------

def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knuth's TwoSum: ``s = fl(a+b)`` and ``e`` with ``s + e = a + b`` exactly (no overflow)."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf inputs give NaN errors; callers mask them
        s = a + b
        bb = s - a
        e = (a - (s - bb)) + (b - bb)
    return s, e


_SPLIT = 134217729.0  # 2^27 + 1 (Veltkamp/Dekker split for float64)


def two_prod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dekker's TwoProduct: ``p = fl(a*b)`` and ``e`` with ``p + e = a*b`` exactly.

    Valid when no intermediate over/underflows (|a|, |b| < 2^995 and the
    product's error term is not below the float64 subnormal range).
    """
    with np.errstate(invalid="ignore", over="ignore"):  # inf inputs give NaN errors; callers mask them
        p = a * b
        t = _SPLIT * a
        ah = t - (t - a)
        al = a - ah
        t = _SPLIT * b
        bh = t - (t - b)
        bl = b - bh
        e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    return p, e


def round_dd(hi, lo, fmt) -> np.ndarray:
    """Round the exact value ``hi + lo`` to nearest-even in ``fmt`` (``|lo| <= ulp64(hi)/2``).

    ``fmt``'s grid and its midpoints lie on the float64 grid (p <= 24 < 53), so
    ``RN_fmt(hi + lo) = RN_fmt(hi)`` unless ``hi`` is exactly a midpoint of
    ``fmt`` and ``lo != 0``, in which case ``lo``'s sign picks the neighbour.
    This gives correctly rounded fma and sums from error-free transformations.
    """
    fmt = get_format(fmt)
    if fmt.p > 26:
        raise ValueError(f"round_dd needs a format of <= 26 significand bits (its midpoints on the float64 grid), "
                         f"got {fmt.name}")
    hi = _as_f64(hi, "hi")
    lo = _as_f64(lo, "lo")
    r = round_to(hi, fmt)
    finite = np.isfinite(hi)
    q = quantum(np.where(finite, hi, 0.0), fmt)
    with np.errstate(invalid="ignore"):
        t = hi / q
        fl = np.floor(t)
        tie = finite & (t - fl == 0.5) & (lo != 0)
    if tie.any():
        up = np.where(lo > 0, fl + 1, fl)[tie] * q[tie]
        up = np.where(np.abs(up) > fmt.max, np.copysign(np.inf if fmt.has_inf else fmt.max, up), up)
        r = r.copy()
        r[tie] = np.where(up == 0, np.copysign(0.0, hi[tie]), up)
    return r
