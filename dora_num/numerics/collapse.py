"""Collapse statistics of the magnitude scale ``g`` in a storage format.

At ``g ≈ 1`` the multiplication by ``g`` can vanish when ``g`` (or ``g*x``) is
rounded to a narrow format.  Three measures, from the loosest to the exact one:

- **symmetric zone** (the paper's definition): ``|g - 1| < eps/2``, ``eps`` the
  machine epsilon (spacing above 1).  bf16: ``|g-1| < 2^-8``.
- **rounds to one** (the exact, asymmetric zone): ``fl(g) == 1``.  The spacing
  below 1 is ``eps/2`` and the one above is ``eps``, so with ties to even
  ``fl(g) == 1`` iff ``1 - eps/4 <= g <= 1 + eps/2``.  Below 1 the exact zone is
  half as wide as the symmetric one: the paper's zone over-counts g < 1.
- **value-level absorption**: ``fl(g*x) == x`` for a value ``x`` of the format
  (the product rounded once, exactly): what actually happens to a stored
  activation or weight multiplied by ``g`` in the format.

All computations are exact: ``g`` and ``x`` are taken as float64 values, the
product ``g*x`` as an exact double-double, rounded once.
"""

from __future__ import annotations

import numpy as np

from .formats import get_format, round_dd, round_to, to_float64, two_prod


def _as_array(x, name: str) -> np.ndarray:
    a = to_float64(x).ravel()
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains {int((~np.isfinite(a)).sum())} non-finite values")
    return a


def exact_zone(fmt) -> tuple[float, float]:
    """``(lo, hi)``: ``fl(g) == 1`` exactly for ``lo <= g <= hi`` (closed: both ends are ties to 1)."""
    fmt = get_format(fmt)
    return 1.0 - fmt.spacing_below_one / 2, 1.0 + fmt.spacing_above_one / 2


def zone_masks(g, fmt) -> dict[str, np.ndarray]:
    """Per value of ``g`` (flattened), the four zone tests :func:`collapse_stats` counts, keyed by its
    ``frac_*`` names: ``|g-1| < eps/2``, ``fl(g) == 1``, and each restricted to ``g < 1``."""
    fmt = get_format(fmt)
    a = _as_array(g, "g")
    sym = np.abs(a - 1.0) < fmt.eps / 2  # a - 1 exact for g in [0.5, 2]; elsewhere far from the zone ends
    one = round_to(a, fmt) == 1.0
    below = a < 1.0
    return {"frac_symmetric_zone": sym, "frac_rounds_to_one": one, "frac_below_one_symmetric": sym & below,
            "frac_below_one_rounds_to_one": one & below}


def collapse_stats(g, fmt) -> dict:
    """Collapse statistics of the values ``g`` (any shape) in ``fmt``.

    Returns a dict of plain Python numbers: ``n``; ``frac_symmetric_zone``
    (``|g-1| < eps/2``, the paper's zone); ``frac_rounds_to_one``
    (``fl(g) == 1``, exact); ``frac_below_one_symmetric`` /
    ``frac_below_one_rounds_to_one`` (the same restricted to ``g < 1``, where the
    two definitions differ); ``zone_lo``, ``zone_hi`` (exact zone ends);
    ``threshold_symmetric`` (``eps/2``); ``g_mean``, ``g_std``,
    ``abs_gm1_median``, ``abs_gm1_max``.
    """
    fmt = get_format(fmt)
    a = _as_array(g, "g")
    d = a - 1.0
    lo, hi = exact_zone(fmt)
    return {
        "format": fmt.name,
        "n": int(a.size),
        **{k: float(v.mean()) for k, v in zone_masks(a, fmt).items()},
        "threshold_symmetric": fmt.eps / 2,
        "zone_lo": lo,
        "zone_hi": hi,
        "g_mean": float(a.mean()),
        "g_std": float(a.std()),
        "abs_gm1_median": float(np.median(np.abs(d))),
        "abs_gm1_max": float(np.abs(d).max()),
    }


def absorption_fraction(g, x, fmt) -> float:
    """Fraction of elements where ``fl(g*x) == x`` in ``fmt`` (``g``, ``x`` broadcast).

    ``x`` must hold values representable in ``fmt`` (round it first with
    :func:`~dora_num.numerics.formats.round_to`); ``g`` is any finite float64
    (typically fp32).  ``g*x`` is formed exactly (TwoProduct) and rounded once.
    Elements with ``x == 0`` count as absorbed (``g*0 == 0``).
    """
    fmt = get_format(fmt)
    ga = np.asarray(g, dtype=np.float64)
    xa = np.asarray(x, dtype=np.float64)
    try:
        ga, xa = np.broadcast_arrays(ga, xa)
    except ValueError:
        raise ValueError(f"g and x must broadcast, got shapes {ga.shape} and {xa.shape}") from None
    ga, xa = _as_array(ga, "g"), _as_array(xa, "x")
    if not np.array_equal(round_to(xa, fmt), xa):
        raise ValueError(f"x must hold values representable in {fmt.name} (round it with round_to first)")
    p, e = two_prod(ga, xa)
    return float((round_dd(p, e, fmt) == xa).mean())
