"""The DoRA formulas, each written exactly once, over an arithmetic.

Notation (docs/contract.md): frozen ``W [d_out, d_in]``, ``A [r, d_in]``,
``B [d_out, r]``, scale ``s``, magnitude ``m [d_out]``;
``base = x W^T``, ``lora = x A^T B^T``, ``g = m / ||W + sBA||_row`` (``m / eps`` on a zero row).

Every function takes an arithmetic ``ar`` first (see
:mod:`dora_num.numerics.arithmetic`) and evaluates a fixed, documented sequence
of operations in it.  The torch reference (``dora_num.ops.reference``), the
emulations, the exact ground truth and the a-priori bounds all call these, so
they cannot drift apart.  The fused Triton kernels cannot call Python; they are
held to these sequences by bitwise tests.

Scalar conventions: ``s`` is rounded to fp32 once by the caller
(:func:`scale_constants`), so ``2*s`` is exact and ``s*s`` is one fp32
rounding, computed once per call, never per element.
"""

from __future__ import annotations

import numpy as np


def scale_constants(scale: float) -> tuple[float, float, float]:
    """``(s, 2s, s^2)`` as Python floats exactly representable in fp32.

    ``s = fl32(scale)``; ``2s`` is exact (a power-of-two multiple);
    ``s^2 = fl32(s*s)`` (one rounding, relative error <= u32 = 2^-24), ``inf`` for ``|s| > 1.8e19``
    (and ``2s`` beyond fp32 for ``|s| > 1.7e38``: callers that need fp32 constants check them).
    """
    s = float(np.float32(scale))
    ss = s * s  # exact in float64 (24-bit s); fl32 of it is fp32's correctly rounded product
    return s, 2.0 * s, float(np.float32(ss)) if ss < _FP32_OVERFLOW else float("inf")


_FP32_OVERFLOW = (2.0 - 2.0**-24) * 2.0**127  # fp32's largest value plus half an ulp: at and above it RN gives inf


# --------------------------------------------------------------------------
# Compose.  Inputs base, lora are upcast to the arithmetic's working format;
# the caller rounds the result once to the activation dtype.
# --------------------------------------------------------------------------

def compose_naive(ar, base, lora, g, s):
    """``g*(s*lora + base) - base`` (PEFT's algebra, rearranged; cancels at g≈1).

    Sequence: ``inner = muladd(s, lora, base)``; ``out = muladd(g, inner, -base)``
    (four roundings without contraction, two with).  At g≈1, ``t`` and ``base`` agree in their leading bits,
    so ``t - base`` is exact (Sterbenz) but exposes the rounding error of ``t``
    (about u*|base|) against a true result of size ``|g-1||base| + |s lora|``:
    the relative error grows like ``u / |g-1|``.
    """
    inner = ar.muladd(s, lora, base)
    return ar.muladd(g, inner, ar.neg(base))


def compose_stable(ar, base, lora, g, s):
    """``(g-1)*base + g*(s*lora)``: the contract's eager reference.

    Sequence (fp32 under :class:`~dora_num.numerics.arithmetic.TorchFP32`):
    ``gm1 = g - 1``; ``sl = s*lora``; ``t = g*sl``; ``out = muladd(gm1, base, t)``
    i.e. ``gm1*base`` then ``+ t`` (two roundings; one if contracted).
    ``g - 1`` is exact for g in [0.5, 2] (Sterbenz), so ``g`` is not lost: each
    term is formed with relative error <= gamma_2 and the sum adds one u.  The sum
    itself can still cancel, where ``(g-1)*base`` and ``g*s*lora`` nearly cancel: the
    error is bounded relative to ``|(g-1) base| + |g s lora|``, i.e. ``~2u kappa_c |X|``
    with ``kappa_c`` the sum's condition, so "within 1 ulp of the correctly rounded
    result" (fp32 intermediates, one final rounding) holds where ``kappa_c <=
    2^(22-p)`` of the output format and not beyond (lemma 1 of docs/bounds.md,
    :func:`dora_num.numerics.bounds.compose_ulp_bound`).
    """
    gm1 = ar.sub(g, ar.const(1.0))
    t = ar.mul(g, ar.mul(s, lora))
    return ar.muladd(gm1, base, t)


