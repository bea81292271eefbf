r"""A-priori forward error bounds, as functions of the inputs.

Standard model (Higham, ASNA ch. 2-3), for each operation of a working format
with unit roundoff ``u`` and smallest subnormal ``s_min``::

    fl(a op b) = (a op b)(1 + d) + e,   |d| <= u,  |e| <= eta = s_min/2,  d*e = 0

where ``e`` (underflow) is zero for ``+`` and ``-`` (a subnormal sum is exact)
and for ``sqrt``.  ``gamma_n = n u / (1 - n u)`` bounds ``|prod (1+d_i) - 1|``
for ``n`` factors; we use the exact ``(1+u)^n - 1`` (``<= gamma_n``) evaluated
in float64.  Constants of the formula (``s``, ``2s``, ``s^2``, ``1``) are fp32
numbers; under per-op emulation of eager PyTorch an operation with such a
Python scalar is computed in fp32 and then rounded to the storage format (see
:mod:`dora_num.numerics.emulate`), so its relative error is ``u_s = (1+u)(1+2^-24) - 1``.

The bounds compare the computed output with the *exact* result for the given
inputs (``g`` the fp32 value handed in).  Notation: ``g'`` the ``g`` actually
used (``g`` or ``fl_fmt(g)``), ``dg = |g' - g|`` (exact, from the inputs),
``L = s*lora``, ``X = (g'-1) base + g' L`` (exact, with ``g'``).

**Stable compose** ``gm1 = g'-1; t = g'*(s*lora); out = gm1*base + t``::

    sl  = L(1+d1) + e1;  t = g' sl (1+d2) + e2;  p = gm1 base (1+d3) + e3
    out = (p + t)(1+d4)                                   (no contraction)
    out = (gm1 base + t)(1+d4) + e4                        (FMA)

``gm1`` is exact for ``g'`` in ``[0.5, 2]`` (Sterbenz), else one more ``(1+d0)``.
Hence ``|out - X| <= c_p |(g'-1) base| + c_t |g' L| + c_e eta`` with
``c_t = (1+u_s)(1+u)^2 - 1``, ``c_p = (1+u)^{2+k} - 1`` (``(1+u)^{1+k} - 1``
with FMA), ``k = 1`` iff ``g'`` is outside ``[0.5, 2]``;
``c_e = (|g'|(1+u) + 2)(1+u)`` (FMA: ``(|g'|(1+u) + 1)(1+u) + 1``).
No cancellation: both terms are bounded relative to their own size.

**Naive compose** ``inner = s*lora + base; out = g'*inner - base``::

    inner = (L(1+d1) + e1 + base)(1+d2);  P = g' inner (1+d3) + e3;  out = (P - base)(1+d4)
    |out - X| <= (1+u)[ c_1 |g' L| + |g'|(1+u)^2 eta + gamma_2 |g'| |L + base| + eta ] + u |X|

with ``c_1 = (1+u_s)(1+u)^2 - 1``.  With FMA (``inner = fl(L + base)``,
``out = fl(g' inner - base)``): ``|out - X| <= (1+u)(u |g'| |L + base| + |g'| eta)
+ u |X| + eta``.  The term ``~2u |base|`` against a result of size
``|g-1||base| + |L|``: the relative error grows like ``u / |g - 1|``
(catastrophic cancellation at ``g ≈ 1``).

**Final rounding** (fp32 variants) to the storage format (``u_o``, ``eta_o``)
and the ``g`` input rounding (item d)::

    |fl_o(out) - X_true| <= E_w + u_o (|X| + E_w) + eta_o + dg |L + base|

because ``X`` is affine in ``g`` with slope ``L + base``.  If any intermediate
magnitude bound reaches the working (or output) format's ``max``, overflow is
possible and the bound is ``inf`` (reported separately; not a failure of the
bound, a statement that none exists).

**Norm assembly** ``t = 2s*cross + base; t = s^2*ba + t; w = sqrt(max(t, 0))``
with exact ``Q = base + 2s cross + s^2 ba`` and ``S = |base| + |2s cross| + |s^2 ba|``::

    dQ <= ((1+u)^2-1)|base| + ((1+u_s)(1+u)^2-1)|2s cross| + ((1+u_s)(1+u)-1)|s^2 ba| + 2(1+u)^2 eta
    (FMA: dQ <= ((1+u)^2-1)(|base| + |2s cross|) + u |s^2 ba| + (2+u) eta)

plus, under per-op emulation, the input rounding ``|dbase| + |2s dcross| + s^2 |dba|``
(exact, times ``(1+u)^3``).  So ``dQ/Q <= ~2u kappa`` with the condition number
``kappa = S / |Q|`` of the sum.  ``max(., 0)`` is 1-Lipschitz and
``|sqrt(x) - sqrt(y)| <= min(|x-y| / sqrt(y), sqrt|x-y|)``, so with a correctly
rounded sqrt::

    |w^ - w| <= (1+u) min(dQ / sqrt(Q), sqrt(dQ)) + u w

``Q`` and ``w`` are evaluated in float64 from the inputs with error
``<= gamma_2(2^-53) S`` (the products are exact in float64), which the bound
absorbs (``Q`` taken from below, ``w`` from above).

All bounds are evaluated in float64 and multiplied by ``1 + 2^-40`` (each is a
handful of float64 operations on non-negative terms: relative evaluation error
``< 20 * 2^-53``).
"""

