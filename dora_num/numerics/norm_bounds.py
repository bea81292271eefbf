r"""Error bounds of the fp32 row norms of ``W + s B A`` (docs/bounds.md, lemmas 4, 4', 5):
the factored norm a priori (:func:`factored_norm_bound`) and a posteriori from its own
fp32 terms (:func:`factored_norm_posterior`, what a cancellation guard evaluates, with
:func:`lora_row_magnitudes`), and the dense norm (:func:`dense_norm_bound`).  Model and
conventions: :mod:`dora_num.numerics.bounds`; every product is an underflow site and is
charged ``eta``; ``inf`` where an intermediate may overflow fp32; never NaN.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import formulas as F
from .arithmetic import TorchFP32CorrectSqrt
from .formats import FORMATS
from .standard_model import ETA32, TINY32, U32, U64, finite64, gamma, pw, up32


def _underflow_sites(X, Y) -> np.ndarray:
    """``n[j, k] = #{i : 0 < |X_ji Y_ki| < 2^-126}``: the products of ``X @ Y.T`` that may underflow fp32."""
    n = np.empty((X.shape[0], Y.shape[0]))
    aX = np.abs(X)
    for k in range(Y.shape[0]):
        P = aX * np.abs(Y[k])
        n[:, k] = ((P > 0) & (P < TINY32)).sum(axis=1)
    return n


def _factored_parts(W, A, B, s, tensor_core_products):
    """Exact terms (float64, with their evaluation error) and a-priori term error bounds
    of the factored norm (lemma 4, docs/bounds.md)."""
    W, A, B = (finite64(n, x) for n, x in (("W", W), ("A", A), ("B", B)))
    d, r = W.shape[1], A.shape[0]
    u, eta = U32, ETA32
    s, two_s, s_sq = F.scale_constants(s)
    ss = s * s  # the exact s^2 (exact in float64) of the exact norm
    aW, aA, aB = np.abs(W), np.abs(A), np.abs(B)
    # magnitudes (float64, relative evaluation error <= gamma64_{d + 2r + 2}: absorbed by the final inflation)
    base = (W * W).sum(1)
    WA = aW @ aA.T  # [d_out, r]: (|W| |A|^T)
    AA = aA @ aA.T  # [r, r]
    M_c = (aB * WA).sum(1)
    M_a = ((aB @ AA) * aB).sum(1)  # || |B| |A| ||^2
    cross = (B * (W @ A.T)).sum(1)
    ba = ((B @ A) ** 2).sum(1)
    # products exact on tensor cores (16-bit inputs) but the accumulator may truncate: 2u per addition
    dp = 2 * d if tensor_core_products else d
    add_abs = (d - 1) * TINY32 if tensor_core_products else 0.0  # a subnormal partial sum flushed to 0
    n_base = ((W != 0) & (W * W < TINY32)).sum(1)  # squares that may underflow
    n_U = _underflow_sites(W, A)  # [d_out, r]
    n_G = _underflow_sites(A, A)  # [r, r]
    g_b, g_c, g_a = gamma(d, u), gamma(dp + r, u), gamma(dp + 2 * r, u)
    # |U^ - U| <= gamma_dp (|W||A|^T) + (1 + gamma_dp)(n_U eta + add_abs); the r products B*U^, r - 1 adds
    uf_c = (1 + g_c) * ((aB * (n_U * eta + add_abs)).sum(1) + r * eta)
    uf_a = (1 + g_a) * ((aB @ (n_G * eta + add_abs)) * aB).sum(1) + (1 + g_a) * (aB.sum(1) * r * eta + r * eta)
    e_base = g_b * base + (1 + g_b) * n_base * eta
    e_cross = g_c * M_c + uf_c
    e_ba = g_a * M_a + uf_a
    # overflow of any intermediate (fp32): products, U, G, B G, the terms, the assembly's partial sums
    mx = FORMATS["fp32"].max
    over = (base * (1 + g_b) >= mx) | (WA.max(1, initial=0) * (1 + g_c) >= mx) | (M_c * (1 + g_c) >= mx) \
        | ((aB @ AA).max(1, initial=0) * (1 + g_a) >= mx) | (M_a * (1 + g_a) >= mx) \
        | ((aW.max(1, initial=0) ** 2) >= mx) | (AA.max(initial=0) * (1 + g_a) >= mx)
    S_hat = (base + e_base) + abs(two_s) * (M_c + e_cross) + s_sq * (M_a + e_ba)
    over |= S_hat * (1 + u) ** 3 >= mx
    # float64 evaluation of the exact Q = base + 2s cross + s^2 ba (all products exact, d + 2r + 4 roundings)
    S_mag = base + abs(two_s) * M_c + ss * M_a
    slack = gamma(d + 2 * r + 4, U64) * S_mag * 1.01
    Q64 = base + two_s * cross + ss * ba
    return dict(W=W, A=A, B=B, d=d, r=r, s=s, two_s=two_s, s_sq=s_sq, ss=ss, base=base, cross=cross, ba=ba,
                M_c=M_c, M_a=M_a, e_base=e_base, e_cross=e_cross, e_ba=e_ba, over=over, Q64=Q64, slack=slack,
                S_mag=S_mag)