def compose_inner(ar, base, lora, s):
    """``inner = s*lora + base``: the tensor the backward needs for ``dg``.

    The same two roundings as the first line of :func:`compose_naive`.
    """
    return ar.muladd(s, lora, base)


def compose_backward_elementwise(ar, grad, g, s):
    """Elementwise part of the compose backward, upstream gradient ``D``.

    ``dlora = (g*s) * D`` with ``g*s`` formed once per column (one rounding);
    ``dbase = (g-1) * D`` with ``g-1`` exact.  ``dg`` (a reduction over rows of
    ``inner * D``) is not elementwise; see :func:`compose_grad_g_terms`.
    """
    gs = ar.mul(g, s)
    gm1 = ar.sub(g, ar.const(1.0))
    return ar.mul(gs, grad), ar.mul(gm1, grad)


def compose_grad_g_terms(ar, inner, grad):
    """The products ``inner * D`` whose row sum is ``dg`` (one rounding each)."""
    return ar.mul(inner, grad)


# --------------------------------------------------------------------------
# Norm assembly from the factored terms.
# --------------------------------------------------------------------------

def norm_assembly(ar, base_sq, cross, ba, two_s, s_sq):
    """``wnorm = sqrt(max(base_sq + 2s*cross + s^2*ba, 0))``.

    Sequence: ``t = muladd(2s, cross, base_sq)``; ``t = muladd(s^2, ba, t)``;
    ``t = max(t, 0)``; ``wnorm = sqrt(t)``.  Two places a compiler may contract.
    The sum cancels when ``2s*cross ≈ -base_sq`` (the low-rank update pointing
    against the row); the condition number of the sum is
    ``(|base_sq| + |2s cross| + |s^2 ba|) / |base_sq + 2s cross + s^2 ba|``.
    """
    t = ar.muladd(two_s, cross, base_sq)
    t = ar.muladd(s_sq, ba, t)
    t = ar.maximum(t, 0.0)
    return ar.sqrt(t)


# --------------------------------------------------------------------------
# Magnitude scale.
# --------------------------------------------------------------------------

def magnitude_denominator(ar, wnorm, eps):
    """The denominator of ``g``: ``wnorm``, or ``eps`` where ``wnorm == 0`` (an exact selection).

    ``eps`` guards only zero rows (where ``m / wnorm`` is not finite): every row with a nonzero
    norm, however small, gets ``g = m / wnorm`` as DoRA's formula says.  (A ``max(wnorm, eps)``
    would give rows below ``eps`` a smaller ``g``, and the layer at initialisation would differ
    from its base layer there.)  A row whose ``m / wnorm`` overflows (a tiny nonzero norm) gets a
    non-finite ``g``, which the operator reports instead of replacing."""
    return ar.zero_to(wnorm, eps)


def magnitude_scale(ar, m, wnorm, eps):
    """``g = m / d`` with ``d`` = :func:`magnitude_denominator` (``wnorm``, ``eps`` at zero rows):
    one exact selection and one division.

    Error: with ``rel`` the relative error of the norm fed in (``|w^ - w| <= rel w``, ``rel < 1``,
    so ``w^ = 0`` iff ``w = 0``), ``|g^ - g| <= |g| (u + rel) / (1 - rel) + eta`` for every
    ``wnorm`` and every ``m`` (``eta``: the quotient may underflow).  Exact to second order; the
    first-order ``u + (1+u) rel`` is exceeded by ``~rel^2`` (lemma 6 of docs/bounds.md,
    :func:`dora_num.numerics.bounds.magnitude_scale_bound`).  At initialisation ``m`` is
    :func:`magnitude_denominator` of the very norm the forward recomputes, so ``g = d / d = 1``
    exactly (a correctly rounded division of equal nonzero numbers).
    """
    return ar.div(m, magnitude_denominator(ar, wnorm, eps))
