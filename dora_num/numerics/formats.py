"""Binary floating-point formats: constants, exact rounding, ulp, ULP distance, bit patterns.

A format is declared by its bit layout alone (:func:`make_format`: exponent and significand field widths
and what the all-ones exponent holds); its width, precision ``p``, exponent range, largest value,
numpy/ml_dtypes type (the one whose ``finfo`` matches, if any) and torch dtype are derived.  Quantum
``ulp(x) = 2^(max(e, emin) - p + 1)`` for ``2^e <= |x| < 2^(e+1)``, unit roundoff ``u = 2^-p`` and
``eps = 2^(1-p)``; ``g`` rounds to exactly 1 iff ``1 - eps/4 <= g <= 1 + eps/2``, an asymmetric
collapse zone (``1 - eps/2 <= g`` where 1 is the smallest normal, e2m1 and e2m3: ``spacing_below_one``).
:func:`round_to` rounds float64 values once to nearest even (``rint(x / q) * q``, ``q`` a power of
two); overflow follows torch, which the operator converts with (fp8 e4m3fn and the
OCP MX fp6/fp4 formats saturate at their largest value, and the bounds return ``inf`` where a result
may).  :func:`to_bits` / :func:`from_bits` map values to bit patterns and back arithmetically, for
every width (4 and 6 bits included), so :func:`ulp_distance` and the exhaustive checks need no dtype
view.  What torch and ml_dtypes do on overflow and from float64 (measured, held by
tests/numerics/test_formats.py): docs/platform.md, "Rounding to a format".
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from fractions import Fraction

import ml_dtypes
import numpy as np
import torch

SPECIALS = ("ieee", "nan", "none")  # what the all-ones exponent field holds: see Format.specials


def name_seed(name: str) -> int:
    """A format's seed derived from its name alone (sha256, so it does not vary between runs as
    Python's ``hash`` does): 64 bits, for :attr:`Format.seed`."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


@dataclass(frozen=True)
class Format:
    """A binary floating-point format (all numeric fields are Python floats/ints), derived from its
    bit layout by :func:`make_format`."""

    name: str
    bits: int  # 1 + ebits + p - 1
    ebits: int  # width of the exponent field
    # all-ones exponent field: "ieee" inf (zero significand) and NaN; "nan" normal numbers except the
    # all-ones significand, NaN (fp8 e4m3fn); "none" normal numbers (OCP MX fp6/fp4: no inf, no NaN)
    specials: str
    torch_dtype: torch.dtype | None  # None: torch has no unpacked dtype of this format
    np_dtype: type | None  # the numpy/ml_dtypes scalar type with this layout; None if there is none
    p: int  # significand precision, implicit bit included
    emin: int  # exponent of the smallest normal
    emax: int  # exponent of the largest finite binade
    has_inf: bool
    u: float  # unit roundoff 2^-p
    eps: float  # machine epsilon 2^(1-p) = spacing above one
    spacing_below_one: float  # 2^-p; 2^(1-p) where 1 is the smallest normal (emin = 0: e2m1, e2m3)
    spacing_above_one: float  # 2^(1-p)
    max: float  # largest finite value (e4m3fn: 448, also where torch saturates)
    min_normal: float
    min_subnormal: float
    seed: int  # the format's part of an RNG seed (studies/inputs.py): fixed per format, never an index

    @property
    def max_code(self) -> int:
        """Bit pattern (sign clear) of :attr:`max`; the non-negative finite values are the patterns
        ``0 .. max_code`` in increasing order (``max_code + 1`` is ``inf`` where the format has it)."""
        mbits = self.p - 1
        top = {"ieee": ((1 << self.ebits) - 2) << mbits | ((1 << mbits) - 1),
               "nan": (1 << (self.bits - 1)) - 2, "none": (1 << (self.bits - 1)) - 1}
        return top[self.specials]

    @property
    def uint_dtype(self) -> np.dtype:
        """The unsigned integer type holding one bit pattern: the narrowest of 8, 16, 32, 64 bits."""
        return np.dtype(f"uint{max(8, 1 << (self.bits - 1).bit_length())}")

    @property
    def saturates(self) -> bool:
        """Overflow gives ``±max`` (torch's e4m3fn conversion) instead of ``±inf``."""
        return not self.has_inf

    def __repr__(self) -> str:  # short: formats appear in test ids and tables
        return f"Format({self.name})"


def _dtype_candidates() -> list[type]:
    names = sorted(n for n in dir(ml_dtypes) if n.startswith(("float", "bfloat")))
    return [np.float16, np.float32, np.float64] + [getattr(ml_dtypes, n) for n in names]


