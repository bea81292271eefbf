r"""A-priori (and, for the factored norm's guard, a-posteriori) forward error bounds.

Every bound holds on the whole input domain of its formula (finite inputs of the
formats involved: gradual underflow, subnormals, cancellation, fp32-inexact scale
constants, zero rows) or returns ``inf`` where no finite bound exists (an
intermediate or a partial sum may overflow, a result may saturate); never NaN.
Non-finite inputs raise ``ValueError``.  The numbered lemmas with their derivations
are typeset in ``docs/bounds.md``; each function below names its lemma.

Standard model (Higham, ASNA ch. 2-3), for each operation of a working format
with unit roundoff ``u`` and smallest subnormal ``s_min``::

    fl(a op b) = (a op b)(1 + d) + e,   |d| <= u,  |e| <= eta = s_min/2,  d*e = 0

where ``e`` (underflow) can be nonzero only for ``*``, ``/`` and a contracted ``a*b + c``
whose exact result is below the smallest normal; a sum or difference of two floats
that lands in the subnormal range is exact, and so is ``sqrt`` there.  So every
product (square) is an underflow *site* that may add ``eta``: the bounds count the
sites (``d`` squares in a row sum, ``d`` products per entry of ``W A^T`` and so on) and
charge ``eta`` for each, never a fixed number.  ``gamma_n = n u / (1 - n u)`` bounds
``|prod (1+d_i) - 1|`` for ``n`` factors (we use ``(1+u)^n - 1 <= gamma_n`` where the
count is small).  Constants of a formula are fp32 numbers: ``s = fl32(scale)``, ``2s``
exact, ``s^2 = fl32(s*s)`` (relative error ``<= u``, ``+ eta`` if ``s^2`` is subnormal);
the *exact* results use the real ``s^2`` (the norms) or the fp32 constants (the
assembly of given terms), as each function states.  Under per-op emulation of
eager PyTorch an operation with a Python scalar is computed in fp32 and then
rounded to the storage format (:mod:`dora_num.numerics.emulate`), so its relative
error is ``u_s = (1+u)(1+2^-24) - 1``.

Compose (lemmas 1-2): with ``pre`` the exact value of the last operation's operands
(``p + t`` of the stable form), the bound is first taken on ``|pre - X|``; the final
rounding in the working format adds ``u |pre|`` (and ``eta`` if it is a contracted
FMA); a final rounding to a narrower storage format adds ``u_o(|X| + E) + eta_o``.
The same ``pre`` gives the ulp bound (:func:`compose_ulp_bound`): the correctly
rounded ``RN(X)`` and the computed ``RN(value)`` differ by at most the number of
rounding boundaries (midpoints) of the output format between ``X`` and the value
rounded last, ``<= 1 + floor(E_last / q_min)`` with ``q_min`` the smallest spacing
of the format within ``E_last`` of ``X``.

All bounds are evaluated in float64 from float64 copies of the inputs and inflated
slightly (each function says by how much and why) to cover that evaluation.
"""

from __future__ import annotations

import numpy as np

from . import formulas as F
from .formats import FORMATS, get_format, quantum, round_to

_SAFE = 1.0 + 2.0**-40
_U64 = 2.0**-53
_U32 = FORMATS["fp32"].u
_ETA32 = FORMATS["fp32"].min_subnormal / 2
_TINY32 = FORMATS["fp32"].min_normal  # products below this may underflow


def _pw(u: float, n) -> float:
    """``(1+u)^n - 1`` (<= gamma_n)."""
    return (1.0 + u) ** n - 1.0


def gamma(n, u: float):
    """``gamma_n = n u / (1 - n u)`` (Higham, eq. 3.8); ``inf`` where ``n u >= 1``."""
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        out = np.where(nu < 1.0, nu / np.where(nu < 1.0, 1.0 - nu, 1.0), np.inf)
    return float(out) if out.ndim == 0 else out


_gam = gamma


def _finite64(name: str, x) -> np.ndarray:
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


def _working(fmt, variant):
    fmt = get_format(fmt)
    if variant == "per_op":
        w = fmt
        u32 = FORMATS["fp32"].u
        us = (1 + w.u) * (1 + u32) - 1 if w.p < 24 else w.u
        eta = w.min_subnormal / 2 + (FORMATS["fp32"].min_subnormal / 2 if w.p < 24 else 0.0)
        return w, us, eta, None, False
    if variant in ("fp32", "fp32_fma"):
        w = FORMATS["fp32"]
        return w, w.u, w.min_subnormal / 2, fmt, variant == "fp32_fma"
    raise ValueError(f"variant must be per_op, fp32 or fp32_fma, got {variant!r}")