from __future__ import annotations

import numpy as np

from . import formulas as F
from .formats import FORMATS, get_format, round_to

_SAFE = 1.0 + 2.0**-40
_U64 = 2.0**-53


def _pw(u: float, n: int) -> float:
    """``(1+u)^n - 1`` (<= gamma_n)."""
    return (1.0 + u) ** n - 1.0


def _working(fmt, variant):
    fmt = get_format(fmt)
    if variant == "per_op":
        w = fmt
        u32 = FORMATS["fp32"].u
        us = (1 + w.u) * (1 + u32) - 1 if w.p < 24 else w.u
        eta = w.min_subnormal / 2 + (FORMATS["fp32"].min_subnormal / 2 if w.p < 24 else 0.0)
        return w, us, eta, None, variant == "fp32_fma"
    if variant in ("fp32", "fp32_fma"):
        w = FORMATS["fp32"]
        return w, w.u, w.min_subnormal / 2, fmt, variant == "fp32_fma"
    raise ValueError(f"variant must be per_op, fp32 or fp32_fma, got {variant!r}")


def _g_used(g, fmt, variant, g_in):
    g = np.asarray(g, dtype=np.float64)
    return round_to(g, fmt) if (variant == "per_op" or g_in == "storage") else g


def compose_bound(formula: str, base, lora, g, s: float, fmt, variant: str, g_in: str = "fp32") -> np.ndarray:
    """Bound on ``|computed - exact|`` of the compose ``formula`` (``"compose_stable"``
    or ``"compose_naive"``) evaluated by :func:`dora_num.numerics.emulate.emulate` with
    the same arguments; ``exact`` is the real result for ``g`` as given.  ``inf``
    where overflow is possible.  Derivation: module docstring."""
    if formula not in ("compose_stable", "compose_naive"):
        raise ValueError(f"formula must be compose_stable or compose_naive, got {formula!r}")
    fmt = get_format(fmt)
    w, us, eta, out_fmt, fma = _working(fmt, variant)
    u = w.u
    base, lora, g = (np.asarray(x, dtype=np.float64) for x in (base, lora, g))
    s = F.scale_constants(s)[0]
    gp = _g_used(g, fmt, variant, g_in)
    dg = np.abs(gp - g)
    L = s * lora  # exact in float64 (24-bit s times a <= 24-bit value)
    aL, ab, ag = np.abs(L), np.abs(base), np.abs(gp)
    A = np.abs((gp - 1.0) * base) * (1 + _U64)  # g'-1 exact in float64; the product rounds at most once
    T = ag * aL * (1 + _U64)  # one float64 rounding (72-bit product), taken from above
    X = np.abs((gp - 1.0) * base + gp * L) + 4 * _U64 * (A + T)  # three float64 roundings
    if formula == "compose_stable":
        k = ((gp < 0.5) | (gp > 2.0)).astype(np.float64)
        c_t = (1 + us) * (1 + u) ** 2 - 1
        if fma:
            c_p = (1 + u) ** (1 + k) - 1
            c_e = (ag * (1 + u) + 1) * (1 + u) + 1
        else:
            c_p = (1 + u) ** (2 + k) - 1
            c_e = (ag * (1 + u) + 2) * (1 + u)
        E = c_p * A + c_t * T + c_e * eta
        mags = [aL * (1 + us), T * (1 + u) ** 2, A * (1 + u) ** 2, X + E]
    else:
        Lb = aL + ab
        if fma:
            E = (1 + u) * (u * ag * Lb + ag * eta) + u * X + eta
        else:
            c1 = (1 + us) * (1 + u) ** 2 - 1
            E = (1 + u) * (c1 * T + ag * (1 + u) ** 2 * eta + _pw(u, 2) * ag * Lb + eta) + u * X
        mags = [aL * (1 + us), Lb * (1 + u) ** 2, ag * Lb * (1 + u) ** 3, X + E]
    over = np.zeros(np.broadcast(base, lora, g).shape, dtype=bool)
    for m in mags:
        over |= m >= w.max
    if out_fmt is not None:
        over |= (X + E) * (1 + out_fmt.u) >= out_fmt.max
        E = E + out_fmt.u * (X + E) + out_fmt.min_subnormal / 2
    E = (E + dg * np.abs(L + base)) * _SAFE
    return np.where(over, np.inf, E)


