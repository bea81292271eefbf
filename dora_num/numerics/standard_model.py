"""The standard model's constants and the small helpers every bound uses.

``fl(a op b) = (a op b)(1 + d) + e``, ``|d| <= u``, ``|e| <= eta``, ``d e = 0``
(docs/bounds.md, section 0).  fp32: ``U32 = 2^-24``, ``ETA32 = 2^-150`` (half the
smallest subnormal: the underflow error of a rounded product), ``TINY32 = 2^-126`` (a
product below it is an underflow site); float64: ``U64 = 2^-53``.  ``SAFE = 1 + 2^-40``
inflates a bound evaluated by a handful of float64 operations on non-negative terms.
"""

from __future__ import annotations

import numpy as np

from .formats import FORMATS

SAFE = 1.0 + 2.0**-40
U64 = 2.0**-53
U32 = FORMATS["fp32"].u
ETA32 = FORMATS["fp32"].min_subnormal / 2
TINY32 = FORMATS["fp32"].min_normal


def pw(u: float, n) -> float:
    """``(1+u)^n - 1`` (<= gamma_n): the relative error of ``n`` roundings."""
    return (1.0 + u) ** n - 1.0


def gamma(n, u: float):
    """``gamma_n = n u / (1 - n u)`` (Higham, eq. 3.8); ``inf`` where ``n u >= 1``."""
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        out = np.where(nu < 1.0, nu / np.where(nu < 1.0, 1.0 - nu, 1.0), np.inf)
    return float(out) if out.ndim == 0 else out


def finite64(name: str, x) -> np.ndarray:
    """``x`` (numpy or torch) as float64; ``ValueError`` naming ``name`` if it is not finite."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().double().numpy()
    except ImportError:  # pragma: no cover
        pass
    a = np.asarray(x, dtype=np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains non-finite values: a bound is defined for finite inputs only")
    return a


def up32(x: float) -> float:
    """The smallest fp32 value ``>= x``: a constant of an fp32-evaluated bound, rounded upwards."""
    f = np.float32(x)
    if float(f) < x:
        f = np.nextafter(f, np.float32(np.inf))
    return float(f)


# Tensor-core products over a long inner dimension are formed in column blocks of at most this many terms,
# each a fresh fp32 product, added in sequence (dora_num.ops.products): a product then passes through at most
# 2 TC_BLOCK_K + 2 ceil(d / TC_BLOCK_K) roundings' worth of the 2u-per-addition charge instead of 2 d.  8192
# keeps every layer up to d_in = 8192 one GEMM (the 8B/70B attention projections, the 8B MLP's up/gate) and
# makes the guarantee 3.5x sharper at the 70B MLP's d_in = 28,672 (docs/bounds.md, lemma 4').
TC_BLOCK_K = 8192


def tc_blocks(d: int) -> list[tuple[int, int]]:
    """The column blocks ``[(start, stop), ...]`` of a tensor-core product of inner dimension ``d``."""
    return [(b, min(b + TC_BLOCK_K, d)) for b in range(0, max(int(d), 1), TC_BLOCK_K)]


def tc_additions(d: int) -> int:
    """Additions charged ``u`` each (``2u`` for a truncating accumulator: twice this count) to a product
    of the blocked tensor-core sum of :func:`tc_blocks`: ``2 d`` for one block, ``2 (K_b + n_b)`` for
    ``n_b`` blocks of at most ``K_b`` terms (the accumulation inside a block, then the block sums)."""
    n_b = len(tc_blocks(d))
    return 2 * int(d) if n_b == 1 else 2 * (min(int(d), TC_BLOCK_K) + n_b)
