r"""Error bounds of the fp32 row norms of ``W + s B A`` (docs/bounds.md, lemmas 4, 4', 5):
the factored norm a priori (:func:`factored_norm_bound`) and a posteriori from its own
fp32 terms (:func:`factored_norm_posterior`, what the cancellation guard evaluates, with
:func:`lora_row_magnitudes`: :mod:`dora_num.numerics.norm_posterior`, re-exported here), and the
dense norm (:func:`dense_norm_bound`).  Model and conventions: :mod:`dora_num.numerics.bounds`;
every product is an underflow site and is charged ``eta``; ``inf`` where an intermediate may
overflow fp32; never NaN.
"""

from __future__ import annotations

import numpy as np

from . import fixed_order as fo
from . import formulas as F
from .formats import FORMATS
from .standard_model import ETA32, TINY32, U32, U64, finite64, gamma, pw, tc_additions, up32


def _underflow_sites(X, Y) -> np.ndarray:
    """``n[j, k] = #{i : 0 < |X_ji Y_ki| < 2^-126}``: the products of ``X @ Y.T`` that may underflow fp32."""
    n = np.empty((X.shape[0], Y.shape[0]))
    aX = np.abs(X)
    for k in range(Y.shape[0]):
        P = aX * np.abs(Y[k])
        n[:, k] = ((P > 0) & (P < TINY32)).sum(axis=1)
    return n


def _factored_parts(W, A, B, s, products: str):
    """Exact terms (float64, with their evaluation error) and a-priori term error bounds
    of the factored norm (lemma 4, docs/bounds.md) under the product model ``products``."""
    W, A, B = (finite64(n, x) for n, x in (("W", W), ("A", A), ("B", B)))
    d, r = W.shape[1], A.shape[0]
    u, eta = U32, ETA32
    s, two_s, s_sq = F.scale_constants(s)
    ss = s * s  # the exact s^2 (exact in float64) of the exact norm
    aW, aA, aB = np.abs(W), np.abs(A), np.abs(B)
    # magnitudes (float64, relative evaluation error <= gamma64_{d + 2r + 2}: absorbed by the final inflation)
    base = (W * W).sum(1)
    # products in a fixed order (numerics.fixed_order, not BLAS): the same bits on every CPU
    WA = fo.matmul(aW, aA.T)  # [d_out, r]: (|W| |A|^T)
    AA = fo.matmul(aA, aA.T)  # [r, r]
    M_c = (aB * WA).sum(1)
    BAA = fo.matmul(aB, AA)
    M_a = (BAA * aB).sum(1)  # || |B| |A| ||^2
    cross = (B * fo.matmul(W, A.T)).sum(1)
    ba = (fo.matmul(B, A) ** 2).sum(1)
    # per entry of U and G: |dU_jk| <= c (|W||A|^T)_jk + abs_jk (lemma 4's product models)
    n_base = ((W != 0) & (W * W < TINY32)).sum(1)  # squares that may underflow
    if products == "fp64":  # float64 sums of exact products, rounded once to fp32 (one underflow site)
        c = u + (1 + u) * gamma(2 * d, U64)
        abs_U, abs_G = np.full((W.shape[0], r), eta), np.full((r, r), eta)
    else:
        tc = products == "tensor_core"  # exact products, an accumulator that may truncate and flush partial sums
        c = gamma(tc_additions(d) if tc else d, u)
        add_abs = (d - 1) * TINY32 if tc else 0.0
        # an underflow (or a flushed partial sum) enters the sum once and then passes through the later
        # additions, each a (1 + delta): at most d - 1 of them (fp32), tc_additions(d) on tensor cores
        carry = 1 + (gamma(tc_additions(d), u) if tc else gamma(d - 1, u))
        abs_U = carry * (_underflow_sites(W, A) * eta + add_abs)  # [d_out, r]: every product an underflow site
        abs_G = carry * (_underflow_sites(A, A) * eta + add_abs)  # [r, r]
    g_b, g_r, g_2r = gamma(d, u), gamma(r, u), gamma(2 * r, u)
    g_c, g_a = g_r + (1 + g_r) * c, g_2r + (1 + g_2r) * c
    # cross = sum_k B_k U^_k (r products, r - 1 additions); ba = sum_l (B G^)_l B_l (r more of each)
    uf_c = (1 + g_r) * ((aB * abs_U).sum(1) + r * eta)
    uf_a = (1 + g_2r) * ((fo.matmul(aB, abs_G) * aB).sum(1) + aB.sum(1) * r * eta + r * eta)
    e_base = g_b * base + (1 + g_b) * n_base * eta
    e_cross = g_c * M_c + uf_c
    e_ba = g_a * M_a + uf_a
    # overflow of any intermediate (fp32): products, U, G, B G, the terms, the assembly's partial sums
    mx = FORMATS["fp32"].max
    over = (base * (1 + g_b) >= mx) | (WA.max(1, initial=0) * (1 + g_c) >= mx) | (M_c * (1 + g_c) >= mx) \
        | (BAA.max(1, initial=0) * (1 + g_a) >= mx) | (M_a * (1 + g_a) >= mx) \
        | ((aW.max(1, initial=0) ** 2) >= mx) | (AA.max(initial=0) * (1 + g_a) >= mx)
    S_hat = (base + e_base) + abs(two_s) * (M_c + e_cross) + s_sq * (M_a + e_ba)
    over |= S_hat * (1 + u) ** 3 >= mx
    # float64 evaluation of the exact Q = base + 2s cross + s^2 ba (all products exact, d + 2r + 4 roundings)
    S_mag = base + abs(two_s) * M_c + ss * M_a
    slack = gamma(d + 2 * r + 4, U64) * S_mag * 1.01
    Q64 = base + two_s * cross + ss * ba
    return dict(W=W, A=A, B=B, d=d, r=r, s=s, two_s=two_s, s_sq=s_sq, ss=ss, base=base, cross=cross, ba=ba,
                M_c=M_c, M_a=M_a, e_base=e_base, e_cross=e_cross, e_ba=e_ba, over=over, Q64=Q64, slack=slack,
                S_mag=S_mag, AA=AA, E_G=c * AA + abs_G)