def _matching_dtype(bits, p, emin, emax, mx, has_inf, has_nan) -> type | None:
    """The numpy/ml_dtypes scalar type with exactly this layout (width, precision, exponent range,
    largest value, whether it holds inf and NaN), or None; more than one is an error."""
    found = []
    for t in _dtype_candidates():
        try:
            fi = ml_dtypes.finfo(t)
        except (TypeError, ValueError):  # pragma: no cover - a type without finfo
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            inf_ok = bool(np.isinf(np.array([np.inf]).astype(t).astype(np.float64))[0])
            nan_ok = bool(np.isnan(np.array([np.nan]).astype(t).astype(np.float64))[0])
        if ((int(fi.bits), int(fi.nmant) + 1, int(fi.minexp), int(fi.maxexp) - 1, float(fi.max), inf_ok, nan_ok)
                == (bits, p, emin, emax, mx, has_inf, has_nan)):
            found.append(t)
    if len(found) > 1:
        raise ValueError(f"more than one numpy/ml_dtypes type has this layout: {found}")
    return found[0] if found else None


def make_format(name: str, ebits: int, mbits: int, *, specials: str = "ieee", seed: int | None = None) -> Format:
    """A format from its bit layout: sign, ``ebits`` exponent bits (bias ``2^(ebits-1) - 1``), ``mbits``
    trailing significand bits; ``specials`` says what the all-ones exponent field holds (see
    :class:`Format`).  ``seed`` defaults to :func:`name_seed` of the name."""
    if specials not in SPECIALS:
        raise ValueError(f"specials must be one of {SPECIALS}, got {specials!r}")
    if ebits < 2 or mbits < 1:
        raise ValueError(f"a format needs >= 2 exponent bits and >= 1 significand bit, got e{ebits}m{mbits}")
    bits, p, bias = 1 + ebits + mbits, mbits + 1, (1 << (ebits - 1)) - 1
    emin = 1 - bias
    emax = (1 << ebits) - (2 if specials == "ieee" else 1) - bias
    M = (1 << p) - (2 if specials == "nan" else 1)  # the largest finite significand (e4m3fn: 1.110b)
    mx = float(M * 2.0 ** (emax - p + 1))
    np_dtype = _matching_dtype(bits, p, emin, emax, mx, specials == "ieee", specials != "none")
    tdt = getattr(torch, np.dtype(np_dtype).name, None) if np_dtype is not None else None
    return Format(
        name=name, bits=bits, torch_dtype=tdt if isinstance(tdt, torch.dtype) else None, np_dtype=np_dtype, p=p,
        emin=emin, emax=emax, has_inf=specials == "ieee", u=2.0 ** -p, eps=2.0 ** (1 - p),
        spacing_below_one=2.0 ** (max(emin, -1) - p + 1), spacing_above_one=2.0 ** (1 - p), max=mx,
        min_normal=2.0 ** emin, min_subnormal=2.0 ** (emin - p + 1), ebits=ebits, specials=specials,
        seed=name_seed(name) if seed is None else int(seed),
    )


# Every format the package can round to, keyed by name.  A new format is one line here (its seed
# derived from its name); the notebooks study the ones in STUDIED_FORMATS.  The first five keep the
# seeds they drew every recorded data set with (their positions in this dict when it was recorded).
# What else a new format touches (the tests' independent decoder): docs/extending.md.
FORMATS: dict[str, Format] = {
    "bf16": make_format("bf16", 8, 7, seed=0),
    "fp16": make_format("fp16", 5, 10, seed=1),
    "fp32": make_format("fp32", 8, 23, seed=2),
    "fp8_e4m3fn": make_format("fp8_e4m3fn", 4, 3, specials="nan", seed=3),
    "fp8_e5m2": make_format("fp8_e5m2", 5, 2, seed=4),
    # OCP Microscaling (MX v1.0) element formats: no inf, no NaN, saturating
    "fp6_e3m2": make_format("fp6_e3m2", 3, 2, specials="none"),  # max 28
    "fp6_e2m3": make_format("fp6_e2m3", 2, 3, specials="none"),  # max 7.5
    "fp4_e2m1": make_format("fp4_e2m1", 2, 1, specials="none"),  # max 6
}

# The formats the notebooks study, in the order of their tables and figures (notebook 03 sweeps them
# all; fp32 as a storage format too).  The sub-byte formats above are supported (tests) but not studied:
# adding one here changes notebook 03's data set.
STUDIED_FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2")
# The studied formats narrower than the fp32 working format: where an fp32 result is rounded and g can
# round to exactly 1 (the collapse tables).
NARROW_FORMATS: tuple[str, ...] = tuple(f for f in STUDIED_FORMATS if FORMATS[f].p < FORMATS["fp32"].p)

# float64 as a Format, for rounding exact values to float64 (ground truth's ``value``); not one
# of the storage formats studied, so not in FORMATS.
FP64 = make_format("fp64", 11, 52)

