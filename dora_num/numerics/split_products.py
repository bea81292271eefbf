r"""Products of a 16-bit ``W`` with an fp32 ``A`` on tensor cores, through a split of ``A``.

``A = inv * sum_p P_p + res`` with ``p`` pieces in W's format (:func:`split_pieces_np`, the exact
emulation of :func:`dora_num.ops.norm.split_pieces`), so ``U = inv * sum_p W P_p^T`` and
``G = A A^T`` are ``p`` tensor-core products whose element products are exact in fp32.  Their
error bounds (:func:`split_u_error`, :func:`split_gram_error`) charge the accumulation
(``gamma_{2d+p-1}``, a truncating accumulator), what the split did not keep (``|W| res^T``) and
flushed subnormal products; :func:`split_term_errors` carries them into the factored norm's
bound.  Three pieces by default (``OpConfig.split_pieces``): two bf16 pieces round the adapter
to ~17 bits inside the norm (median relative error of ``U`` 2.2e-6 against 9.8e-8, CPU,
d = 1024).  The derivation and the two-or-three measurements: docs/bounds.md, "Products
through a split of A".  The norm tail's ``B G`` from bf16 pieces of both factors (:func:`split_bg_error`, of
:func:`dora_num.ops.products.split_bg`; not yet the operator's route): docs/bounds.md, "The tail's B G on
tensor cores".
"""

from __future__ import annotations

import numpy as np

