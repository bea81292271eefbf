r"""A-priori bound on how far a merged DoRA layer's output is from the unmerged one's.

Both are held to the same exact output ``y = x W'^T + b``, ``W' = g (W + s B A)`` with the layer's
own fp32 ``g``: ``|y_m - y_u| <= E_m + E_u``, each the standard-model error of its evaluation
(GEMMs with the product and accumulation units torch's flags give, :func:`dora_num.wrapper.gemm_units`;
the merged weight rounded once to the base dtype; the unmerged forward's base, LoRA and compose),
evaluated in float64 and inflated by ``1 + 2^-40``.  For 16-bit layers both are dominated by
``u_t |x||W'|^T``; every product of every GEMM is charged as an underflow site (a backend may flush
subnormal products, partial sums and inputs).  The derivation: docs/bounds.md, lemma 10.
"""

from __future__ import annotations

import numpy as np

from .standard_model import gamma, pw as _pw
from .formats import FORMATS, get_format

_SAFE = 1.0 + 2.0**-40
_TINY32 = 2.0**-126  # fp32's smallest normal: below it a backend may flush


def _units(dtype) -> tuple[float, float, int]:
    """``(u, min_subnormal, p)`` of a dtype (float64 included)."""
    if str(dtype) in ("torch.float64", "float64", "fp64"):
        return 2.0**-53, 2.0**-1074, 53
    f = get_format(dtype)
    return f.u, f.min_subnormal, f.p


def _c_dot(n: int, units: tuple[float, float]) -> float:
    u_in, u_acc = units
    return (1.0 + _pw(u_in, 2)) * (1.0 + gamma(n, u_acc)) - 1.0


def _sub(Z):
    """``|Z|`` where it is below fp32's normal range (an input a backend may flush), else 0."""
    aZ = np.abs(Z)
    return np.where(aZ < _TINY32, aZ, 0.0)


def _flush(X, Y, n: int, sub_X=None, sub_Y=None) -> np.ndarray:
    """``F(X, Y) = 2 n 2^-126 + sub(X) |Y|^T + |X| sub(Y)^T``: what flushing may lose in ``X Y^T``
    (``n`` terms per output: each product and each partial sum below ``2^-126``, and the products of
    flushed inputs; ``sub_X``, ``sub_Y`` given where only a bound on the stored input is known)."""
    sX = _sub(X) if sub_X is None else sub_X
    sY = _sub(Y) if sub_Y is None else sub_Y
    return 2 * n * _TINY32 + sX @ np.abs(Y).T + np.abs(X) @ sY.T


def merged_linear_bound(x, W, bias, A, B, g, s: float, *, base_dtype, compose_dtype,
                        gemm_base: tuple[float, float], gemm_compose: tuple[float, float],
                        gemm_fp32: tuple[float, float], parts: bool = False):
    """Elementwise bound ``[N, d_out]`` on ``|y_merged - y_unmerged|`` (docs/bounds.md, lemma 10).

    ``x [N, d_in]``, ``W [d_out, d_in]``, ``bias [d_out]`` or None, ``A [r, d_in]``,
    ``B [d_out, r]``, ``g [d_out]`` (the fp32 g both evaluations use), ``s = fl32(scale)``;
    all as stored (converted to float64 here, exactly).  ``base_dtype``: W's dtype ``t``;
    ``compose_dtype``: the dtype the unmerged compose runs in.  ``gemm_*``: ``(u_in, u_acc)``
    of the GEMMs in the base dtype, in the compose dtype, and of the fp32 ``B A`` product.
    ``parts=True``: ``(E_m, E_u)``, the bounds of the merged and of the unmerged output against the
    exact ``y = x W'^T + bias`` separately (their sum is the bound).
    """
    x, W, A, B, g = (np.asarray(t, dtype=np.float64) for t in (x, W, A, B, g))
    b = np.zeros(W.shape[0]) if bias is None else np.abs(np.asarray(bias, dtype=np.float64))
    (ut, sub_t, p_t), (uc, _, p_c) = _units(base_dtype), _units(compose_dtype)
    f32 = FORMATS["fp32"]
    u = f32.u
    eta = 8 * (sub_t / 2 + f32.min_subnormal / 2)  # the elementwise operations of one output
    eta32 = f32.min_subnormal / 2
    d_in, r = W.shape[1], A.shape[0]
    s = abs(float(s))
    ax, aW, aA, aB, ag = np.abs(x), np.abs(W), np.abs(A), np.abs(B), np.abs(g)
    agm1 = np.abs(g - 1.0)
    BA = aB @ aA
    M = aW + s * BA

    # merged: P = fl32(B A) (r terms, flushes F(B, A^T)), V = fl32(W + fl32(s P)), W' = fl_t(fl32(g V))
    c_V = (1 + u) ** 2 * _c_dot(r, gemm_fp32) + _pw(u, 2)
    c_W = c_V * (1 + u) * (1 + ut) + ((1 + u) * (1 + ut) - 1)
    eta_t = sub_t / 2
    F_P = _flush(B, A.T, r)  # [d_out, d_in]
    dW = c_W * ag[:, None] * M + eta_t + (1 + u) ** 3 * (1 + ut) * (ag[:, None] * (s * F_P + eta32) + eta32)
    Wm_mag = (1 + c_W) * ag[:, None] * M + dW
    E_m = ax @ dW.T + ((1 + ut) ** 2 * _c_dot(d_in, gemm_base) + _pw(ut, 2)) * (ax @ Wm_mag.T) + ut * b \
        + (1 + ut) ** 2 * _flush(x, Wm_mag, d_in, sub_Y=np.minimum(Wm_mag, _TINY32))

    # unmerged
    Pw = ax @ aW.T
    Lm = (ax @ aA.T) @ aB.T
    c_b = (1 + ut) * _c_dot(d_in, gemm_base) + ut
    c_h = (1 + uc) * _c_dot(d_in, gemm_compose) + uc
    c_l = c_h + (1 + c_h) * ((1 + uc) * _c_dot(r, gemm_compose) + uc)
    c_d = (1 + uc) * (1 + _pw(u, 3)) - 1
    # flushes: base = x W^T, h = x A^T (d_in terms), lora = h B^T (r terms, h as computed: |h| <= (1+c_h)|x||A|^T)
    F_b = (1 + ut) * _flush(x, W, d_in)
    h_mag = (1 + c_h) * (ax @ aA.T) + (1 + uc) * _flush(x, A, d_in)
    F_l = (1 + uc) * ((1 + uc) * _flush(x, A, d_in) @ aB.T + _flush(h_mag, B, r, sub_X=np.minimum(h_mag, _TINY32)))
    T = agm1 * ((1 + c_b) * Pw + F_b) + ag * s * ((1 + c_l) * Lm + F_l)
    E_u = (1 + agm1) * (c_b * Pw + F_b) + ag * s * (c_l * Lm + F_l) + c_d * T \
        + _pw(uc, 2) * ((1 + c_b) * Pw + F_b + b) + uc * (1 + c_d) * T
    if p_c != p_t:
        Y = ag * Pw + ag * s * Lm + b
        E_u = E_u + ut * (Y + E_u)
    if parts:
        return (E_m + eta) * _SAFE, (E_u + eta) * _SAFE
    return (E_m + E_u + eta) * _SAFE