def _tail_bg_e_ba(B, AA, E_G, b_format: str) -> tuple[np.ndarray, np.ndarray]:
    """``(e_ba, over)``: the bound on ``|ba^ - ba|`` per row (float64 ``[d_out]``) where the tail kernel forms
    ``B G^`` on tensor cores from bf16 pieces (``OpConfig.tail_bg = "tensor_core"``; docs/bounds.md, "The tail's
    B G on tensor cores"), given ``AA = |A||A|^T`` and a per-entry bound ``E_G`` on ``|G^ - G|``, and the rows
    where an intermediate may overflow fp32.  With ``|G^| <= Gm = AA + E_G``, ``H = B G^`` and the kernel's sum
    ``ba^ = fl(sum_l BG^_l B_l)``::

        |ba^ - ba| <= gamma_r |B| Gm |B|^T + (1 + gamma_r) sum_l |B_l| |BG^_l - H_l|
                      + |B| E_G |B|^T + (1 + gamma_r) r eta

    with ``|BG^ - H|`` from B's own pieces (what they leave, ``res_B``, charged exactly, so every row of an fp32
    B is bounded here, those with entries below ``2^-110`` too) and G's bounded ones
    (:func:`~dora_num.numerics.split_products.tail_bg_coefficients`)."""
    from .split_products import (BG_PIECES, G_PIECES, _piece_factor, split_pieces_np, tail_bg_coefficients,
                                 tail_bg_pairs)

    u, eta = U32, ETA32
    r = B.shape[1]
    aB = np.abs(B)
    b_abs = aB.sum(1)
    k = tail_bg_coefficients(r, b_format)
    kept, dropped = tail_bg_pairs(b_format)
    pB = BG_PIECES[b_format]
    with np.errstate(over="ignore", invalid="ignore"):
        PB = split_pieces_np(B, "bf16", pB)[0] if pB > 1 else B[None].copy()
        Bt = PB.sum(axis=0)
        res_B = np.abs(B - Bt)
        tau = k["tau"]

        def weighted(pairs):  # sum over pairs of a_q |PB_p| and of |PB_p|
            S = sum((_piece_factor(q, G_PIECES) * np.abs(PB[p - 1]) for p, q in pairs), np.zeros_like(B))
            T = sum((np.abs(PB[p - 1]) for p, _ in pairs), np.zeros_like(B))
            return S, T

        SK, TK = weighted(kept)
        SD, TD = weighted(dropped)
        Gm = AA + E_G
        g_r = gamma(r, u)
        H_err = ((((k["g2N"] * SK + SD) @ Gm) * aB).sum(1) + tau * b_abs * (k["g2N"] * TK + TD).sum(1)
                 + ((res_B @ Gm) * aB).sum(1) + k["sigma"] * b_abs * np.abs(Bt).sum(1) + k["flush"] * b_abs)
        e_ba = g_r * ((aB @ Gm) * aB).sum(1) + (1 + g_r) * H_err + ((aB @ E_G) * aB).sum(1) + (1 + g_r) * r * eta
        mx = FORMATS["fp32"].max
        piece_max = (2 - 2.0**-8) * 2.0**127  # a first bf16 piece of anything at least this large is infinite
        over = ~np.isfinite(e_ba) | ((SK @ Gm).max(1, initial=0) * (1 + k["g2N"]) >= mx) \
            | (aB.max(1, initial=0) >= piece_max) | bool(Gm.max(initial=0) >= piece_max)
    return np.where(over, np.inf, e_ba), over


