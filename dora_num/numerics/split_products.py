r"""Products of a 16-bit ``W`` with an fp32 ``A`` on tensor cores, through a split of ``A``.

Tensor cores multiply operands of one 16-bit dtype.  The factored norm needs
``U = W A^T`` and ``G = A A^T`` with ``W`` bf16/fp16 and ``A`` fp32 (PEFT keeps adapters in
fp32).  Instead of an fp32 copy of ``W`` and an fp32 GEMM (``d_out d_in`` bytes of copy and
fp32 SIMT arithmetic, subject to torch's TF32 switches), ``A`` is split into ``p`` pieces of
W's format, ``A = inv * sum_p P_p + res`` (:func:`split_pieces_np`, the exact emulation of
:func:`dora_num.ops.norm.split_pieces`), and ``U = inv * sum_p W P_p^T``: ``p`` tensor-core
products whose element products ``W_ji P_p,ki`` are exact in fp32 (8 + 8 or 11 + 11
significand bits <= 24).

Error of ``U`` (:func:`split_u_error`).  Standard model, fp32 ``u = 2^-24``; a tensor-core
accumulator may truncate instead of rounding (``2u`` per addition) and may flush a subnormal
product or partial sum to zero (``< 2^-126`` each).  Per entry, ``d = d_in`` exact products
per piece summed with ``d - 1`` such additions, then the ``p`` block results added with
``p - 1`` fp32 additions (any order), then scaled by ``inv`` (a power of two: exact unless
the result underflows, ``eta = 2^-150``)::

    |U^ - U| <= gamma_{2d + p - 1} inv (|W| S^T)            accumulation and block sums
              + |W| res^T                                    what the split did not keep
              + (1 + gamma_{2d+p-1}) inv (n_U + p (d - 1)) 2^-126   flushed products / partial sums
              + eta

with ``S = sum_p |P_p|`` (``<= (1 + 2 u_h + 2 u_h^2) |A| / inv``, ``u_h`` the pieces' unit
roundoff) and ``n_U[j, k]`` the number of products ``0 < |W_ji P_p,ki| < 2^-126``.
(``gamma_{2(d-1)}`` of the accumulation and ``(1+u)^{p-1}`` of the block sums combine to at
most ``gamma_{2d+p-1}``.)

Error of ``G`` (:func:`split_gram_error`): ``S_all S_all^T`` is one product of ``p r`` rows,
then ``p^2`` blocks summed (``p^2 - 1`` additions), scaled by ``inv`` twice; with
``A~ = inv sum_p P_p`` (so ``A = A~ + res``, ``A A^T - A~ A~^T = res A~^T + A~ res^T + res res^T``)::

    |G^ - G| <= gamma_{2d + p^2 - 1} inv^2 (S S^T) + res |A~|^T + |A~| res^T + res res^T
              + (1 + gamma_{2d+p^2-1}) inv^2 (n_G + p^2 (d - 1)) 2^-126 + 2 eta

How the split enters the factored norm (:func:`split_term_errors`, the ``split_pieces``
argument of :func:`dora_num.numerics.bounds.factored_norm_bound`).  The tail forms
``cross = sum_k B_k U^_k`` and ``ba = sum_k (B G^)_k B_k`` in fp32 (``r`` products and
``r - 1`` additions each, in any order; ``B G^`` another ``r``)::

    |cross^ - cross| <= gamma_r M_c + (1 + gamma_r)(sum_k |B_k| E_U,k + r eta)
    |ba^ - ba|       <= gamma_{2r} M_a + (1 + gamma_{2r})(|B| E_G |B|^T + r eta (1 + sum_k |B_k|))

with ``M_c = sum_k |B_k| (|W||A|^T)_k``, ``M_a = || |B||A| ||^2`` (``|U| <= |W||A|^T``,
``|G| <= |A||A|^T``).  These replace the terms ``gamma_{2d+r} M_c`` and ``gamma_{2d+2r} M_a``
charged to 16-bit products of one dtype; relative to those, three pieces of bf16 raise the
coefficient of ``M_c`` from ``gamma_{2d+r}`` to about ``gamma_{2d+r+2} (1 + 2^-7)``, and
leave no ``res`` term for ``|A| >= 2^-110``.

Two pieces or three.  With two bf16 pieces ``res <= 2^-17 (1 + 2^-8) |A|`` adds
``|W| res^T ~ 2^-17 |W||A|^T`` to ``U``: against the accumulation's worst case
``gamma_{2d} ~ 2d u`` that is ``1 / (4d)`` relative (6% of the bound at ``d = 4096``, the whole
bound at ``d = 64``), so the a-priori bound barely notices; the *measured* error does.  CPU,
d_out = 64, r = 16, kaiming-uniform A, bf16 W ~ N(0, 1/d), fp32 accumulation rounded to
nearest (what a tensor core approximates): median relative error of ``U`` 2.0e-6 (two pieces)
against 7.1e-8 (three) at d = 256, 2.2e-6 against 9.8e-8 at d = 1024; with the truncating
accumulator of the bound 2.0e-6 against 2.9e-7 and 2.9e-6 against 1.5e-6.  Two pieces make
the products 20-30x less accurate than fp32 arithmetic, i.e. they round the adapter to ~17
bits inside the norm; three keep it as given (the products exact, the only error the fp32
accumulation).  The third piece costs half as much tensor-core work again on ``U`` (1.5x of
two pieces' flops; ``U`` is ``2 d_out d_in r`` per piece, small beside the layer's own GEMMs
at ``r << tokens``).  Hence three pieces by default (``OpConfig.split_pieces``), two kept as
the measured alternative (``tests/ops/test_split_products.py::test_two_pieces_measured_against_three``).

That comparison is one of the split's error against the accumulation's, and it holds only where
the first dominates.  The error of ``U`` from ``p`` pieces is ``W (A - A~_p)^T`` (the split's own,
exact from the inputs) plus ``U^ - W A~_p^T`` (the accumulation's); three pieces are the more
accurate where the two-piece split error is well above the accumulation error the hardware
commits.  For bf16 it is, by a margin that shrinks with ``d`` on a truncating accumulator (CPU,
d_out = 256, r = 16, A with all 24 bits random: split 2.2e-6 against accumulation 2.9e-7 at
d = 256, 7x; 2.2e-6 against 1.6e-6 at d = 1024, 1.3x; 20-30x when rounded to nearest).  For fp16
it is not: two fp16 pieces keep ``A`` to within one fp32 unit, ``res <= max(ulp32(A), inv 2^-25)``
(the second piece leaves at most one unit of the first one's remainder, or the underflow below
fp16's spacing; nothing for values of at most 23 significant bits), so
``|W| res^T <= 2u |W||A|^T + inv 2^-25 |W| 1`` sits below the accumulation's ``gamma_{2d}``.
Measured (CPU, d_out = 512, r = 16, fp16 W, A with all 24 bits random, d = 256): the two-piece
split's median relative error of ``U`` 4.0e-8 against an accumulation of 1.7e-7 (rounded to
nearest) or 3.6e-6 (truncating); on the H200 at d = 1024, on inputs of 23 bits (two pieces
exact, the products the same sum), 1.1930e-6 (two pieces) against 1.1939e-6 (three): which one
is smaller is the GEMM's accumulation order for ``2r`` or ``3r`` columns, not the split.  With
fp16 the third piece buys exactness in fp16's normal range at 1.5x the products' flops, not a
measurable accuracy.  Both variants are held to their own bounds (``split_u_error`` /
``split_gram_error`` with ``pieces``); the comparison is tested where its condition can be
checked (``tests/ops/test_layer_fastpath.py::test_gpu_third_piece_pays_where_the_two_piece_split_dominates``,
``tests/ops/test_split_products.py::test_two_fp16_pieces_keep_fp32_values_to_one_unit``).
"""

