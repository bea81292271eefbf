r"""A-priori bound on how far a merged DoRA layer's output is from the unmerged one's.

Both are held to the same exact output ``y = x W'^T + b``, ``W' = g (W + s B A)`` with the layer's
own fp32 ``g``: ``|y_m - y_u| <= E_m + E_u``, each the standard-model error of its evaluation
(GEMMs with the product and accumulation units torch's flags give, :func:`dora_num.wrapper.gemm_units`;
the merged weight rounded once to the base dtype; the unmerged forward's base, LoRA and compose),
evaluated in float64 and inflated by ``1 + 2^-40``.  For 16-bit layers both are dominated by
``u_t |x||W'|^T``.  The derivation: docs/bounds.md, "How far a merged layer is from the unmerged one".
"""

from __future__ import annotations

import numpy as np

from .standard_model import gamma, pw as _pw
from .formats import FORMATS, get_format

_SAFE = 1.0 + 2.0**-40


def _units(dtype) -> tuple[float, float, int]:
    """``(u, min_subnormal, p)`` of a dtype (float64 included)."""
    if str(dtype) in ("torch.float64", "float64", "fp64"):
        return 2.0**-53, 2.0**-1074, 53
    f = get_format(dtype)
    return f.u, f.min_subnormal, f.p


def _c_dot(n: int, units: tuple[float, float]) -> float:
    u_in, u_acc = units
    return (1.0 + _pw(u_in, 2)) * (1.0 + gamma(n, u_acc)) - 1.0


def merged_linear_bound(x, W, bias, A, B, g, s: float, *, base_dtype, compose_dtype,
                        gemm_base: tuple[float, float], gemm_compose: tuple[float, float],
                        gemm_fp32: tuple[float, float]) -> np.ndarray:
    """Elementwise bound ``[N, d_out]`` on ``|y_merged - y_unmerged|`` (docs/bounds.md).

    ``x [N, d_in]``, ``W [d_out, d_in]``, ``bias [d_out]`` or None, ``A [r, d_in]``,
    ``B [d_out, r]``, ``g [d_out]`` (the fp32 g both evaluations use), ``s = fl32(scale)``;
    all as stored (converted to float64 here, exactly).  ``base_dtype``: W's dtype ``t``;
    ``compose_dtype``: the dtype the unmerged compose runs in.  ``gemm_*``: ``(u_in, u_acc)``
    of the GEMMs in the base dtype, in the compose dtype, and of the fp32 ``B A`` product.
    """
    x, W, A, B, g = (np.asarray(t, dtype=np.float64) for t in (x, W, A, B, g))
    b = np.zeros(W.shape[0]) if bias is None else np.abs(np.asarray(bias, dtype=np.float64))
    (ut, sub_t, p_t), (uc, _, p_c) = _units(base_dtype), _units(compose_dtype)
    f32 = FORMATS["fp32"]
    u = f32.u
    eta = 8 * (sub_t / 2 + f32.min_subnormal / 2)
    d_in, r = W.shape[1], A.shape[0]
    s = abs(float(s))
    ax, aW, aA, aB, ag = np.abs(x), np.abs(W), np.abs(A), np.abs(B), np.abs(g)
    agm1 = np.abs(g - 1.0)
    BA = aB @ aA
    M = aW + s * BA

    # merged
    c_V = (1 + u) ** 2 * _c_dot(r, gemm_fp32) + _pw(u, 2)
    c_W = c_V * (1 + u) * (1 + ut) + ((1 + u) * (1 + ut) - 1)
    eta_t = sub_t / 2
    dW = c_W * ag[:, None] * M + eta_t
    Wm_mag = (1 + c_W) * ag[:, None] * M + eta_t
    E_m = ax @ dW.T + ((1 + ut) ** 2 * _c_dot(d_in, gemm_base) + _pw(ut, 2)) * (ax @ Wm_mag.T) + ut * b

    # unmerged
    Pw = ax @ aW.T
    Lm = (ax @ aA.T) @ aB.T
    c_b = (1 + ut) * _c_dot(d_in, gemm_base) + ut
    c_h = (1 + uc) * _c_dot(d_in, gemm_compose) + uc
    c_l = c_h + (1 + c_h) * ((1 + uc) * _c_dot(r, gemm_compose) + uc)
    c_d = (1 + uc) * (1 + _pw(u, 3)) - 1
    T = agm1 * (1 + c_b) * Pw + ag * s * (1 + c_l) * Lm
    E_u = (1 + agm1) * c_b * Pw + ag * s * c_l * Lm + c_d * T + _pw(uc, 2) * ((1 + c_b) * Pw + b) \
        + uc * (1 + c_d) * T
    if p_c != p_t:
        Y = ag * Pw + ag * s * Lm + b
        E_u = E_u + ut * (Y + E_u)
    return (E_m + E_u + eta) * _SAFE