def assembly_bound(base_sq, cross, ba, s: float, fmt, variant: str) -> np.ndarray:
    """Bound on ``|computed - exact|`` of :func:`~dora_num.numerics.formulas.norm_assembly`
    as evaluated by ``emulate("norm_assembly", ...)``; exact = ``sqrt(max(Q, 0))`` of
    the given terms.  ``inf`` where overflow is possible.  Derivation: module docstring."""
    fmt = get_format(fmt)
    w, us, eta, _, fma = _working(fmt, variant)
    u = w.u
    b, c, a = (np.asarray(x, dtype=np.float64) for x in (base_sq, cross, ba))
    _, two_s, s_sq = F.scale_constants(s)
    Sb, Sc, Sa = np.abs(b), np.abs(two_s * c), np.abs(s_sq * a)  # exact products in float64
    S = Sb + Sc + Sa
    if fma:
        dQ = _pw(u, 2) * (Sb + Sc) + u * Sa + (2 + u) * eta
    else:
        dQ = _pw(u, 2) * Sb + ((1 + us) * (1 + u) ** 2 - 1) * Sc + ((1 + us) * (1 + u) - 1) * Sa \
            + 2 * (1 + u) ** 2 * eta
    if variant == "per_op":
        d_in = np.abs(round_to(b, w) - b) + np.abs(two_s) * np.abs(round_to(c, w) - c) \
            + s_sq * np.abs(round_to(a, w) - a)
        dQ = dQ + d_in * (1 + u) ** 3
    Q64 = b + two_s * c + s_sq * a
    Q_lo = np.maximum(Q64 - 4 * _U64 * S, 0.0)
    w_hi = np.sqrt(np.maximum(Q64 + 4 * _U64 * S, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        lin = np.where(Q_lo > 0, dQ / np.sqrt(Q_lo), np.inf)
    E = ((1 + u) * np.minimum(lin, np.sqrt(dQ)) + u * w_hi) * _SAFE
    over = S * (1 + u) ** 3 >= w.max
    return np.where(over, np.inf, E)


def assembly_condition(base_sq, cross, ba, s: float) -> np.ndarray:
    """``kappa = (|base| + |2s cross| + |s^2 ba|) / |base + 2s cross + s^2 ba|`` (inf at Q = 0)."""
    b, c, a = (np.asarray(x, dtype=np.float64) for x in (base_sq, cross, ba))
    _, two_s, s_sq = F.scale_constants(s)
    S = np.abs(b) + np.abs(two_s * c) + np.abs(s_sq * a)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(S == 0, 1.0, S / np.abs(b + two_s * c + s_sq * a))


# --------------------------------------------------------------------------
# Row norms from W, A, B in fp32 (dora_num.ops): factored vs dense.
# --------------------------------------------------------------------------

def gamma(n, u: float):
    """``gamma_n = n u / (1 - n u)`` (Higham, eq. 3.8); ``inf`` where ``n u >= 1``."""
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        out = np.where(nu < 1.0, nu / np.where(nu < 1.0, 1.0 - nu, 1.0), np.inf)
    return float(out) if out.ndim == 0 else out


def factored_norm_bound(W, A, B, s: float, *, tensor_core_products: bool = False, split_pieces: int | None = None,
                        split_format: str = "bf16") -> np.ndarray:
    r"""Bound on ``|factored_row_norm(W, A, B, s) - ||W + sBA||_row|``.

    fp32 (``u = 2^-24``), any summation order (so ``gamma_n`` holds for blocked,
    pairwise or FMA-based matmuls and sums alike), ``d = d_in``:

    - ``base = sum W_i^2``: ``|dbase| <= gamma_{d} base``;
    - ``U = W A^T``: ``|dU_k| <= gamma_d (|W| |A|^T)_k``; ``cross = sum_k B_k U_k``:
      ``|dcross| <= gamma_{d+r} sum_k |B_k| (|W||A|^T)_k``;
    - ``G = A A^T``, ``ba = sum (B G) * B``: ``|dba| <= gamma_{d+2r} (|B||A|)(|B||A|)^T``;
    - assembly: as :func:`assembly_bound` (fp32, no FMA), with the term errors
      added to ``dQ``.
    - ``tensor_core_products``: ``U`` and ``G`` from 16-bit W and A on CUDA
      (``torch.mm(..., out_dtype=float32)``), whose accumulator may truncate: ``2u``
      per addition, ``gamma'_d = gamma_{2d}``, so ``d`` becomes ``2d`` in the cross and
      Gram terms (:func:`dora_num.ops.norm._u_product`).  With ``Q = w^2``: ``dQ / Q <= ~ gamma_d kappa`` where
      ``kappa = (base + |2s cross| + s^2 ba) / w^2``: the relative error of ``w``
      grows like ``u d kappa / 2``.
    - ``split_pieces``: ``U`` and ``G`` from a 16-bit W (format ``split_format``) and an A of
      another dtype split into that many pieces of W's format
      (:func:`dora_num.ops.norm.split_mm`); the errors of ``cross`` and ``ba`` are then those
      of :func:`dora_num.numerics.split_products.split_term_errors` (its module docstring
      derives them), in place of the ``gamma_{dp+r}`` and ``gamma_{dp+2r}`` terms.
    """
    W, A, B = (np.asarray(x, dtype=np.float64) for x in (W, A, B))
    d, r = W.shape[1], A.shape[0]
    u = FORMATS["fp32"].u
    _, two_s, s_sq = F.scale_constants(s)
    aW, aA, aB = np.abs(W), np.abs(A), np.abs(B)
    base = (W * W).sum(1)
    WA = aW @ aA.T
    BA = aB @ aA
    cross_mag = (aB * WA).sum(1)
    ba_mag = (BA * BA).sum(1)
    cross = (B * (W @ A.T)).sum(1)
    ba = ((B @ A) ** 2).sum(1)
    dp = 2 * d if tensor_core_products else d  # additions charged to the products U and G
    if split_pieces:
        from .split_products import split_term_errors

        e_c, e_a = split_term_errors(W, A, B, split_pieces, split_format)
    else:
        e_c, e_a = gamma(dp + r, u) * cross_mag, gamma(dp + 2 * r, u) * ba_mag
    d_terms = gamma(d, u) * base + two_s * e_c + s_sq * e_a
    S = base + two_s * cross_mag + s_sq * ba_mag  # >= the magnitudes of the computed terms' sum
    dQ = d_terms + _pw(u, 2) * (base + d_terms) + ((1 + u) ** 3 - 1) * two_s * (cross_mag + e_c) \
        + _pw(u, 2) * s_sq * (ba_mag + e_a) + 3e-45  # + two fp32 underflow errors
    Q64 = base + two_s * cross + s_sq * ba
    slack = 1e-12 * S  # float64 evaluation of Q (d + r terms, relative error <= (d + 2r) 2^-53 of S)
    Q_lo = np.maximum(Q64 - slack, 0.0)
    w_hi = np.sqrt(Q64 + slack)
    with np.errstate(divide="ignore", invalid="ignore"):
        lin = np.where(Q_lo > 0, dQ / np.sqrt(Q_lo), np.inf)
    return ((1 + u) * np.minimum(lin, np.sqrt(dQ)) + u * w_hi) * (1 + 1e-6)


def dense_norm_bound(W, A, B, s: float) -> np.ndarray:
    r"""Bound on ``|dense_row_norm(W, A, B, s) - ||W + sBA||_row|`` (fp32, torch).

    ``x = W + s (BA)`` elementwise: ``(BA)_i`` with ``|err| <= gamma_r (|B||A|)_i``,
    times ``s`` (one rounding), plus ``W_i`` (one rounding):
    ``|x^_i - x_i| <= e_i = u |x_i| + (1+u)^2 s gamma_r (|B||A|)_i + (1+u) u s |BA|_i``.
    Then ``||x^|| - ||x|| <= ||e||`` and the fp32 ``vector_norm`` (a sum of ``d``
    squares, any order, then a square root that on CPU is within one ulp of the
    correctly rounded one, i.e. relative ``<= 3u``) adds
    ``(gamma_{d+1}/2 + 3u)(1 + ...) ||x^||``.  The cancellation happens elementwise,
    before squaring: ``||e|| / ||x|| ~ u ||W|| / ||x|| = u sqrt(~kappa)``: the dense
    norm degrades like ``sqrt(kappa)`` where the factored one degrades like ``kappa``.
    """
    W, A, B = (np.asarray(x, dtype=np.float64) for x in (W, A, B))
    d, r = W.shape[1], A.shape[0]
    u = FORMATS["fp32"].u
    s = F.scale_constants(s)[0]
    BA = B @ A
    BAabs = np.abs(B) @ np.abs(A)
    x = W + s * BA
    xmag = np.abs(W) + abs(s) * np.abs(BA)
    e = u * np.abs(x) + (1 + u) ** 2 * abs(s) * gamma(r, u) * BAabs + (1 + u) * u * abs(s) * np.abs(BA) \
        + 1e-12 * xmag  # float64 evaluation of x
    en = np.sqrt((e * e).sum(1))
    xn = np.sqrt((x * x).sum(1)) * (1 + 1e-12)
    return (en + (xn + en) * (gamma(d + 1, u) / 2 + 3 * u) * (1 + 4 * u)) * (1 + 1e-6)


# --------------------------------------------------------------------------
# The magnitude gradient dg = sum over rows of (s*lora + base) * D.
# --------------------------------------------------------------------------

def dg_max_additions(reduction: str, n_rows: int, *, block_m: int | None = None, chunk: int | None = None) -> int:
    r"""Largest number of roundable additions any one product passes through in ``dg``.

    A reduction of ``T`` terms by binary additions, in *any* order or tree
    (sequential, pairwise, cascade, vector lanes, GPU shuffles), puts each leaf
    through at most ``T - 1`` additions: that is why one bound holds for eager
    ``torch.sum`` on CPU and CUDA, whose order is an implementation detail.

    - ``"eager"``, ``"fp64"``: ``T - 1`` (any order).
    - ``"fused"`` (the kernel of :mod:`dora_num.ops.kernels.compose`): stage 1 adds
      the ``min(BLOCK_M, T)`` products of a row block in some order (``<= BLOCK_M - 1``);
      stage 2 adds the ``nb = ceil(T / BLOCK_M)`` partials in chunks of ``CHUNK``
      (``<= min(CHUNK, nb) - 1`` inside a chunk, any tree) and accumulates the
      ``ceil(nb / CHUNK)`` chunk sums in sequence into a zero accumulator (the first
      addition, ``0 + x``, is exact): ``<= ceil(nb / CHUNK) - 1``.
    """
    if isinstance(n_rows, bool) or not isinstance(n_rows, (int, np.integer)) or n_rows < 1:
        raise ValueError(f"n_rows must be a positive int, got {n_rows!r}")
    n_rows = int(n_rows)
    if reduction in ("eager", "fp64"):
        return n_rows - 1
    if reduction != "fused":
        raise ValueError(f"reduction must be eager, fused or fp64, got {reduction!r}")
    for name, v in (("block_m", block_m), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int for the fused reduction, got {v!r}")
    nb = -(-n_rows // block_m)
    return (min(block_m, n_rows) - 1) + (min(chunk, nb) - 1) + (-(-nb // chunk) - 1)


def dg_bound(s: float, lora, base, grad, reduction: str, *, block_m: int | None = None,
             chunk: int | None = None) -> np.ndarray:
    r"""Bound on ``|dg_computed - dg_exact|`` per column (float64 ``[N]``).

    ``lora``, ``base``, ``grad`` ``[T, N]`` are the stored activations and upstream
    gradient (any float format, exactly representable in float64), ``s`` the scale
    (rounded to fp32 as every path does).  ``dg_exact = sum_k (s L_k + b_k) D_k``
    in real arithmetic; the computed value follows the contract (DESIGN.md 1):
    ``inner = fl32(fl32(s*L) + b)`` (:func:`~dora_num.numerics.formulas.compose_inner`),
    products ``inner * D`` (:func:`~dora_num.numerics.formulas.compose_grad_g_terms`)
    in fp32 (``"eager"``, ``"fused"``) or exactly in float64 (``"fp64"``: 24 x 24 bits),
    then a sum in fp32 / float64 with at most ``A = dg_max_additions(...)`` additions
    per leaf.  Standard model, ``u = 2^-24``, ``eta = 2^-150`` (fp32 underflow of a
    product; sums underflow exactly)::

        inner^ = (sL(1+d1) + e1 + b)(1+d2):   |inner^ - inner| <= E = u(1+u)|sL| + u|inner| + (1+u) eta
        p^     = inner^ D (1+d3) + e3,         |d3| <= u_p,  |e3| <= eta_p
        dg^    = sum_k p^_k prod_{i <= a_k} (1 + d_i),   a_k <= A,  |d_i| <= u_s

    hence, with ``c = (1+u_p)(1+u_s)^A - 1``::

        |dg^ - dg| <= sum_k |D_k| E_k + c sum_k (|inner_k| + E_k)|D_k| + T eta_p (1+u_s)^A

    (``u_p = u_s = u``, ``eta_p = eta`` for fp32; ``u_p = eta_p = 0``, ``u_s = 2^-53`` for
    float64.)  Relative to ``|dg|`` this is ``~ (A + 2) u kappa`` with the condition
    number ``kappa = sum |inner D| / |sum inner D|`` of the reduction: the data enter
    only through ``kappa`` (about ``sqrt(T)`` for gradients of random sign) and
    through ``|sL|/|inner|``.  ``A`` is ``T - 1`` for any-order sums (eager) but
    ``~ BLOCK_M + CHUNK + T/(BLOCK_M CHUNK)`` for the fused two-stage tree, so the
    fused bound grows like ``kappa`` alone until ``T ~ 10^5`` rows.  Evaluated in
    float64 and multiplied by ``1 + 1e-9`` (a sum of ``<= 3T`` non-negative terms:
    relative evaluation error ``< 3T 2^-53``).
    """
    L, b, D = (np.asarray(x, dtype=np.float64) for x in (lora, base, grad))
    if L.ndim != 2 or L.shape != b.shape or L.shape != D.shape:
        raise ValueError(f"lora, base, grad must be [T, N] of one shape, got {L.shape}, {b.shape}, {D.shape}")
    if not (np.isfinite(L).all() and np.isfinite(b).all() and np.isfinite(D).all()):
        raise ValueError("lora, base and grad must be finite")
    T = L.shape[0]
    A = dg_max_additions(reduction, T, block_m=block_m, chunk=chunk)
    u32 = FORMATS["fp32"].u
    eta32 = FORMATS["fp32"].min_subnormal / 2
    if reduction == "fp64":
        u_p, eta_p, u_s = 0.0, 0.0, _U64
    else:
        u_p, eta_p, u_s = u32, eta32, u32
    s = F.scale_constants(s)[0]
    sL = np.abs(s * L)  # exact: 24 x 24 bits
    inner = np.abs(s * L + b) * (1 + _U64)
    E = u32 * (1 + u32) * sL + u32 * inner + (1 + u32) * eta32
    aD = np.abs(D)
    c = (1 + u_p) * (1 + u_s) ** A - 1
    bound = (aD * E).sum(0) + c * ((inner + E) * aD).sum(0) + T * eta_p * (1 + u_s) ** A
    return bound * (1 + 1e-9)
