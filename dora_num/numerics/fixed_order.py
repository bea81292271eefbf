"""Float64 products and sums in a fixed order, the same on every CPU.

BLAS (OpenBLAS behind numpy's ``@``, ``np.dot``, ``np.linalg.norm`` of a vector,
``np.polyfit``) picks its kernel by CPU, and with it the order of the additions of
an inner product: the last bits of a float64 result move from machine to machine
(measured: ``OPENBLAS_CORETYPE=Haswell`` vs the native SkylakeX kernel changes the
a-priori norm bounds in their 16th digit).  Elementwise float64 operations are
correctly rounded whatever SIMD width runs them, and numpy's pairwise ``sum`` of a
contiguous axis has a fixed tree, so the functions here are built from those only.
"""

from __future__ import annotations

import math

import numpy as np


def matmul(X, Y) -> np.ndarray:
    """``X @ Y`` (float64), the inner dimension accumulated left to right.

    One elementwise multiply-add over the whole output per inner index
    ``k = 0, 1, ...``: ``X.shape[1]`` passes over an output-sized array (cheap when
    the inner dimension or the output is small, as in the bound evaluations)."""
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    if X.ndim != 2 or Y.ndim != 2 or X.shape[1] != Y.shape[0]:
        raise ValueError(f"matmul needs [m, k] @ [k, n], got {X.shape} @ {Y.shape}")
    out = np.zeros((X.shape[0], Y.shape[1]))
    for k in range(X.shape[1]):
        out += X[:, k, None] * Y[None, k, :]
    return out


def dot(a, b) -> float:
    """``sum(a * b)``: the float64 products, then their correctly rounded sum (``math.fsum``)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"dot needs vectors of one length, got {a.shape} and {b.shape}")
    return math.fsum((a * b).tolist())


def norm(a) -> float:
    """Euclidean norm: ``sqrt`` of the correctly rounded sum of the float64 squares."""
    return math.sqrt(dot(a, a))


def slope(x, y) -> float:
    """Least-squares slope of ``y`` on ``x`` (what ``np.polyfit(x, y, 1)[0]`` estimates),
    from correctly rounded sums: ``sum (x - mx)(y - my) / sum (x - mx)^2``."""
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if x.size != y.size or x.size < 2:
        raise ValueError(f"slope needs two vectors of one length >= 2, got {x.size} and {y.size}")
    dx = x - math.fsum(x.tolist()) / x.size
    dy = y - math.fsum(y.tolist()) / y.size
    return dot(dx, dy) / dot(dx, dx)