def factored_norm_bound(W, A, B, s: float, *, tensor_core_products: bool = False, split_pieces: int | None = None,
                        split_format: str = "bf16", products: str | None = None,
                        tail_bg: str | None = None) -> np.ndarray:
    r"""Lemma 4: bound on ``|factored_row_norm(W, A, B, s) - ||W + sBA||_row|`` per row.

    fp32 (``u = 2^-24``, ``eta = 2^-150``), any summation order (so the ``gamma_n`` hold
    for blocked, pairwise or FMA-based matmuls and sums alike), ``d = d_in``:

    - ``base = sum W_i^2``: ``|dbase| <= gamma_d base + (1 + gamma_d) n_b eta``, ``n_b`` the
      squares below ``2^-126`` (each an underflow site);
    - ``U = W A^T``: ``|dU_k| <= gamma_d (|W||A|^T)_k + (1 + gamma_{d-1}) n_k eta`` (each of the
      ``n_k`` underflows passes through at most ``d - 1`` later additions);
      ``cross = sum_k B_k U_k``: ``|dcross| <= gamma_{d+r} M_c + (1 + gamma_{d+r})
      (sum_k |B_k| n_k eta + r eta)`` with ``M_c = sum_k |B_k| (|W||A|^T)_k``;
    - ``G = A A^T``, ``ba = sum (B G) * B``: ``|dba| <= gamma_{d+2r} M_a + (underflow of
      the r^2 d products of G, the r^2 of B G, the r of the last products)`` with
      ``M_a = || |B||A| ||^2``;
    - assembly (fp32, no contraction, correctly rounded sqrt):
      ``t = fl(fl(2s*cross^) + base^)``, ``Q^ = fl(fl(s_sq*ba^) + t)`` against the exact
      ``Q = base + 2s cross + s^2 ba`` with the *real* ``s^2``: ``|Q^ - Q| <= dQ`` =
      term errors + ``|s_sq - s^2| |ba^|`` (``<= u s^2 |ba^|``: an rsLoRA ``s`` whose
      square is inexact) + ``((1+u)^2-1)(|base^| + s_sq|ba^|) + ((1+u)^3-1)|2s cross^|
      + 2(1+u)^2 eta``;
    - ``|w^ - w| <= (1+u) min(dQ / sqrt(Q), sqrt(dQ)) + u w`` (max(., 0) is 1-Lipschitz).
    - ``products`` (the model of :func:`dora_num.ops.products.product_model`; without it
      ``"split"`` if ``split_pieces``, ``"tensor_core"`` if ``tensor_core_products``, else
      ``"fp32"``): ``"fp32"`` as above; ``"fp64"``: ``U``, ``G`` accumulated in float64 and
      rounded once, ``|dU_jk| <= (u + gamma64_{2d}) (|W||A|^T)_jk + eta`` (one underflow site per
      entry); ``"tensor_core"``: ``U`` and ``G`` from 16-bit W and A on CUDA
      (``torch.mm(..., out_dtype=float32)``): exact products, an accumulator that may
      truncate (``2u`` per addition: ``gamma_{2d}``) and may flush a subnormal partial
      sum to zero (``2^-126`` per addition); the absolute part ``n eta + (d - 1) 2^-126`` times
      ``1 + gamma_{n+}`` (the later additions).  The tail's own sums add ``gamma_r`` to ``cross``
      and ``gamma_{2r}`` to ``ba`` on top of the entry errors (``gamma_r + (1 + gamma_r) c``).
    - ``split_pieces``: ``U`` and ``G`` from a 16-bit W (format ``split_format``) and an A of
      another dtype split into that many pieces of W's format
      (:func:`dora_num.ops.norm.split_mm`); the errors of ``cross`` and ``ba`` are then those
      of :func:`dora_num.numerics.split_products.split_term_errors` (docs/bounds.md
      derives them, underflow and flushed partial sums included), in place of the
      ``gamma_{dp+r}`` and ``gamma_{dp+2r}`` terms above.
    - ``tail_bg`` (B's format, ``"fp32"``, ``"fp16"`` or ``"bf16"``): the tail forms ``B G^`` on tensor cores from
      bf16 pieces (``OpConfig.tail_bg = "tensor_core"``), and ``ba``'s error is :func:`_tail_bg_e_ba`'s.

    ``Q`` is evaluated in float64 (products exact, ``<= d + 2r + 4`` roundings of terms
    bounded by ``S = base + |2s| M_c + s^2 M_a``: ``gamma64_{d+2r+4} S``), taken from below
    for the ``1/sqrt(Q)`` branch (0 gives the ``sqrt(dQ)`` branch: never NaN), from above
    for ``u w``.  ``inf`` where any intermediate may overflow fp32.  Multiplied by
    ``1 + 1e-6`` (float64 evaluation of the magnitudes: ``<= (d + 2r + 8) 2^-53``
    relative, for ``d < 10^9``).  Relative to ``w`` this is ``~ gamma_d kappa / 2`` with
    ``kappa = (base + |2s cross| + s^2 ba) / Q``.
    """
    if products is None:
        products = "split" if split_pieces else ("tensor_core" if tensor_core_products else "fp32")
    if products not in ("fp32", "fp64", "tensor_core", "split"):
        raise ValueError(f"products must be fp32, fp64, tensor_core or split, got {products!r}")
    if products == "split" and not split_pieces:
        raise ValueError("products='split' needs split_pieces")
    P = _factored_parts(W, A, B, s, "tensor_core" if products == "split" else products)
    if products == "split":
        from .split_products import split_term_errors

        P["e_cross"], P["e_ba"] = split_term_errors(P["W"], P["A"], P["B"], split_pieces, split_format)
        if tail_bg is not None:
            from .split_products import split_gram_error

            P["E_G"] = split_gram_error(P["A"], split_pieces, split_format)
    if tail_bg is not None:
        P["e_ba"], over_t = _tail_bg_e_ba(P["B"], P["AA"], P["E_G"], tail_bg)
        P["over"] = P["over"] | over_t
    u, eta = U32, ETA32
    two_s, s_sq, ss = P["two_s"], P["s_sq"], P["ss"]
    b_hat = P["base"] + P["e_base"]
    c_hat = P["M_c"] + P["e_cross"]
    a_hat = P["M_a"] + P["e_ba"]
    d_terms = P["e_base"] + abs(two_s) * P["e_cross"] + max(ss, s_sq) * P["e_ba"]
    d_ssq = abs(s_sq - ss) * a_hat  # exact |fl32(s^2) - s^2|
    d_asm = pw(u, 2) * (b_hat + s_sq * a_hat) + pw(u, 3) * abs(two_s) * c_hat + 2 * (1 + u) ** 2 * eta
    dQ = d_terms + d_ssq + d_asm
    Q_lo = np.maximum(P["Q64"] - P["slack"], 0.0)
    w_hi = np.sqrt(np.maximum(P["Q64"] + P["slack"], 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        lin = np.where(Q_lo > 0, dQ / np.sqrt(np.where(Q_lo > 0, Q_lo, 1.0)), np.inf)
    E = ((1 + u) * np.minimum(lin, np.sqrt(dQ)) + u * w_hi) * (1 + 1e-6)
    return np.where(P["over"], np.inf, E)


# fp32 GEMM inputs rounded by torch's matmul switches (dora_num.ops.products.fp32_matmul_precision): TF32 keeps
# 10 fraction bits, oneDNN's bf16 7; 2^-10 and 2^-7 cover a conversion that truncates as well as one that rounds
MATMUL_INPUT_U = {"ieee": 0.0, "tf32": 2.0**-10, "bf16": 2.0**-7}


def dense_norm_bound(W, A, B, s: float, *, matmul: str = "ieee") -> np.ndarray:
    r"""Lemma 5: bound on ``|dense_row_norm(W, A, B, s) - ||W + sBA||_row|`` per row (fp32, torch).

    ``x = W + s (BA)`` elementwise: ``(BA)_i`` (``r`` products, each an underflow site)
    with ``|err| <= gamma_r (|B||A|)_i + (1 + gamma_r) r eta``, times ``s`` (one rounding,
    one site), plus ``W_i`` (one rounding, exact if subnormal):
    ``|x^_i - x_i| <= e_i = u|x_i| + (1+u)[|s| (1+u) err_i + u |s| |BA|_i + eta]``.
    Then ``| ||x^|| - ||x|| | <= ||e||``, and the fp32 ``vector_norm`` (``d`` squares, each an
    underflow site when ``|x^_i| < 2^-63``, summed in any order, then a square root
    within one ulp of the correctly rounded one: relative ``<= 3u``) adds, with
    ``S = ||x^||^2``, ``dS = gamma_d S + (1 + gamma_d) n_sq eta``:
    ``(1 + 3u) min(dS / sqrt(S), sqrt(dS)) + 3u sqrt(S)``.  The cancellation happens
    elementwise, before squaring: ``||e|| / ||x|| ~ u ||W|| / ||x|| = u sqrt(~kappa)``,
    so the dense norm degrades like ``sqrt(kappa)`` where the factored one degrades like
    ``kappa``.  ``inf`` where an element or the sum of squares may overflow fp32.
    Evaluated in float64 (``x`` with error ``gamma64_{r+2}`` of its magnitude, added to
    ``e``), times ``1 + 1e-6``.

    ``matmul``: what the fp32 GEMM ``B @ A`` computes under torch's switches (``"ieee"``,
    ``"tf32"``, ``"bf16"``: :func:`dora_num.ops.products.fp32_matmul_precision`).  Reduced: each
    input is rounded with unit ``u_in`` (:data:`MATMUL_INPUT_U`) and a subnormal one may be flushed
    (``< 2^-126``), the products are exact, the accumulator is charged ``2u`` per addition and may
    flush each partial sum: ``err_i = ((1+u_in)^2 (1 + gamma_{2r}) - 1)(|B||A|)_i + (1 + gamma_{2r})
    (1 + u_in) 2^-126 (sum_k |A_ki| + sum_k |B_jk| + r 2^-126) + r 2^-126``.
    """
    W, A, B = (finite64(n, x) for n, x in (("W", W), ("A", A), ("B", B)))
    if matmul not in MATMUL_INPUT_U:
        raise ValueError(f"matmul must be one of {tuple(MATMUL_INPUT_U)}, got {matmul!r}")
    d, r = W.shape[1], A.shape[0]
    u, eta = U32, ETA32
    s = F.scale_constants(s)[0]
    BA = fo.matmul(B, A)  # fixed order (not BLAS): the same bits on every CPU
    BAabs = fo.matmul(np.abs(B), np.abs(A))
    x = W + s * BA
    xmag = np.abs(W) + abs(s) * BAabs
    if matmul == "ieee":
        err_ba = gamma(r, u) * BAabs + (1 + gamma(r, u)) * r * eta
    else:
        u_in, g2 = MATMUL_INPUT_U[matmul], gamma(2 * r, u)
        flush = (1 + u_in) * TINY32 * (np.abs(A).sum(0)[None, :] + np.abs(B).sum(1)[:, None] + r * TINY32)
        err_ba = ((1 + u_in) ** 2 * (1 + g2) - 1) * BAabs + (1 + g2) * flush + r * TINY32
    e = u * np.abs(x) + (1 + u) * (abs(s) * (1 + u) * err_ba + u * abs(s) * np.abs(BA) + eta) \
        + gamma(r + 2, U64) * xmag * 1.01
    en = np.sqrt((e * e).sum(1))
    xn = np.sqrt((x * x).sum(1))
    S_up = (xn * (1 + 1e-15) + en) ** 2
    S_lo = np.maximum(xn * (1 - 1e-15) - en, 0.0) ** 2
    n_sq = (np.abs(x) - e < 2.0**-63).sum(1)
    dS = gamma(d, u) * S_up + (1 + gamma(d, u)) * n_sq * eta
    with np.errstate(divide="ignore", invalid="ignore"):
        lin = np.where(S_lo > 0, dS / np.sqrt(np.where(S_lo > 0, S_lo, 1.0)), np.inf)
    E = (en + (1 + 3 * u) * np.minimum(lin, np.sqrt(dS)) + 3 * u * np.sqrt(S_up)) * (1 + 1e-6)
    mx = FORMATS["fp32"].max
    over = ((xmag + e).max(1, initial=0) * (1 + u) ** 2 >= mx) | (abs(s) * BAabs.max(1, initial=0) * 2 >= mx) \
        | (S_up * (1 + gamma(d, u)) >= mx)
    return np.where(over, np.inf, E)


# The a-posteriori bound (lemma 4') lives in its own module; re-exported here.
from .norm_posterior import (PosteriorConstants, factored_norm_posterior, lora_row_magnitudes,  # noqa: E402,F401
                             posterior_constants, posterior_from_terms, runtime_constants)