from __future__ import annotations

import numpy as np

from .formats import get_format, round_to

U32 = 2.0**-24
MAX32 = float(np.finfo(np.float32).max)
TINY32 = 2.0**-126
ETA32 = 2.0**-150
_FP16_TOP = 15  # the emulated ops.norm.split_pieces: max|A| 2^k in [2^14, 2^15)
_K_LIMIT = 126


def _gamma(n: int, u: float = U32) -> float:
    nu = n * u
    return nu / (1 - nu) if nu < 1 else float("inf")


def split_pieces_np(A, fmt, pieces: int) -> tuple[np.ndarray, float]:
    """``(P, inv)``: the exact emulation of :func:`dora_num.ops.norm.split_pieces` (float64
    arrays holding the pieces' values, ``[pieces, *A.shape]``; ``inv`` a power of two).

    ``A`` must hold fp32 values.  Every operation of the split is exact in float64 (the
    residuals are fp32 numbers, the roundings are :func:`~dora_num.numerics.formats.round_to`)."""
    fmt = get_format(fmt)
    A = np.asarray(A, dtype=np.float64)
    R = A.copy()
    inv = 1.0
    if fmt.name == "fp16":
        amax = float(np.abs(A).max(initial=0.0))
        e = int(np.frexp(amax)[1])
        k = min(max(_FP16_TOP - e, -_K_LIMIT), _K_LIMIT)
        R = R * 2.0**k
        inv = 2.0**-k
    elif fmt.name != "bf16":
        raise ValueError(f"split_pieces_np: fmt must be bf16 or fp16, got {fmt.name}")
    P = np.empty((pieces,) + A.shape)
    for p in range(pieces):
        P[p] = round_to(R, fmt)
        R = R - P[p]
    return P, inv