def factored_norm_bound(W, A, B, s: float, *, tensor_core_products: bool = False) -> np.ndarray:
    r"""Lemma 4: bound on ``|factored_row_norm(W, A, B, s) - ||W + sBA||_row|`` per row.

    fp32 (``u = 2^-24``, ``eta = 2^-150``), any summation order (so the ``gamma_n`` hold
    for blocked, pairwise or FMA-based matmuls and sums alike), ``d = d_in``:

    - ``base = sum W_i^2``: ``|dbase| <= gamma_d base + (1 + gamma_d) n_b eta``, ``n_b`` the
      squares below ``2^-126`` (each an underflow site);
    - ``U = W A^T``: ``|dU_k| <= gamma_d (|W||A|^T)_k + (1 + gamma_d) n_k eta``;
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
    - ``tensor_core_products``: ``U`` and ``G`` from 16-bit W and A on CUDA
      (``torch.mm(..., out_dtype=float32)``): exact products, an accumulator that may
      truncate (``2u`` per addition: ``gamma_{2d}``) and may flush a subnormal partial
      sum to zero (``2^-126`` per addition).

    ``Q`` is evaluated in float64 (products exact, ``<= d + 2r + 4`` roundings of terms
    bounded by ``S = base + |2s| M_c + s^2 M_a``: ``gamma64_{d+2r+4} S``), taken from below
    for the ``1/sqrt(Q)`` branch (0 gives the ``sqrt(dQ)`` branch: never NaN), from above
    for ``u w``.  ``inf`` where any intermediate may overflow fp32.  Multiplied by
    ``1 + 1e-6`` (float64 evaluation of the magnitudes: ``<= (d + 2r + 8) 2^-53``
    relative, for ``d < 10^9``).  Relative to ``w`` this is ``~ gamma_d kappa / 2`` with
    ``kappa = (base + |2s cross| + s^2 ba) / Q``.
    """
    P = _factored_parts(W, A, B, s, tensor_core_products)
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


