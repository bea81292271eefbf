"""The magnitude scale ``g = m / ||W + sBA||_row`` and DoRA's initial magnitude.

``eps`` guards only zero rows (``g = m / eps`` where the norm is 0); every row with a nonzero
norm, however small, gets ``g = m / wnorm`` as DoRA's formula says
(:func:`~dora_num.numerics.formulas.magnitude_denominator`).  The layer's initial ``m`` is that
denominator of the very norm its forward recomputes (:func:`initial_magnitude`), so ``g = 1``
exactly at initialisation on every row; under ``torch.compile`` the division is a custom op
(:func:`magnitude_scale`), so that also holds compiled.  Re-exported by :mod:`dora_num.ops.norm`.
"""

from __future__ import annotations

import torch

from ..numerics import formulas
from ..numerics.arithmetic import TorchFP32
from .validation import check_finite, check_tensor


def default_eps(dtype: torch.dtype) -> float:
    """The ``eps`` of :func:`magnitude_scale` for a magnitude of this dtype (used only at zero rows)."""
    return 1e-6 if dtype in (torch.float16, torch.bfloat16) else 1e-12


def initial_magnitude(wnorm: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DoRA's initial magnitude from the layer's own norm ``wnorm``: the denominator of ``g``
    (:func:`~dora_num.numerics.formulas.magnitude_denominator`: ``wnorm``, and ``eps`` of
    ``dtype`` on a zero row), in ``dtype``.  With an fp32 magnitude the forward's
    ``g = m / d`` is then ``d / d = 1`` exactly on every row (zero rows included: ``eps /
    eps``), because the forward recomputes the very same ``wnorm`` (same code, device and
    configuration) and a correctly rounded division of equal nonzero numbers is 1.  (A 16-bit
    magnitude rounds ``d``: then ``|g - 1| <= u`` of that format.)"""
    check_tensor("wnorm", wnorm, ndim=1, dtypes=(torch.float32,))
    with torch.no_grad():
        return formulas.magnitude_denominator(TorchFP32, wnorm.detach(), default_eps(dtype)).to(dtype)


@torch.library.custom_op("dora_num::magnitude_div", mutates_args=())
def _magnitude_div_op(m: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``m / den`` in fp32 by torch's correctly rounded division, opaque to the compiler:
    inductor lowers a traced fp32 division to Triton's ``div.full.f32`` on CUDA (not correctly
    rounded, so ``d / d`` need not be 1), which would break ``g == 1`` at initialisation."""
    return m.float() / den


@_magnitude_div_op.register_fake
def _(m, den):
    return torch.empty_like(den, dtype=torch.float32)


def _magnitude_div_setup(ctx, inputs, output):
    m, den = inputs
    ctx.save_for_backward(den)
    ctx.m_dtype = m.dtype


def _magnitude_div_backward(ctx, grad):
    (den,) = ctx.saved_tensors
    # d g / d m = 1 / den: the gradient divided by the same op (a traced division would be inductor's)
    return _magnitude_div_op(grad, den).to(ctx.m_dtype), None


_magnitude_div_op.register_autograd(_magnitude_div_backward, setup_context=_magnitude_div_setup)


@torch.library.triton_op("dora_num::magnitude_div_traced", mutates_args=())
def _magnitude_div_traced_op(m: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """:func:`_magnitude_div_op` on CUDA as a traced op: the correctly rounded division of
    :mod:`dora_num.ops.kernels.divide`, launched by Inductor (bitwise torch's division)."""
    from .kernels.divide import div_rn

    return div_rn(m.contiguous(), den.contiguous(), traced=True)


def _magnitude_div_traced_backward(ctx, grad):
    (den,) = ctx.saved_tensors
    return _magnitude_div_traced_op(grad, den).to(ctx.m_dtype), None


_magnitude_div_traced_op.register_autograd(_magnitude_div_traced_backward, setup_context=_magnitude_div_setup)


def magnitude_div(m: torch.Tensor, den: torch.Tensor, cfg) -> torch.Tensor:
    """``m / den`` (fp32 ``den``) in a compiled graph, correctly rounded, differentiable in ``m``: the traced
    op on CUDA (``OpConfig.traced_ops``, not the interpreter), else the opaque one."""
    from .config import traces_kernels

    if traces_kernels(den.device, cfg):
        return _magnitude_div_traced_op(m, den)
    return _magnitude_div_op(m, den)


def magnitude_scale(m: torch.Tensor, wnorm: torch.Tensor, *, eps: float | None = None,
                    check: bool = True) -> torch.Tensor:
    """``g = m / wnorm`` in fp32, ``m / eps`` where ``wnorm == 0`` (differentiable in ``m``;
    ``wnorm`` detached): :func:`~dora_num.numerics.formulas.magnitude_scale`.

    ``eps`` guards only zero rows: every row with a nonzero norm, however small (below ``eps``,
    subnormal), gets ``m / wnorm`` as DoRA's formula (and PEFT, which has no ``eps``) says.
    ``eps`` defaults by the dtype of ``m``: ``1e-12`` for fp32/fp64, ``1e-6`` for bf16/fp16
    magnitudes; a zero row (where PEFT computes ``0/0 = NaN``, or ``m/0 = inf``) gets the finite
    ``g = m / eps``, and at DoRA's init (:func:`initial_magnitude`: ``m = eps`` there) ``g = 1``.
    With ``check``: a non-finite ``m``, ``wnorm`` or ``g`` raises ``ValueError`` (``g`` overflows
    where ``m / wnorm`` exceeds fp32, e.g. a subnormal nonzero norm; the rows are named).
    Under ``torch.compile`` the division is the custom op ``dora_num::magnitude_div`` (torch's
    correctly rounded division, as in eager; bitwise the same ``g``).
    """
    check_tensor("m", m, ndim=1)
    check_tensor("wnorm", wnorm, ndim=1, dtypes=(torch.float32, torch.float64))
    if m.shape != wnorm.shape:
        raise ValueError(f"m has shape {tuple(m.shape)} but wnorm has {tuple(wnorm.shape)}")
    if m.device != wnorm.device:
        raise ValueError(f"m is on {m.device} but wnorm on {wnorm.device}")
    if eps is None:
        eps = default_eps(m.dtype)
    if not (eps > 0):
        raise ValueError(f"eps must be positive, got {eps}")
    w = wnorm.detach().float()
    if torch.compiler.is_compiling():
        from .config import get_config

        return magnitude_div(m, formulas.magnitude_denominator(TorchFP32, w, eps), get_config())
    if check:  # value checks sync
        check_finite("m", m.detach())
        check_finite("wnorm", wnorm)
    g = formulas.magnitude_scale(TorchFP32, m.float(), w, eps)
    if check and not bool(torch.isfinite(g.detach()).all()):
        rows = torch.nonzero(~torch.isfinite(g.detach())).flatten()[:8].tolist()
        zero = [j for j in rows if float(w[j]) == 0.0]
        if zero:
            raise ValueError(f"g = m / eps overflows float32 on the zero rows {zero} of W + sBA (eps = {eps:.3g}, "
                             f"|m| up to {float(m.detach()[zero].abs().max()):.3g}): m is too large for the eps of "
                             "a zero row; pass a larger eps or rescale m")
        raise ValueError(f"g = m / wnorm overflows float32 on rows {rows} (wnorm as small as "
                         f"{float(w[rows].min()):.3g}, |m| up to {float(m.detach()[rows].abs().max()):.3g}): "
                         "eps guards zero rows only; rescale W or m")
    return g