def _g_used(g, fmt, variant, g_in):
    g = np.asarray(g, dtype=np.float64)
    return round_to(g, fmt) if (variant == "per_op" or g_in == "storage") else g


def _compose_parts(formula, base, lora, g, s, fmt, variant, g_in):
    """The pieces of the compose bounds (lemmas 1-2 of docs/bounds.md).

    Returns a dict: ``E_pre`` (bound on ``|pre - X'|``, ``pre`` the exact operands of the
    last rounding in the working format, ``X'`` the exact result with the ``g'`` used),
    ``E_w`` (after that rounding), ``E`` (the full bound vs ``X`` with the given ``g``,
    after a final rounding to ``fmt`` where the variant has one), ``over`` (overflow
    possible), ``X`` (an upper bound on ``|X'|``), ``Xtrue`` (float64 ``X`` with ``g``),
    ``dgL = |g' - g| |L + base|`` and the formats."""
    if formula not in ("compose_stable", "compose_naive"):
        raise ValueError(f"formula must be compose_stable or compose_naive, got {formula!r}")
    fmt = get_format(fmt)
    w, us, eta, out_fmt, fma = _working(fmt, variant)
    u = w.u
    base, lora, g = (_finite64(n, x) for n, x in (("base", base), ("lora", lora), ("g", g)))
    s = F.scale_constants(s)[0]
    gp = _g_used(g, fmt, variant, g_in)
    dg = np.abs(gp - g)
    L = s * lora  # exact in float64 (24-bit s times a <= 24-bit value)
    aL, ab, ag = np.abs(L), np.abs(base), np.abs(gp)
    A = np.abs((gp - 1.0) * base) * (1 + _U64)  # g'-1 exact in float64; the product rounds at most once
    T = ag * aL * (1 + _U64)  # one float64 rounding (72-bit product), taken from above
    X = np.abs((gp - 1.0) * base + gp * L) + 4 * _U64 * (A + T)  # three float64 roundings
    k = ((gp < 0.5) | (gp > 2.0)).astype(np.float64)  # g' - 1 rounds (one more factor)
    if formula == "compose_stable":
        # sl = L(1+d1)+e1; t = g' sl(1+d2)+e2; p = gm1 base(1+d3)+e3; pre = p + t (FMA: gm1 base + t)
        c_t = (1 + us) * (1 + u) - 1
        if fma:
            E_pre = _pw(us, k) * A + c_t * T + (ag * (1 + u) + 1) * eta
        else:
            E_pre = ((1 + us) ** k * (1 + u) - 1) * A + c_t * T + (ag * (1 + u) + 2) * eta
        mags = [aL * (1 + us) + eta, T * (1 + u) ** 2 + 2 * eta, A * (1 + u) ** 2 + eta, X + E_pre]
    else:
        Lb = np.abs(L + base) * (1 + _U64)
        if fma:  # inner = fl(L + b) = (L+b)(1+d1) + e1; pre = g' inner - b
            E_pre = ag * (u * Lb + eta)
        else:  # inner = (L(1+d1)+e1+b)(1+d2); P = g' inner(1+d3)+e3; pre = P - b
            E_pre = ag * (_pw(u, 2) * Lb + (1 + u) ** 2 * (us * aL + eta)) + eta
        mags = [aL * (1 + us) + eta, (aL + ab) * (1 + u) ** 2 + eta, ag * (aL + ab) * (1 + u) ** 3 + 2 * eta,
                X + E_pre]
    E_w = E_pre + u * (X + E_pre) + (eta if fma else 0.0)
    over = np.zeros(np.broadcast(base, lora, g).shape, dtype=bool)
    for m in mags:
        over |= m * (1 + u) >= w.max
    E = E_w
    if out_fmt is not None:
        over |= (X + E_w) * (1 + out_fmt.u) >= out_fmt.max
        E = E_w + out_fmt.u * (X + E_w) + out_fmt.min_subnormal / 2
    dgL = dg * np.abs(L + base) * (1 + _U64)
    Xtrue = (g - 1.0) * base + g * L
    return {"E_pre": E_pre, "E_w": E_w, "E": E, "over": over, "X": X, "Xtrue": Xtrue, "dgL": dgL,
            "out_fmt": out_fmt if out_fmt is not None else w, "final_round_in_w": out_fmt is None}


