r"""A-priori bound on how far a merged DoRA layer's output is from the unmerged one's.

Both evaluations are compared with the same exact output for the stored inputs and the
layer's own fp32 ``g`` (the unmerged forward is run with that ``g``; the merged weight is
formed from it)::

    y = x W'^T + b,   W' = g * (W + s B A)   (exact; s = fl32(scale))

so ``|y_m - y_u| <= E_m + E_u`` with ``E_m``, ``E_u`` the two evaluations' errors against
``y``.  Standard model (Higham, ch. 2-3; ``pw(u, n) = (1+u)^n - 1 <= gamma_n``).

GEMM model.  A dot product of ``n`` terms from operands of one dtype is computed as
``fl_o(sum_k a'_k b'_k)`` where ``a', b'`` are the operands rounded to the product unit
(``u_in``: 0, or ``2^-11`` for TF32 fp32 GEMMs on CUDA) and the sum is accumulated with
unit ``u_acc`` in any order (``2^-24``: fp32 accumulation, CPU and cuBLAS; ``u_t`` where
cuBLAS may reduce in the 16-bit dtype, ``allow_{bf16,fp16}_reduced_precision_reduction``)::

    |fl(sum) - sum a_k b_k| <= c_dot(n) sum |a_k b_k|,   c_dot(n) = (1 + pw(u_in, 2))(1 + gamma_n(u_acc)) - 1

before the rounding to the output dtype (``u_o``).  The caller reads ``u_in``, ``u_acc``
from torch's flags (:func:`dora_num.wrapper.gemm_units`).

Merged weight (fp32 steps ``u = 2^-24``, then one rounding to the base dtype ``t``).
``P = fl32(B A)``, ``V = fl32(W + fl32(s P))``, ``W'^ = fl_t(fl32(g V))``; with
``M = |W| + |s| |B| |A|``::

    |P^ - BA| <= c_dot32(r) |B||A|,   |V^ - V| <= [(1+u)^2 c_dot32(r) + pw(u, 2)] M =: c_V M
    |W'^ - W'| <= [ c_V (1+u)(1+u_t) + pw2(u, u_t) ] |g| M + eta_t =: c_W |g| M + eta_t

(``pw2(u, u_t) = (1+u)(1+u_t) - 1``; ``eta_t`` half the smallest subnormal of ``t``).

Merged output ``y_m = fl_t(fl_t(acc(x W'^T)) + b)`` (bias added after a rounding, the
worse of the two ways a backend may do it)::

    E_m = |x| (c_W |g| M + eta_t)^T + [(1+u_t)^2 c_dot_t(d_in) + pw(u_t, 2)] |x| |W'^|^T + u_t |b|,
    |W'^| <= (1 + c_W) |g| M + eta_t.

Unmerged output (the forward of :class:`~dora_num.DoRALinear`, inference, autocast off,
``x`` in ``t``; ``c`` the compose dtype: ``t`` when ``A, B`` are in ``t``, the adapter
dtype when it is wider).  ``Pw = |x||W|^T``, ``Lm = |x||A|^T|B|^T``::

    base:  |b^ - x W^T| <= [(1+u_t) c_dot_t(d_in) + u_t] Pw =: c_b Pw
    h = fl_c(x A^T):  |h^ - x A^T| <= [(1+u_c) c_dot_c(d_in) + u_c] |x||A|^T =: c_h |x||A|^T
    lora = fl_c(h B^T): |l^ - x A^T B^T| <= [c_h + (1+c_h)((1+u_c) c_dot_c(r) + u_c)] Lm =: c_l Lm
    compose (fp32 ops, rounded to c): |d^ - d(b^, l^)| <= [(1+u_c)(1+pw(u, 3)) - 1] T =: c_d T,
        T = |g-1| (1+c_b) Pw + |g s| (1+c_l) Lm
    out = fl_c(fl_c(b^ + b) + d^), then fl_t if c != t:
    E_u = (1+|g-1|) c_b Pw + |g s| c_l Lm + c_d T + pw(u_c, 2)((1+c_b) Pw + |b|) + u_c D
          + [c != t] u_t (Y + E'),   D = (1+c_d) T,  Y = |g| Pw + |g s| Lm + |b|

(``E'`` the sum before the last term; ``g - 1`` is exact in fp32 for ``g`` in
``[0.5, 2]``, else one more ``u``, covered by ``pw(u, 3)`` having one rounding spare.)
Underflow: 8 half-subnormals of ``t`` and of fp32 per output, added absolutely.  The
bound is evaluated in float64 (non-negative terms) and multiplied by ``1 + 2^-40``.

Where it is tight: for 16-bit ``t`` both ``E_m`` and ``E_u`` are dominated by ``u_t``
times the magnitudes (``W'`` rounded to ``t``: about ``u_t |x||W'|^T``, the same order as
the unmerged base product's own rounding), so a merged bf16 layer is expected within a
few ``2^-8 |x||W|^T`` of the unmerged one, and far closer for fp32.
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
    """Elementwise bound ``[N, d_out]`` on ``|y_merged - y_unmerged|`` (module docstring).

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
