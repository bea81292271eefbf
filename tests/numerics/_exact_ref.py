"""Independent exact reference for the formats: decode bit patterns, round by search.

Written from the bit layouts only (sign | exponent field | mantissa field, bias),
with Python integers and Fractions; it shares no code with
``dora_num.numerics.formats``.  Positive bit patterns are ordered like their
values, so rounding is a binary search over patterns, ties go to the pattern
with an even last bit, and one step past the largest finite pattern is overflow.
"""

from __future__ import annotations

from fractions import Fraction

# name: (exponent bits, mantissa bits, bias, what the all-ones exponent holds: "ieee" inf/NaN,
# "nan" numbers but S.1..1.1..1 is NaN, "none" numbers only: OCP MX v1.0, section 5.3)
LAYOUTS = {
    "bf16": (8, 7, 127, "ieee"),
    "fp16": (5, 10, 15, "ieee"),
    "fp32": (8, 23, 127, "ieee"),
    "fp8_e4m3fn": (4, 3, 7, "nan"),  # no inf; only S.1111.111 is NaN
    "fp8_e5m2": (5, 2, 15, "ieee"),
    "fp6_e3m2": (3, 2, 3, "none"),  # OCP MX FP6 E3M2: max 1.11b * 2^4 = 28
    "fp6_e2m3": (2, 3, 1, "none"),  # OCP MX FP6 E2M3: max 1.111b * 2^2 = 7.5
    "fp4_e2m1": (2, 1, 1, "none"),  # OCP MX FP4 E2M1: max 1.1b * 2^2 = 6
}


def max_pattern(name: str) -> int:
    eb, mb, _, kind = LAYOUTS[name]
    if kind == "ieee":
        return ((2**eb - 2) << mb) | (2**mb - 1)
    return ((2**eb - 1) << mb) | (2**mb - (2 if kind == "nan" else 1))


def has_inf(name: str) -> bool:
    return LAYOUTS[name][3] == "ieee"


def decode(name: str, bits: int) -> Fraction:
    """Value of a non-negative finite pattern (sign bit clear)."""
    eb, mb, bias, _ = LAYOUTS[name]
    e_field, m_field = bits >> mb, bits & (2**mb - 1)
    if e_field == 0:
        return Fraction(m_field) * Fraction(2) ** (1 - bias - mb)
    return Fraction(2**mb + m_field) * Fraction(2) ** (e_field - bias - mb)


def round_ref(name: str, x: Fraction):
    """Round-to-nearest-even of a finite rational; returns a Fraction, or 'inf' on overflow.

    A format without infinity (e4m3fn, the MX formats) saturates to its largest finite value, as
    torch's conversion does (the project's operator converts with torch)."""
    sign = -1 if x < 0 else 1
    a = abs(x)
    top = max_pattern(name)
    lo, hi = 0, top  # largest k with decode(k) <= a
    if decode(name, top) <= a:
        k = top
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if decode(name, mid) <= a:
                lo = mid
            else:
                hi = mid
        k = lo
    v = decode(name, k)
    if v == a:
        return sign * v
    if k == top:
        step = decode(name, top) - decode(name, top - 1)
        nxt = v + step  # the first unrepresentable binade value
    else:
        nxt = decode(name, k + 1)
    mid = (v + nxt) / 2
    if a < mid or (a == mid and k % 2 == 0):
        return sign * v
    if k == top:
        return "inf" if has_inf(name) else sign * decode(name, top)
    return sign * nxt


def ordinal_ref(name: str, x: Fraction) -> int:
    """Signed position of a representable value (±0 -> 0)."""
    a = abs(x)
    lo, hi = 0, max_pattern(name)
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(name, mid) < a:
            lo = mid + 1
        else:
            hi = mid
    assert decode(name, lo) == a
    return -lo if x < 0 else lo


# float64, for the ground truth's `value` field (not a storage format of the package)
LAYOUTS["fp64"] = (11, 52, 1023, "ieee")


def _as_float(name: str, r, sign_of) -> float:
    import math

    if r == "inf":
        return math.copysign(math.inf, sign_of)
    return math.copysign(float(r), sign_of) if r == 0 else float(r)


def round_float(name: str, x: Fraction) -> float:
    """:func:`round_ref` as a Python float (``inf`` on overflow)."""
    return _as_float(name, round_ref(name, x), 1 if x >= 0 else -1)


def sqrt_round_ref(name: str, q: Fraction) -> float:
    """Correctly rounded ``sqrt(q)`` of a rational ``q >= 0``, by search over bit patterns:
    the largest pattern ``v`` with ``v^2 <= q``, then ``q`` against the squared midpoint."""
    if q < 0:
        raise ValueError("q must be >= 0")
    top = max_pattern(name)
    if decode(name, top) ** 2 <= q:
        k = top
    else:
        lo, hi = 0, top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if decode(name, mid) ** 2 <= q:
                lo = mid
            else:
                hi = mid
        k = lo
    v = decode(name, k)
    if v * v == q:
        return float(v)
    nxt = decode(name, k + 1) if k < top else v + (decode(name, top) - decode(name, top - 1))
    m2 = ((v + nxt) / 2) ** 2
    if q < m2 or (q == m2 and k % 2 == 0):
        return float(v)
    if k == top:
        return float("inf") if has_inf(name) else float(v)
    return float(nxt)


# ---------------------------------------------------------------------------- row norms of W + s B A, exactly

def exact_row_norm_sq(W, A, B, s):
    """``||W_j + s (BA)_j||^2`` per row, in rationals, with ``s = fl32(scale)`` (the real ``s^2``); W, A, B
    numpy or torch (their values taken exactly)."""
    import numpy as np

    sf = Fraction(float(np.float32(s)))
    tolist = lambda t: np.asarray(t.double() if hasattr(t, "double") else t, dtype=np.float64).tolist()  # noqa: E731
    Af = [[Fraction(v) for v in row] for row in tolist(A)]
    out = []
    for j, wrow in enumerate(tolist(W)):
        b = [Fraction(v) for v in tolist(B)[j]]
        q = Fraction(0)
        for i, w in enumerate(wrow):
            x = Fraction(w) + sf * sum(b[k] * Af[k][i] for k in range(len(b)))
            q += x * x
        out.append(q)
    return out


def norm_within(w: float, E: float, q: Fraction) -> bool:
    """``|w - sqrt(q)| <= E``, decided exactly (``E = inf``: vacuous)."""
    import math

    if math.isinf(E):
        return True
    lo = max(Fraction(w) - Fraction(E), Fraction(0))
    return lo * lo <= q <= (Fraction(w) + Fraction(E)) ** 2