def compose_bound(formula: str, base, lora, g, s: float, fmt, variant: str, g_in: str = "fp32") -> np.ndarray:
    """Lemmas 1-2: bound on ``|computed - exact|`` of the compose ``formula``
    (``"compose_stable"`` or ``"compose_naive"``) evaluated by
    :func:`dora_num.numerics.emulate.emulate` with the same arguments; ``exact`` is the
    real result for ``g`` as given (``g_in="storage"``: the rounding of ``g`` costs
    ``|g' - g| |s lora + base|``, as ``X`` is affine in ``g``).  ``inf`` where overflow is
    possible.  Multiplied by ``1 + 2^-40`` (a handful of float64 operations on
    non-negative terms)."""
    P = _compose_parts(formula, base, lora, g, s, fmt, variant, g_in)
    E = (P["E"] + P["dgL"]) * _SAFE
    return np.where(P["over"], np.inf, E)


def compose_condition(base, lora, g, s: float) -> np.ndarray:
    r"""Condition number of the compose sum ``X = (g-1) base + g (s lora)``:
    ``kappa_c = (|(g-1) base| + |g s lora|) / |X|`` (1 where both terms are 0, ``inf`` where
    they cancel exactly).  ``kappa_c = 1`` when the terms have one sign; it is large
    where ``(g-1) base`` and ``g s lora`` nearly cancel."""
    base, lora, g = (_finite64(n, x) for n, x in (("base", base), ("lora", lora), ("g", g)))
    s = F.scale_constants(s)[0]
    A, T = np.abs((g - 1.0) * base), np.abs(g * (s * lora))
    X = np.abs((g - 1.0) * base + g * (s * lora))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(A + T == 0, 1.0, (A + T) / X)


def compose_ulp_bound(formula: str, base, lora, g, s: float, fmt, variant: str = "fp32",
                      g_in: str = "fp32") -> np.ndarray:
    r"""Lemma 1 (ulp form): the computed compose is within this many ulps of the correctly
    rounded exact result ``RN_fmt(X)`` (``X`` with the given ``g``), per element.

    ``1 + floor(E_last / q_min)``: ``E_last`` bounds the error of the value that the
    last rounding to ``fmt`` receives (the fp32 result for the fp32 variants with a
    narrower ``fmt``; the exact operands ``pre`` of the final operation when that
    operation itself rounds to ``fmt``), plus ``|g'-g||L+base|``; ``q_min`` is the
    spacing of ``fmt`` at ``max(|X| - E_last, 0)``.  Since ``RN`` is monotone and
    changes value only at midpoints, the two roundings differ by at most the number of
    midpoints within ``E_last`` of ``X``.  For the stable form with fp32 intermediates
    and ``g`` in ``[0.5, 2]``, ``E_last <= u32 |X| (1 + 2.0000002 kappa_c) + 4.0001 eta32``,
    so the result is within **1 ulp** wherever ``kappa_c <= one_ulp_condition(fmt)``
    (``2^(22 - p)``: 16384 for bf16, 2048 for fp16; none for fp32 output) and within
    ``~1 + (1 + 2 kappa_c) 2^(p - 23)`` ulps beyond.  ``inf`` where overflow is possible.
    """
    P = _compose_parts(formula, base, lora, g, s, fmt, variant, g_in)
    last_in_w = P["final_round_in_w"] or P["out_fmt"].p >= FORMATS["fp32"].p  # fp32 output: the fp32 op rounds last
    E_last = (P["E_pre"] if last_in_w else P["E_w"]) + P["dgL"]
    E_last = E_last * _SAFE
    low = np.maximum(np.abs(P["Xtrue"]) - E_last, 0.0)
    q = quantum(low, P["out_fmt"])
    ulps = 1.0 + np.floor(E_last / q)
    return np.where(P["over"], np.inf, ulps)


def one_ulp_condition(fmt) -> float:
    r"""Lemma 1: the largest ``kappa_c`` for which the stable compose with fp32
    intermediates (``g`` in ``[0.5, 2]``, one final rounding to ``fmt``) is guaranteed within
    1 ulp of the correctly rounded result: ``2^(22 - p)`` (``p`` the format's precision);
    0 for fp32 output (no condition suffices: the fp32 result has up to ``~2 kappa_c``
    ulps).  Derivation: :func:`compose_ulp_bound`; checked there per element."""
    p = get_format(fmt).p
    return 2.0 ** (22 - p) if p <= 22 else 0.0