_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
            "float8_e4m3fn": "fp8_e4m3fn", "e4m3fn": "fp8_e4m3fn", "e4m3": "fp8_e4m3fn",
            "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
            "float6_e3m2fn": "fp6_e3m2", "e3m2": "fp6_e3m2", "float6_e2m3fn": "fp6_e2m3", "e2m3": "fp6_e2m3",
            "float4_e2m1fn": "fp4_e2m1", "e2m1": "fp4_e2m1"}


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
        if f.np_dtype is not None and np.dtype(f.np_dtype) == dt:
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
    if a.dtype.kind not in "fiu" and a.dtype not in {np.dtype(f.np_dtype) for f in FORMATS.values() if f.np_dtype}:
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


def _magnitude_code(a: np.ndarray, fmt: Format) -> np.ndarray:
    """Bit pattern (sign clear, int64) of finite representable ``a >= 0``: the binade's offset
    ``(max(e, emin) - emin) 2^(p-1)`` plus ``a / ulp`` (the significand as an integer), exact."""
    q = quantum(a, fmt)
    e = _exponent(q) + fmt.p - 1  # max(e, emin): q = 2^(max(e, emin) - p + 1)
    return (e - fmt.emin) * (1 << (fmt.p - 1)) + (a / q).astype(np.int64)


def to_bits(x, fmt) -> np.ndarray:
    """The bit patterns (``fmt.uint_dtype``, sign in bit ``bits - 1``) of values representable in
    ``fmt`` (``±inf`` where the format has it; NaN: the canonical quiet NaN, all-ones exponent and
    significand, or for e4m3fn all ones).  Computed, not viewed: equal to the numpy/ml_dtypes
    bits wherever that type exists (tests), also for a format without one."""
    fmt = get_format(fmt)
    x = _as_f64(x, "x")
    if fmt.specials == "none" and np.isnan(x).any():
        raise ValueError(f"{fmt.name} has no NaN")
    _check_representable(np.where(np.isnan(x), 0.0, x), fmt, "x")
    a = np.abs(x)
    fin = np.isfinite(a)
    mag = np.where(fin, _magnitude_code(np.where(fin, a, 0.0), fmt), fmt.max_code + 1)
    nan_code = (1 << (fmt.bits - 1)) - 1 if fmt.specials == "nan" else fmt.max_code + 1 + (1 << (fmt.p - 2))
    mag = np.where(np.isnan(x), nan_code, mag)
    sign = np.signbit(x).astype(np.int64) << (fmt.bits - 1)
    return (sign | mag).astype(np.uint64).astype(fmt.uint_dtype)


def from_bits(bits, fmt) -> np.ndarray:
    """Values (float64) of bit patterns of ``fmt`` (any integer array, ``0 <= bits < 2^fmt.bits``);
    NaN patterns give NaN.  Computed from the layout: for every width, with or without a numpy type."""
    fmt = get_format(fmt)
    b = np.asarray(bits)
    if b.dtype.kind not in "iu" or (b < 0).any() or (fmt.bits < 64 and (b >> fmt.bits).any()):
        raise ValueError(f"bits must be integer bit patterns of {fmt.name}, 0 <= bits < 2^{fmt.bits}")
    b = np.ascontiguousarray(b.astype(np.uint64)).view(np.int64)  # 64-bit: the sign bit makes it negative
    mbits = fmt.p - 1
    mag = (b & ((1 << (fmt.bits - 1)) - 1)).astype(np.int64)
    ef, mf = mag >> mbits, mag & ((1 << mbits) - 1)
    sig = np.where(ef == 0, mf, mf + (1 << mbits)).astype(np.float64)  # exact: < 2^53
    with np.errstate(over="ignore"):  # float64's inf/NaN patterns; replaced below
        v = np.ldexp(sig, (np.maximum(ef, 1) + fmt.emin - 1 - mbits).astype(np.int32))
    v = np.where(mag <= fmt.max_code, v, np.inf if fmt.has_inf else np.nan)
    v = np.where((mag > fmt.max_code + 1) & fmt.has_inf, np.nan, v)
    neg = (b >> (fmt.bits - 1)) & 1
    return np.where(neg == 1, -v, v)


def _check_representable(x: np.ndarray, fmt: Format, name: str) -> None:
    r = round_to(x, fmt)
    bad = ~((r == x) | (np.isinf(x) & fmt.has_inf))
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        raise ValueError(f"{name} must hold values representable in {fmt.name}; "
                         f"{name}.flat[{i}] = {x.ravel()[i]!r} is not (round it with round_to first)")


def _ordinal(x: np.ndarray, fmt: Format, name: str) -> np.ndarray:
    """Signed ordinal of representable values: ``sign(x) * bits(|x|)`` (monotone; ±0 -> 0; ``inf``:
    one past ``max``)."""
    if np.isnan(x).any():
        raise ValueError(f"{name} contains NaN; ULP distance is undefined for NaN")
    _check_representable(x, fmt, name)
    a = np.abs(x)
    fin = np.isfinite(a)
    bits = np.where(fin, _magnitude_code(np.where(fin, a, 0.0), fmt), fmt.max_code + 1)
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