def dense_norm_bound(W, A, B, s: float) -> np.ndarray:
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
    """
    W, A, B = (finite64(n, x) for n, x in (("W", W), ("A", A), ("B", B)))
    d, r = W.shape[1], A.shape[0]
    u, eta = U32, ETA32
    s = F.scale_constants(s)[0]
    BA = B @ A
    BAabs = np.abs(B) @ np.abs(A)
    x = W + s * BA
    xmag = np.abs(W) + abs(s) * BAabs
    err_ba = gamma(r, u) * BAabs + (1 + gamma(r, u)) * r * eta
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


# --------------------------------------------------------------------------
# A-posteriori: the factored norm's own condition and error, from its fp32 terms.
# --------------------------------------------------------------------------

class PosteriorConstants(NamedTuple):
    """The fp32 constants (Python floats, each exactly an fp32 number) of
    :func:`lora_row_magnitudes` and :func:`factored_norm_posterior` for one
    ``(two_s, s_sq, d_in, r, tensor_core_products)``: computed once on the host, and
    the same values are given to the Triton tail (:mod:`dora_num.ops.kernels.norm_tail`),
    which evaluates the same sequence of fp32 operations on them."""

    two_s: float  # the kernel's 2s (signed) and s^2
    s_sq: float
    ts: float  # |2s|
    s2: float  # >= the real s^2
    na_add: float  # ||A_k|| <= sqrt((max(G_kk, 0) + na_add) * na_mul) * na_up
    na_mul: float
    na_up: float
    k_up: float  # 1 / (1 - gamma_{r+4}), rounded up: the lift of a length-r fp32 sum of non-negative terms
    r_eta: float  # r * 2^-149
    cb1: float  # (1 + g_b) d eta
    cb2: float  # 1 / (1 - g_b), rounded up, times (1 + 4u)
    gb: float  # g_b = gamma_d
    gc4: float  # g_c (1 + 4u)
    gc1: float  # 1 + g_c
    tc: float  # d eta + t  (t = (d - 1) 2^-126 on tensor cores, else 0)
    gcr: float  # (1 + g_c) r eta
    ga: float  # g_a
    ga1: float  # 1 + g_a
    gar: float  # (1 + g_a) r
    eta: float  # 2^-149
    q_s2: float  # u s_sq / (1 - u)
    q_u2: float  # (1+u)^2 - 1
    q_u3: float  # (1+u)^3 - 1
    q_eta: float  # 2 (1+u)^2 eta
    lift: float  # 1 + 2^-18
    floor: float  # 2^-144
    lo: float  # 1 - 2u
    up1: float  # 1 + u
    u: float


def posterior_constants(two_s: float, s_sq: float, *, d_in: int, r: int,
                        tensor_core_products: bool = False) -> PosteriorConstants:
    """The constants of lemma 4' (docs/bounds.md) for the fp32 ``2s``, ``s^2`` of
    :func:`~dora_num.numerics.formulas.scale_constants`, ``d_in``, ``r`` and the product
    model (``tensor_core_products``: ``U``, ``G`` from 16-bit inputs on tensor cores).
    Cached (the operator asks for them on every call)."""
    return _posterior_constants(float(two_s), float(s_sq), int(d_in), int(r), bool(tensor_core_products))


@functools.lru_cache(maxsize=256)
def _posterior_constants(two_s: float, s_sq: float, d_in: int, r: int,
                         tensor_core_products: bool) -> PosteriorConstants:
    u, eta = U32, 2.0**-149  # eta rounded up to an fp32 number
    d, r = int(d_in), int(r)
    if d < 1 or r < 0:
        raise ValueError(f"need d_in >= 1 and r >= 0, got d_in = {d}, r = {r}")
    dp = 2 * d if tensor_core_products else d
    g_b, g_c, g_a = (float(gamma(n, u)) for n in (d, dp + r, dp + 2 * r))
    g_p = float(gamma(dp, u))
    if not max(g_b, g_c, g_a) < 0.5:
        raise ValueError(f"d_in = {d}, r = {r} too large for an fp32 bound (gamma >= 1/2)")
    t_abs = (d - 1) * TINY32 if tensor_core_products else 0.0
    U = up32
    ts, sq = abs(float(two_s)), float(s_sq)
    if float(np.float32(two_s)) != float(two_s) or float(np.float32(sq)) != sq:
        raise ValueError("two_s and s_sq must be fp32 numbers (dora_num.numerics.formulas.scale_constants)")
    return PosteriorConstants(
        two_s=float(two_s), s_sq=sq, ts=ts, s2=U((sq + 2.0**-150) / (1 - u) * (1 + 2 * u)),
        na_add=U((1 + g_p) * (d * ETA32 + ((d - 1) * TINY32 if tensor_core_products else 0.0)) + 2.0**-149),
        na_mul=U(1 / (1 - g_p) * (1 + 4 * u)), na_up=U(1 + 2 * u),
        k_up=U(1 / (1 - float(gamma(r + 4, u)))), r_eta=r * 2.0**-149,
        cb1=U((1 + g_b) * d * eta), cb2=U(1 / (1 - g_b) * (1 + 4 * u)), gb=U(g_b),
        gc4=U(g_c * (1 + 4 * u)), gc1=U(1 + g_c), tc=U(d * eta + t_abs), gcr=U((1 + g_c) * r * eta),
        ga=U(g_a), ga1=U(1 + g_a), gar=U((1 + g_a) * r), eta=eta,
        q_s2=U(u * sq / (1 - u)), q_u2=U(pw(u, 2)), q_u3=U(pw(u, 3)), q_eta=U(2 * (1 + u) ** 2 * eta),
        lift=U(1 + 2.0**-18), floor=2.0**-144, lo=float(np.float32(1 - 2 * u)), up1=U(1 + u), u=u)


def _sqrt_rn(x):
    """The correctly rounded fp32 square root on every device (as the Triton tail's ``sqrt_rn``)."""
    return TorchFP32CorrectSqrt.sqrt(x)


def lora_row_magnitudes(B, G, *, d_in: int | None = None, tensor_core_products: bool = False,
                        constants: PosteriorConstants | None = None):
    r"""``(lora_abs, b_abs)``, fp32 ``[d_out]`` upper bounds, from ``B`` and the computed Gram
    ``G = A A^T`` (what the factored norm's tail holds): ``lora_abs_j >= sum_k |B_jk| ||A_k||``
    and ``b_abs_j >= sum_k |B_jk|``, the magnitudes :func:`factored_norm_posterior` needs.

    ``||A_k||^2 = G_kk`` exactly, and the computed ``G^_kk >= G_kk (1 - gamma_dp) - n eta``
    (``dp = d_in``, ``2 d_in`` on tensor cores, plus ``2^-126`` per addition there), so
    ``||A_k|| <= sqrt((G^_kk + c) / (1 - gamma_dp))`` (a correctly rounded square root, then
    raised by ``1 + 2u``); the fp32 sums of ``r`` non-negative products, in any order, are then
    raised by ``1 / (1 - gamma_{r+4})`` and ``r`` underflows.  Cost: two length-``r``
    reductions per row.  ``d_in``: the inner dimension of ``G`` (``A.shape[1]``), or the
    ``constants`` of :func:`posterior_constants`."""
    import torch

    B = torch.as_tensor(B).detach().float()
    G = torch.as_tensor(G).detach().float().to(B.device)
    r = B.shape[1]
    if constants is None:
        if d_in is None:
            raise ValueError("lora_row_magnitudes needs d_in (the inner dimension of G = A A^T)")
        constants = posterior_constants(1.0, 0.25, d_in=d_in, r=r, tensor_core_products=tensor_core_products)
    C = constants
    diag = torch.diagonal(G).clamp_min(0)
    nA = _sqrt_rn((diag + C.na_add) * C.na_mul) * C.na_up
    aB = B.abs()
    lora_abs = (aB @ nA) * C.k_up + C.r_eta
    b_abs = aB.sum(1) * C.k_up
    return lora_abs, b_abs


def factored_norm_posterior(base, cross, ba, two_s: float, s_sq: float, *, d_in: int, r: int,
                            lora_abs, b_abs, tensor_core_products: bool = False):
    r"""Lemma 4' (the cancellation guard's bound): per row, from the factored norm's own
    fp32 terms, ``(kappa, rel)``, fp32 tensors ``[d_out]``:

    - ``kappa = (base^ + |2s cross^| + s_sq ba^) / Q^``, the condition of the assembly from
      the computed terms, ``Q^`` the fp32 ``fl(fl(s_sq ba^) + fl(fl(2s cross^) + base^))``
      of :func:`~dora_num.numerics.formulas.norm_assembly` (``inf`` where ``Q^ <= 0``; 1 where
      all three terms are 0);
    - ``rel``: a guaranteed bound on ``|w^ - w| / w`` for the computed ``w^ = RN(sqrt(max(Q^, 0)))``
      and the exact ``w = ||W + s BA||_row`` (real ``s^2``), valid although the terms are
      themselves rounded; ``inf`` where no finite bound exists (``Q`` may be 0 within the
      terms' errors, e.g. a zero row or a row whose squares all underflow: such a row must be
      recomputed, e.g. by the dense norm).

    Inputs: ``base``, ``cross``, ``ba`` as the kernel holds them (fp32 ``[d_out]``),
    ``two_s``, ``s_sq`` its fp32 constants, ``d_in``, ``r``, ``tensor_core_products`` (``U``, ``G``
    from tensor-core products of 16-bit inputs), and the row magnitudes of
    :func:`lora_row_magnitudes` (``lora_abs >= sum_k |B_k| ||A_k||``, ``b_abs >= sum_k |B_k|``):
    the term errors are relative to ``M_c = sum_k |B_k| (|W||A_k|) <= sqrt(base) lora_abs``
    (Cauchy-Schwarz per k) and ``M_a = || |B||A| ||^2 <= lora_abs^2``, not to ``|cross|`` or
    ``ba``, which may cancel; without them no bound from the terms alone exists.

    Derivation (docs/bounds.md, lemma 4'): with ``b <= b_up = (base^ + (1+g_b) d eta) /
    (1 - g_b)``, the a-priori term errors of lemma 4 become
    ``e_b <= g_b b_up + (1+g_b) d eta``, ``e_c <= g_c sqrt(b_up) lora_abs + (1+g_c)(b_abs (d eta + t)
    + r eta)``, ``e_a <= g_a lora_abs^2 + (1+g_a)(b_abs^2 (d eta + t) + (b_abs + 1) r eta)``
    (``g_b = gamma_d``, ``g_c = gamma_{dp+r}``, ``g_a = gamma_{dp+2r}``, ``t = (d-1) 2^-126`` on
    tensor cores), and ``|Q^ - Q| <= dQ = e_b + |2s| e_c + s2 e_a + (u s2 + eta) ba^ +
    ((1+u)^2-1)(base^ + s_sq ba^) + ((1+u)^3-1)|2s cross^| + 2(1+u)^2 eta`` with
    ``s2 = (s_sq + eta)/(1-u) >= s^2``.  Then ``Q >= Q_lo = Q^ - dQ > 0`` and ``Q^ >= Q_lo``, so
    ``|sqrt(Q^) - sqrt(Q)| / sqrt(Q) = |Q^ - Q| / (sqrt(Q^ Q) + Q) <= dQ / (2 Q_lo)``, and with the
    rounding of the square root ``|w^ - w| / w <= (1+u) dQ / (2 Q_lo) + u``.  Evaluated in fp32
    (about 40 operations on non-negative values, ordered so that the tiny constants multiply
    last; the constants of :func:`posterior_constants`): ``dQ`` is raised by ``1 + 2^-18``
    (> ``(1+u)^40``) and by ``2^-144`` (> the underflow of the ~40 products, ``2^-150`` each),
    ``Q_lo`` lowered by ``1 - 2u``, the quotient raised by ``1 + 2^-18``.  The Triton tail
    evaluates the same sequence (bitwise equal given the same terms and magnitudes:
    ``tests/ops/kernels/test_norm_tail.py``).
    """
    import torch

    C = posterior_constants(two_s, s_sq, d_in=d_in, r=r, tensor_core_products=tensor_core_products)
    base, cross, ba = (torch.as_tensor(x).float() for x in (base, cross, ba))
    lora_abs = torch.as_tensor(lora_abs).float().to(base.device)
    b_abs = torch.as_tensor(b_abs).float().to(base.device)
    return posterior_from_terms(base, cross, ba, lora_abs, b_abs, C)


def posterior_from_terms(base, cross, ba, lora_abs, b_abs, C: PosteriorConstants):
    """``(kappa, rel)`` of :func:`factored_norm_posterior` from fp32 tensors and the constants
    ``C`` (the sequence the torch tail of :func:`dora_num.ops.norm.factored_row_norm` runs)."""
    import torch

    ab, aba = base.abs(), ba.abs()
    Qh = (C.s_sq * ba) + ((C.two_s * cross) + base)
    tcr = (C.ts * cross).abs()
    mag = ab + tcr + C.s_sq * aba
    b_up = (ab + C.cb1) * C.cb2
    e_b = b_up * C.gb + C.cb1
    e_c = _sqrt_rn(b_up) * lora_abs * C.gc4 + (b_abs * C.gc1) * C.tc + C.gcr
    e_a = (lora_abs * lora_abs) * C.ga + ((b_abs * b_abs) * C.ga1) * C.tc + ((b_abs + 1) * C.gar) * C.eta
    dQ = e_b + e_c * C.ts + e_a * C.s2 + aba * C.q_s2 + aba * C.eta \
        + (ab + C.s_sq * aba) * C.q_u2 + tcr * C.q_u3 + C.q_eta
    dQ = dQ * C.lift + C.floor
    Q_lo = (Qh - dQ) * C.lo
    ok = torch.isfinite(dQ) & torch.isfinite(Qh) & (Q_lo > 0)
    inf = torch.full_like(Qh, float("inf"))
    q = dQ / torch.where(ok, Q_lo, torch.ones_like(Q_lo))
    rel = torch.where(ok, ((q * 0.5) * C.up1 + C.u) * C.lift, inf)
    pos = torch.isfinite(Qh) & (Qh > 0)
    kappa = torch.where(pos, mag / torch.where(pos, Qh, torch.ones_like(Qh)), inf)
    kappa = torch.where(mag == 0, torch.ones_like(kappa), kappa)
    return kappa, rel