def assembly_bound(base_sq, cross, ba, s: float, fmt, variant: str) -> np.ndarray:
    """Lemma 3: bound on ``|computed - exact|`` of :func:`~dora_num.numerics.formulas.norm_assembly`
    as evaluated by ``emulate("norm_assembly", ...)``; exact = ``sqrt(max(Q, 0))`` of the
    given terms with the fp32 constants ``2s``, ``s^2 = fl32(s*s)`` (what the assembly
    receives).  ``inf`` where overflow is possible."""
    fmt = get_format(fmt)
    w, us, eta, _, fma = _working(fmt, variant)
    u = w.u
    b, c, a = (_finite64(n, x) for n, x in (("base_sq", base_sq), ("cross", cross), ("ba", ba)))
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
        lin = np.where(Q_lo > 0, dQ / np.sqrt(np.where(Q_lo > 0, Q_lo, 1.0)), np.inf)
    E = ((1 + u) * np.minimum(lin, np.sqrt(dQ)) + u * w_hi) * _SAFE
    over = (S + dQ) * (1 + u) ** 3 >= w.max
    return np.where(over, np.inf, E)


def assembly_condition(base_sq, cross, ba, s: float) -> np.ndarray:
    """``kappa = (|base| + |2s cross| + |s^2 ba|) / |base + 2s cross + s^2 ba|`` (inf at Q = 0)."""
    b, c, a = (_finite64(n, x) for n, x in (("base_sq", base_sq), ("cross", cross), ("ba", ba)))
    _, two_s, s_sq = F.scale_constants(s)
    S = np.abs(b) + np.abs(two_s * c) + np.abs(s_sq * a)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(S == 0, 1.0, S / np.abs(b + two_s * c + s_sq * a))