from .formats import get_format, round_to
from .standard_model import SAFE, tc_additions

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
    :func:`dora_num.ops.norm.split_mm` (docs/bounds.md)."""
    W = np.asarray(W, dtype=np.float64)
    res, S, _, inv = split_residual(A, fmt, pieces)
    d = W.shape[1]
    g = _gamma(tc_additions(d) + pieces - 1)
    P, _ = split_pieces_np(A, fmt, pieces)
    n = _flush_sites(W, P)
    aW = np.abs(W)
    mag = aW @ S.T  # of the scaled pieces: what the accumulator holds
    E = (g * inv * mag + aW @ res.T + (1 + g) * inv * (n + pieces * (d - 1)) * TINY32 + ETA32) * SAFE
    return np.where(_overflows(mag, inv, g) | ~np.isfinite(P).all(axis=(0, 2))[None, :], np.inf, E)


def _overflows(mag, inv, g) -> np.ndarray:
    """Where a partial sum (``<= (1+g) mag``) or the scaled result may overflow fp32: no bound (``inf``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return ~((mag * (1 + g) < MAX32) & (mag * inv * (1 + g) < MAX32))


def split_gram_error(A, pieces: int, fmt) -> np.ndarray:
    """Bound on ``|G^ - A A^T|`` per entry (float64 ``[r, r]``) of
    :func:`dora_num.ops.norm.split_gram` (docs/bounds.md)."""
    res, S, At, inv = split_residual(A, fmt, pieces)
    d = np.asarray(A).shape[1]
    q = pieces * pieces
    g = _gamma(tc_additions(d) + q - 1)
    P, _ = split_pieces_np(A, fmt, pieces)
    S_all = P.reshape(-1, d)
    n = _flush_sites(S_all, P).reshape(pieces, -1, P.shape[1]).sum(axis=0)  # [r, r] over the left pieces
    aAt = np.abs(At)
    mag = S @ S.T
    E = (g * inv * inv * mag + res @ aAt.T + aAt @ res.T + res @ res.T
         + (1 + g) * inv * inv * (n + q * (d - 1)) * TINY32 + 2 * ETA32) * SAFE
    finite = np.isfinite(P).all(axis=(0, 2))
    return np.where(_overflows(mag, inv * inv, g) | ~(finite[:, None] & finite[None, :]), np.inf, E)


def split_term_errors(W, A, B, pieces: int, fmt) -> tuple[np.ndarray, np.ndarray]:
    """``(e_cross, e_ba)``: bounds (float64 ``[d_out]``) on the errors of the factored norm's
    fp32 terms ``cross`` and ``ba`` when ``U`` and ``G`` come from the split products
    (docs/bounds.md); what :func:`dora_num.numerics.bounds.factored_norm_bound` charges
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


# The norm tail's ``B G`` on tensor cores (:func:`dora_num.ops.products.split_bg`): ``B`` in bf16 pieces, as many as
# hold its dtype exactly (fp32 3, fp16 2, bf16 1), and the fp32 Gram ``G`` in 3 bf16 pieces
BG_PIECES = {"fp32": 3, "fp16": 2, "bf16": 1}
G_PIECES = 3


# The norm tail kernel's ``B G`` on tensor cores (``OpConfig.tail_bg = "tensor_core"``): each tile of ``B`` and of the
# fp32 ``G`` split in registers into bf16 pieces (``B`` into BG_PIECES of its dtype, ``G`` into 3), and only the
# piece products ``PB_p PG_q`` with ``p + q <= TAIL_BG_ORDER`` (1-based) summed, all into one fp32 accumulator:
# what is left out is below ``2u |B||G|`` (tail_bg_coefficients), a sixth or less of the products' own
# accumulation charge at any rank, and it saves a third of the products for an fp32 B (6 of 9)
TAIL_BG_ORDER = 4
TAIL_BG_EXACT_MIN = 2.0**-110  # fp32 values at least this large are held exactly by three bf16 pieces
_BF16_U, _BF16_SIGMA = 2.0**-8, 2.0**-134  # the pieces' unit roundoff, half their subnormal spacing


def tail_bg_pairs(b_format: str) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """``(kept, dropped)``: the piece products ``(p, q)`` (1-based: ``PB_p PG_q``) the tail kernel sums for a
    ``B`` stored as ``b_format``, and those it leaves out (``p + q > TAIL_BG_ORDER``), in the kernel's order."""
    if b_format not in BG_PIECES:
        raise ValueError(f"tail_bg_pairs: b_format must be one of {tuple(BG_PIECES)}, got {b_format!r}")
    pairs = [(p, q) for p in range(1, BG_PIECES[b_format] + 1) for q in range(1, G_PIECES + 1)]
    return (tuple(pq for pq in pairs if sum(pq) <= TAIL_BG_ORDER), tuple(pq for pq in pairs if sum(pq) > TAIL_BG_ORDER))


def _piece_factor(p: int, pieces: int) -> float:
    """``a_p`` with ``|P_p| <= a_p |x|`` for the greedy bf16 split of a value the ``pieces`` pieces hold exactly
    (``|R_q| <= u_h^q |x|``, ``|P_p| <= |R_{p-1}| + |R_p|``; a single piece is the value itself)."""
    return 1.0 if pieces == 1 else _BF16_U ** (p - 1) * (1 + _BF16_U)


def tail_bg_coefficients(r: int, b_format: str) -> dict:
    """The per-entry error model of the tail kernel's ``B G^`` on tensor cores, for a row of ``B`` whose
    values its pieces hold exactly (every row of a bf16 or fp16 ``B``; for fp32, rows without an entry in
    ``(0, 2^-110)``: :func:`tail_bg_uncertified_rows`), against ``B G^`` with the computed fp32 ``G^``
    (docs/bounds.md, "The tail's B G on tensor cores")::

        |BG^ - B G^|_jl <= (gamma_{2N} c_K + c_D) (|B||G^|)_jl + (gamma_{2N} tau_K + tau_D + sigma) b_j + flush

    ``N = len(kept) r`` exact products into one accumulator (``2u`` per addition: truncation, any order),
    ``c_X = sum_{(p,q) in X} a_p a_q`` and ``tau_X = tau sum_{(p,q) in X} a_p`` over the kept and the dropped
    pairs (``|PG_q| <= a_q |g| + tau``, ``tau = 2 sigma (1 + 2 u_h)``; ``sigma = 2^-134`` also bounds what
    G's three pieces leave), ``b_j = sum_k |B_jk|``, ``flush = (1 + gamma_{2N}) 2N 2^-126`` (each product and
    partial sum may be flushed).  Returns ``N``, ``g2N``, ``cK``, ``cD``, ``tau``, ``tauK``, ``tauD``, ``sigma``,
    ``flush``."""
    kept, dropped = tail_bg_pairs(b_format)
    pB = BG_PIECES[b_format]
    tau = 2 * _BF16_SIGMA * (1 + 2 * _BF16_U)
    n = len(kept) * int(r)
    g2n = _gamma(2 * n)

    def c(pairs):
        return sum(_piece_factor(p, pB) * _piece_factor(q, G_PIECES) for p, q in pairs)

    def t(pairs):
        return tau * sum(_piece_factor(p, pB) for p, _ in pairs)

    return dict(N=n, g2N=g2n, cK=c(kept), cD=c(dropped), tau=tau, tauK=t(kept), tauD=t(dropped), sigma=_BF16_SIGMA,
                flush=(1 + g2n) * 2 * n * TINY32)


def tail_bg_uncertified_rows(B) -> np.ndarray:
    """Rows of an fp32 ``B`` with an entry in ``(0, 2^-110)`` (``TAIL_BG_EXACT_MIN``), which three bf16
    pieces may not hold: the tail kernel gives them ``rel = inf`` (recomputed in float64 by the guard)."""
    aB = np.abs(np.asarray(B, dtype=np.float64))
    return ((aB > 0) & (aB < TAIL_BG_EXACT_MIN)).any(axis=1)


def split_bg_np(B, G, b_format: str) -> tuple[np.ndarray, np.ndarray]:
    """``(PB, PG)``: the bf16 pieces of ``B`` (``[BG_PIECES[b_format], d_out, r]``) and of ``G``
    (``[3, r, r]``) that :func:`dora_num.ops.products.split_bg` multiplies (float64 arrays holding bf16
    values; exact, as :func:`split_pieces_np`).  ``b_format``: the dtype ``B`` is stored in.  The pieces hold
    every value of ``b_format`` exactly (fp16 in two, bf16 in one), and fp32 values of at least ``2^-110`` (in
    three; below, what is left is at most ``2^-134``)."""
    if b_format not in BG_PIECES:
        raise ValueError(f"split_bg_np: b_format must be one of {tuple(BG_PIECES)}, got {b_format!r}")
    return split_pieces_np(B, "bf16", BG_PIECES[b_format])[0], split_pieces_np(G, "bf16", G_PIECES)[0]


def split_bg_error(B, G, b_format: str) -> np.ndarray:
    """Bound on ``|BG^ - B G|`` per entry (float64 ``[d_out, r]``) of
    :func:`dora_num.ops.products.split_bg`, for the fp32 matrices ``B`` (holding values of ``b_format``)
    and ``G`` it is given (docs/bounds.md, "The tail's B G on tensor cores").

    With ``B = sum_p PB_p + res_B`` and ``G = sum_q PG_q + res_G`` (bf16 pieces; ``res`` nonzero only for
    fp32 values below ``2^-110``, at most ``2^-134``), block ``q`` of the one product ``[PB_1 ... PB_pB] [PG_q; ...; PG_q]``
    sums ``K = pB r`` exact products on a tensor core (``tc_additions(K)`` roundings of ``u``: an
    accumulator that may truncate), and the three blocks are added in fp32 (two roundings)::

        |BG^ - BG| <= gamma_{tc_additions(K) + 2} S_B S_G + res_B |G~| + |B~| res_G + res_B res_G
                      + (1 + gamma) (n + 3 K) 2^-126

    ``S_X = sum |pieces of X|``, ``X~ = sum of the pieces``, ``n`` the products below ``2^-126``
    (each may be flushed), ``3 K`` the partial sums that may be (``3 (K - 1)`` in the blocks, two block
    sums).  Evaluated in float64 and raised by ``SAFE = 1 + 2^-40`` (every term is non-negative, so that covers
    the evaluation's roundings, which may otherwise swallow the flush term beside a larger residual).  Assumes
    the tensor core keeps subnormal bf16 inputs (a piece of a value below ``2^-110`` may be one; the kit probes
    it: :func:`dora_num.numerics.accumulation.subnormal_input_probe`).  ``inf`` where a partial sum may overflow
    fp32 or a piece is not finite (an fp32 value of at least ``(2 - 2^-8) 2^127`` rounds to an infinite first
    piece)."""
    B = np.asarray(B, dtype=np.float64)
    G = np.asarray(G, dtype=np.float64)
    PB, PG = split_bg_np(B, G, b_format)
    res_B, res_G = np.abs(B - PB.sum(axis=0)), np.abs(G - PG.sum(axis=0))
    S_B, S_G = np.abs(PB).sum(axis=0), np.abs(PG).sum(axis=0)
    K = PB.shape[0] * B.shape[1]
    g = _gamma(tc_additions(K) + G_PIECES - 1)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing magnitudes: inf, then no bound (below)
        n = sum(_flush_sites(PB[p], PG.transpose(0, 2, 1)) for p in range(PB.shape[0]))
        mag = S_B @ S_G
        E = (g * mag + res_B @ np.abs(PG.sum(axis=0)) + np.abs(PB.sum(axis=0)) @ res_G + res_B @ res_G
             + (1 + g) * (n + G_PIECES * K) * TINY32) * SAFE
    finite = np.isfinite(PB).all(axis=(0, 2))[:, None] & np.isfinite(PG).all(axis=(0, 1))[None, :]
    return np.where(_overflows(mag, 1.0, g) | ~finite, np.inf, E)


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
    (an accumulator at the edge of the bound's model: ``d - 1`` additions, ``2u`` each, in sequence; one that
    rounds away from zero is admitted too, and on some inputs errs more),
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