def split_residual(A, fmt, pieces: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """``(res, S, A_tilde, inv)``: ``res = |A - inv sum_p P_p|`` (exact), ``S = sum_p |P_p|``
    and ``A_tilde = inv sum_p P_p`` (float64; exact, the pieces being aligned 16-bit numbers)."""
    P, inv = split_pieces_np(A, fmt, pieces)
    A = np.asarray(A, dtype=np.float64)
    At = inv * P.sum(axis=0)
    return np.abs(A - At), np.abs(P).sum(axis=0), At, inv


def _flush_sites(X, P) -> np.ndarray:
    """``n[j, k] = #{(p, i) : 0 < |X_ji P_p,ki| < 2^-126}``."""
    aX = np.abs(np.asarray(X, dtype=np.float64))
    n = np.zeros((aX.shape[0], P.shape[1]))
    for p in range(P.shape[0]):
        for k in range(P.shape[1]):
            prod = aX * np.abs(P[p, k])
            n[:, k] += ((prod > 0) & (prod < TINY32)).sum(axis=1)
    return n


def split_u_error(W, A, pieces: int, fmt) -> np.ndarray:
    """Bound on ``|U^ - W A^T|`` per entry (float64 ``[d_out, r]``) of
    :func:`dora_num.ops.norm.split_mm` (module docstring)."""
    W = np.asarray(W, dtype=np.float64)
    res, S, _, inv = split_residual(A, fmt, pieces)
    d = W.shape[1]
    g = _gamma(2 * d + pieces - 1)
    P, _ = split_pieces_np(A, fmt, pieces)
    n = _flush_sites(W, P)
    aW = np.abs(W)
    mag = aW @ S.T  # of the scaled pieces: what the accumulator holds
    E = g * inv * mag + aW @ res.T + (1 + g) * inv * (n + pieces * (d - 1)) * TINY32 + ETA32
    return np.where(_overflows(mag, inv, g) | ~np.isfinite(P).all(axis=(0, 2))[None, :], np.inf, E)


def _overflows(mag, inv, g) -> np.ndarray:
    """Where a partial sum (``<= (1+g) mag``) or the scaled result may overflow fp32: no bound (``inf``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return ~((mag * (1 + g) < MAX32) & (mag * inv * (1 + g) < MAX32))


def split_gram_error(A, pieces: int, fmt) -> np.ndarray:
    """Bound on ``|G^ - A A^T|`` per entry (float64 ``[r, r]``) of
    :func:`dora_num.ops.norm.split_gram` (module docstring)."""
    res, S, At, inv = split_residual(A, fmt, pieces)
    d = np.asarray(A).shape[1]
    q = pieces * pieces
    g = _gamma(2 * d + q - 1)
    P, _ = split_pieces_np(A, fmt, pieces)
    S_all = P.reshape(-1, d)
    n = _flush_sites(S_all, P).reshape(pieces, -1, P.shape[1]).sum(axis=0)  # [r, r] over the left pieces
    aAt = np.abs(At)
    mag = S @ S.T
    E = (g * inv * inv * mag + res @ aAt.T + aAt @ res.T + res @ res.T
         + (1 + g) * inv * inv * (n + q * (d - 1)) * TINY32 + 2 * ETA32)
    finite = np.isfinite(P).all(axis=(0, 2))
    return np.where(_overflows(mag, inv * inv, g) | ~(finite[:, None] & finite[None, :]), np.inf, E)


def split_term_errors(W, A, B, pieces: int, fmt) -> tuple[np.ndarray, np.ndarray]:
    """``(e_cross, e_ba)``: bounds (float64 ``[d_out]``) on the errors of the factored norm's
    fp32 terms ``cross`` and ``ba`` when ``U`` and ``G`` come from the split products
    (module docstring); what :func:`dora_num.numerics.bounds.factored_norm_bound` charges
    with ``split_pieces``."""
    W, A, B = (np.asarray(x, dtype=np.float64) for x in (W, A, B))
    r = A.shape[0]
    aW, aA, aB = np.abs(W), np.abs(A), np.abs(B)
    M_c = (aB * (aW @ aA.T)).sum(1)
    BA = aB @ aA
    M_a = (BA * BA).sum(1)
    E_U = split_u_error(W, A, pieces, fmt)
    E_G = split_gram_error(A, pieces, fmt)
    g_r, g_2r = _gamma(r), _gamma(2 * r)
    e_cross = g_r * M_c + (1 + g_r) * ((aB * E_U).sum(1) + r * ETA32)
    e_ba = g_2r * M_a + (1 + g_2r) * (((aB @ E_G) * aB).sum(1) + r * ETA32 * (1 + aB.sum(1)))
    return e_cross, e_ba


def _round_toward_zero32(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """``RZ_fp32(hi + lo)`` for a double-double ``hi + lo`` (``|lo| <= ulp64(hi) / 2``)."""
    from .formats import round_dd

    r = round_dd(hi, lo, "fp32")
    over = (np.abs(r) > np.abs(hi)) | ((r == hi) & (np.sign(lo) == -np.sign(hi)) & (lo != 0))
    over &= r != 0
    step = np.nextafter(r.astype(np.float32), np.float32(0)).astype(np.float64)
    return np.where(over, step, r)


def mm_truncating_fp32(a, b) -> np.ndarray:
    """An emulated tensor core: ``a @ b`` (float64 arrays of 16-bit values, ``[m, d] @ [d, n]``)
    with exact products, summed left to right in fp32 with every addition truncated toward zero
    (the worst accumulator the bound admits: ``d - 1`` additions, ``2u`` each, in sequence),
    and subnormal products and partial sums flushed to zero.  Returns float64 holding fp32."""
    from .formats import two_prod, two_sum

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    acc = np.zeros((a.shape[0], b.shape[1]))
    for i in range(a.shape[1]):
        p = a[:, i : i + 1] * b[i : i + 1, :]  # exact: <= 22 significand bits
        p = np.where(np.abs(p) < TINY32, 0.0, p)
        hi, lo = two_sum(acc, p)
        acc = _round_toward_zero32(hi, lo)
        acc = np.where(np.abs(acc) < TINY32, 0.0, acc)
    return acc