def magnitude_scale_bound(m, wnorm, eps: float, rel_wnorm) -> np.ndarray:
    r"""Lemma 6: bound on ``|g^ - g|`` for ``g^ = fl32(m / max(w^, eps))`` (fp32, as
    :func:`~dora_num.numerics.formulas.magnitude_scale` under ``TorchFP32``) and the exact
    ``g = m / max(w, eps)``, where ``w^ = wnorm`` is the computed norm and ``w`` the exact
    one, ``|w^ - w| <= rel_wnorm * w`` (``eps`` taken as its fp32 value, as torch's
    ``clamp_min`` does).

    ``max(., eps)`` is 1-Lipschitz, so ``max(w^, eps) = max(w, eps)(1 + r)`` with
    ``|r| <= rel w / max(w, eps) <= rel``; the division adds ``(1 + d)`` and an underflow
    ``e``: ``g^ = g (1 + d) / (1 + r) + e``, hence

        |g^ - g| <= |g| (u + rel) / (1 - rel) + eta,

    exact to second order (``(1+u)/(1-rel) - 1``; the former ``u + (1 + u) rel`` misses
    the ``rel^2`` term and fails for ``rel > ~2^-12``).  ``inf`` for ``rel >= 1`` or where
    ``g^`` may overflow.  ``|g|`` is evaluated from the inputs as ``|m| / max(w^, eps) /
    (1 - rel)`` (an upper bound), times ``1 + 2^-40``."""
    m = _finite64("m", m)
    wn = _finite64("wnorm", wnorm)
    rel = np.broadcast_to(_finite64("rel_wnorm", rel_wnorm), np.broadcast(m, wn).shape)
    if (wn < 0).any() or (rel < 0).any():
        raise ValueError("wnorm and rel_wnorm must be non-negative")
    e32 = float(np.float32(eps))
    if not e32 > 0:
        raise ValueError(f"eps must be positive in fp32, got {eps!r}")
    u, eta = _U32, _ETA32
    den = np.maximum(wn, e32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        g_up = np.abs(m) / den / np.where(rel < 1, 1.0 - rel, 1.0) * (1 + 2 * _U64)
        E = (g_up * (u + rel) / np.where(rel < 1, 1.0 - rel, 1.0) + eta) * _SAFE
    bad = (rel >= 1) | ~np.isfinite(E) | (g_up * (1 + u) >= FORMATS["fp32"].max)
    return np.where(bad, np.inf, E)


# --------------------------------------------------------------------------
# Row norms from W, A, B in fp32 (dora_num.ops): factored vs dense.
# --------------------------------------------------------------------------

def _underflow_sites(X, Y) -> np.ndarray:
    """``n[j, k] = #{i : 0 < |X_ji Y_ki| < 2^-126}``: the products of ``X @ Y.T`` that may underflow fp32."""
    n = np.empty((X.shape[0], Y.shape[0]))
    aX = np.abs(X)
    for k in range(Y.shape[0]):
        P = aX * np.abs(Y[k])
        n[:, k] = ((P > 0) & (P < _TINY32)).sum(axis=1)
    return n


def _factored_parts(W, A, B, s, tensor_core_products):
    """Exact terms (float64, with their evaluation error) and a-priori term error bounds
    of the factored norm (lemma 4, docs/bounds.md)."""
    W, A, B = (_finite64(n, x) for n, x in (("W", W), ("A", A), ("B", B)))
    d, r = W.shape[1], A.shape[0]
    u, eta = _U32, _ETA32
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
    add_abs = (d - 1) * _TINY32 if tensor_core_products else 0.0  # a subnormal partial sum flushed to 0
    n_base = ((W != 0) & (W * W < _TINY32)).sum(1)  # squares that may underflow
    n_U = _underflow_sites(W, A)  # [d_out, r]
    n_G = _underflow_sites(A, A)  # [r, r]
    g_b, g_c, g_a = _gam(d, u), _gam(dp + r, u), _gam(dp + 2 * r, u)
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
    slack = _gam(d + 2 * r + 4, _U64) * S_mag * 1.01
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
    u, eta = _U32, _ETA32
    two_s, s_sq, ss = P["two_s"], P["s_sq"], P["ss"]
    b_hat = P["base"] + P["e_base"]
    c_hat = P["M_c"] + P["e_cross"]
    a_hat = P["M_a"] + P["e_ba"]
    d_terms = P["e_base"] + abs(two_s) * P["e_cross"] + max(ss, s_sq) * P["e_ba"]
    d_ssq = abs(s_sq - ss) * a_hat  # exact |fl32(s^2) - s^2|
    d_asm = _pw(u, 2) * (b_hat + s_sq * a_hat) + _pw(u, 3) * abs(two_s) * c_hat + 2 * (1 + u) ** 2 * eta
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
    W, A, B = (_finite64(n, x) for n, x in (("W", W), ("A", A), ("B", B)))
    d, r = W.shape[1], A.shape[0]
    u, eta = _U32, _ETA32
    s = F.scale_constants(s)[0]
    BA = B @ A
    BAabs = np.abs(B) @ np.abs(A)
    x = W + s * BA
    xmag = np.abs(W) + abs(s) * BAabs
    err_ba = _gam(r, u) * BAabs + (1 + _gam(r, u)) * r * eta
    e = u * np.abs(x) + (1 + u) * (abs(s) * (1 + u) * err_ba + u * abs(s) * np.abs(BA) + eta) \
        + _gam(r + 2, _U64) * xmag * 1.01
    en = np.sqrt((e * e).sum(1))
    xn = np.sqrt((x * x).sum(1))
    S_up = (xn * (1 + 1e-15) + en) ** 2
    S_lo = np.maximum(xn * (1 - 1e-15) - en, 0.0) ** 2
    n_sq = (np.abs(x) - e < 2.0**-63).sum(1)
    dS = _gam(d, u) * S_up + (1 + _gam(d, u)) * n_sq * eta
    with np.errstate(divide="ignore", invalid="ignore"):
        lin = np.where(S_lo > 0, dS / np.sqrt(np.where(S_lo > 0, S_lo, 1.0)), np.inf)
    E = (en + (1 + 3 * u) * np.minimum(lin, np.sqrt(dS)) + 3 * u * np.sqrt(S_up)) * (1 + 1e-6)
    mx = FORMATS["fp32"].max
    over = ((xmag + e).max(1, initial=0) * (1 + u) ** 2 >= mx) | (abs(s) * BAabs.max(1, initial=0) * 2 >= mx) \
        | (S_up * (1 + _gam(d, u)) >= mx)
    return np.where(over, np.inf, E)


# --------------------------------------------------------------------------
# A-posteriori: the factored norm's own condition and error, from its fp32 terms.
# --------------------------------------------------------------------------

def _up32(x: float) -> float:
    """The smallest fp32 value >= ``x`` (a constant rounded upwards)."""
    f = np.float32(x)
    if float(f) < x:
        f = np.nextafter(f, np.float32(np.inf))
    return float(f)


def lora_row_magnitudes(B, G, *, d_in: int | None = None, tensor_core_products: bool = False):
    r"""``(lora_abs, b_abs)``, fp32 ``[d_out]`` upper bounds, from ``B`` and the computed Gram
    ``G = A A^T`` (what the factored norm's tail holds): ``lora_abs_j >= sum_k |B_jk| ||A_k||``
    and ``b_abs_j >= sum_k |B_jk|``, the magnitudes :func:`factored_norm_posterior` needs.

    ``||A_k||^2 = G_kk`` exactly, and the computed ``G^_kk >= G_kk (1 - gamma_dp) - n eta``
    (``dp = d_in``, ``2 d_in`` on tensor cores, plus ``2^-126`` per addition there), so
    ``||A_k|| <= sqrt((G^_kk + c) / (1 - gamma_dp))``; the fp32 sums of ``r`` non-negative
    products are then raised by ``1 / (1 - gamma_{r+4})`` and ``r`` underflows.  Cost: two
    length-``r`` reductions per row.  ``d_in`` defaults to a bound from ``G``'s use:
    pass it (``A.shape[1]``)."""
    import torch

    B = torch.as_tensor(B).detach().float()
    G = torch.as_tensor(G).detach().float().to(B.device)
    if d_in is None:
        raise ValueError("lora_row_magnitudes needs d_in (the inner dimension of G = A A^T)")
    r = B.shape[1]
    dp = 2 * d_in if tensor_core_products else d_in
    g = float(_gam(dp, _U32))
    if not g < 0.5:
        raise ValueError(f"d_in = {d_in} is too large for an fp32 bound (gamma_d >= 1/2)")
    c_abs = _up32((1 + g) * (d_in * _ETA32 + ((d_in - 1) * _TINY32 if tensor_core_products else 0.0)) + 2.0**-149)
    diag = torch.diagonal(G).clamp_min(0)
    nA = torch.sqrt((diag + c_abs) * _up32(1 / (1 - g) * (1 + 4 * _U32)))  # sqrt of an upper bound, rounded
    nA = nA * _up32(1 + 2 * _U32)
    k = _up32(1 / (1 - float(_gam(r + 4, _U32))))
    aB = B.abs()
    lora_abs = (aB @ nA) * k + r * 2.0**-149
    b_abs = aB.sum(1) * k
    return lora_abs, b_abs


def factored_norm_posterior(base, cross, ba, two_s: float, s_sq: float, *, d_in: int, r: int,
                            lora_abs, b_abs, tensor_core_products: bool = False):
    r"""Lemma 4' (the cancellation guard's bound): per row, from the factored norm's own
    fp32 terms, ``(kappa, rel)``, fp32 tensors ``[d_out]``:

    - ``kappa = (base^ + |2s cross^| + s_sq ba^) / Q^``, the condition of the assembly from
      the computed terms, ``Q^`` the fp32 ``fl(fl(s_sq ba^) + fl(fl(2s cross^) + base^))``
      of :func:`~dora_num.numerics.formulas.norm_assembly` (``inf`` where ``Q^ <= 0``);
    - ``rel``: a guaranteed bound on ``|w^ - w| / w`` for the computed ``w^ = RN(sqrt(max(Q^, 0)))``
      and the exact ``w = ||W + s BA||_row`` (real ``s^2``), valid although the terms are
      themselves rounded; ``inf`` where no finite bound exists (``Q`` may be 0 within the
      terms' errors: such a row must be recomputed, e.g. by the dense norm).  ``rel / (1+u)``
      minus ``u`` also bounds ``|Q^ - Q| / Q``.

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
    ``s2 = (s_sq + eta)/(1-u) >= s^2``.  Then ``Q >= Q_lo = Q^ - dQ`` and
    ``|w^ - w| / w <= (1+u) dQ / Q_lo + u``.  Evaluated in fp32 (about 40 operations on
    non-negative values, ordered so that the tiny constants multiply last): ``dQ`` is
    raised by ``1 + 2^-18`` (> ``(1+u)^40``) and by ``2^-144`` (> the underflow of the
    ~40 products, ``2^-150`` each), ``Q_lo`` lowered by ``1 - 2u``, the quotient raised by ``1 + 2^-18``.
    """
    import torch

    base, cross, ba = (torch.as_tensor(x).float() for x in (base, cross, ba))
    lora_abs = torch.as_tensor(lora_abs).float().to(base.device)
    b_abs = torch.as_tensor(b_abs).float().to(base.device)
    u, eta = _U32, 2.0**-149  # eta rounded up to an fp32 number
    d, r = int(d_in), int(r)
    dp = 2 * d if tensor_core_products else d
    g_b, g_c, g_a = (float(_gam(n, u)) for n in (d, dp + r, dp + 2 * r))
    if not max(g_b, g_c, g_a) < 0.5:
        raise ValueError(f"d_in = {d}, r = {r} too large for an fp32 bound (gamma >= 1/2)")
    t_abs = (d - 1) * _TINY32 if tensor_core_products else 0.0
    U = lambda x: _up32(x)  # noqa: E731
    ts, sq = abs(float(two_s)), float(s_sq)
    s2 = U((sq + 2.0**-150) / (1 - u) * (1 + 2 * u))
    # Q^ exactly as norm_assembly evaluates it (fp32, no contraction)
    Qh = (sq * ba) + ((two_s * cross) + base)
    mag = base.abs() + (ts * cross).abs() + sq * ba.abs()
    b_up = (base.abs() + U((1 + g_b) * d * eta)) * U(1 / (1 - g_b) * (1 + 4 * u))
    e_b = b_up * U(g_b) + U((1 + g_b) * d * eta)
    e_c = torch.sqrt(b_up) * lora_abs * U(g_c * (1 + 4 * u)) \
        + (b_abs * U(1 + g_c)) * U(d * eta + t_abs) + U((1 + g_c) * r * eta)
    e_a = (lora_abs * lora_abs) * U(g_a) + ((b_abs * b_abs) * U(1 + g_a)) * U(d * eta + t_abs) \
        + ((b_abs + 1) * U((1 + g_a) * r)) * eta
    dQ = e_b + e_c * U(ts) + e_a * s2 + ba.abs() * U(u * sq / (1 - u)) + ba.abs() * eta \
        + (base.abs() + sq * ba.abs()) * U(_pw(u, 2)) + (ts * cross).abs() * U(_pw(u, 3)) + U(2 * (1 + u) ** 2 * eta)
    dQ = dQ * U(1 + 2.0**-18) + 2.0**-144
    Q_lo = (Qh - dQ) * float(np.float32(1 - 2 * u))
    ok = torch.isfinite(dQ) & torch.isfinite(Qh) & (Q_lo > 0)
    inf = torch.full_like(Qh, float("inf"))
    rel = torch.where(ok, ((dQ / torch.where(ok, Q_lo, torch.ones_like(Q_lo))) * U(1 + u) + u) * U(1 + 2.0**-18), inf)
    pos = torch.isfinite(Qh) & (Qh > 0)
    kappa = torch.where(pos, mag / torch.where(pos, Qh, torch.ones_like(Qh)), inf)
    kappa = torch.where(mag == 0, torch.ones_like(kappa), kappa)
    return kappa, rel


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
    r"""Lemma 7: bound on ``|dg_computed - dg_exact|`` per column (float64 ``[N]``).

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
    float64.)  ``inf`` where ``s L``, ``inner``, a product or, for the fp32 reductions, any
    partial sum may reach the fp32 overflow threshold (partial sums are bounded by
    ``sum_k |p^_k| (1 + u_s)^A`` in any order), even if the exact ``dg`` is in range.  Relative to ``|dg|`` this is ``~ (A + 2) u kappa`` with the condition
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
    # Overflow (fp32): of s*L, of inner, of a product, or of any partial sum of the reduction,
    # whose magnitude is at most sum_k |p^_k| (1 + u_s)^A whatever the order: then no finite
    # bound exists (the computed dg may be inf or NaN although the exact dg is in range).
    mx = FORMATS["fp32"].max
    p_mag = (inner + E) * aD * (1 + u_p) + eta_p
    over = ((sL * (1 + u32)).max(0, initial=0) >= mx) | ((inner + E).max(0, initial=0) * (1 + u32) >= mx)
    over |= p_mag.max(0, initial=0) >= mx
    if reduction != "fp64":
        over |= p_mag.sum(0) * (1 + u_s) ** A * (1 + 1e-9) >= mx
    return np.where(over, np.inf, bound * (1 + 1e-9))
