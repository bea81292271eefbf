"""Eager torch references of the DoRA compose (forward and backward).

The exact operation sequences are those of :mod:`dora_num.numerics.formulas`,
evaluated under :class:`~dora_num.numerics.arithmetic.TorchFP32`: inputs upcast
to fp32 (exact), fp32 intermediates, one final rounding to the activation dtype.
These are the functions the fused kernels must match bit for bit.

Forward, stable (the contract), per element with ``g = g[col]``::

    gm1 = g - 1            # exact for g in [0.5, 2] (Sterbenz)
    t   = g * (s * lora)   # two fp32 roundings
    out = gm1 * base + t   # two fp32 roundings (no FMA), then one rounding to dtype

Backward, upstream gradient ``D``::

    dlora = (g*s) * D      # g*s rounded once per column
    dbase = (g - 1) * D
    dg    = sum_rows((s*lora + base) * D)   # fp32 products, torch.sum order
"""

from __future__ import annotations

import torch

from ..numerics import formulas as F
from ..numerics.arithmetic import TorchFP32
from .validation import check_compose_args, check_finite, check_scale


def _prepare(base, lora, g, scale, check_inputs: bool):
    check_compose_args(base, lora, g)
    s, _, _ = F.scale_constants(check_scale(scale))
    check_finite("g", g.detach())
    if check_inputs:
        check_finite("base", base.detach())
        check_finite("lora", lora.detach())
    return s


def compose_naive(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, scale: float) -> torch.Tensor:
    """``g*(s*lora + base) - base`` with fp32 intermediates and one final rounding.

    Kept to study cancellation at g≈1; use :func:`compose_stable` for work.
    Raises on NaN/Inf in any input.
    """
    s = _prepare(base, lora, g, scale, check_inputs=True)
    with torch.autocast(base.device.type, enabled=False):
        out = F.compose_naive(TorchFP32, base.float(), lora.float(), g, s)
    return out.to(base.dtype)


def compose_stable(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, scale: float) -> torch.Tensor:
    """``(g-1)*base + g*(s*lora)``: the eager reference of the numerical contract.

    ``base``, ``lora`` ``[..., d_out]`` (fp16/bf16/fp32, one dtype), ``g`` fp32
    ``[d_out]``; returns ``delta`` in the activation dtype.  Raises on NaN/Inf in
    any input.  No autograd Function here: see :func:`dora_num.compose`.
    """
    s = _prepare(base, lora, g, scale, check_inputs=True)
    return compose_stable_ref(base, lora, g, s)


def compose_stable_ref(base, lora, g, s: float) -> torch.Tensor:
    """Unchecked :func:`compose_stable` (``s`` already an fp32-exact float)."""
    with torch.autocast(base.device.type, enabled=False):
        out = F.compose_stable(TorchFP32, base.float(), lora.float(), g, s)
    return out.to(base.dtype)


def compose_inner_ref(base, lora, s: float) -> torch.Tensor:
    """``inner = s*lora + base`` in fp32 (saved for the backward when g needs a gradient)."""
    with torch.autocast(base.device.type, enabled=False):
        return F.compose_inner(TorchFP32, base.float(), lora.float(), s)


def compose_backward_ref(grad, inner, g, s: float, *, need_dg: bool = True):
    """``(dlora, dbase, dg)`` of the stable compose; ``dg`` fp32 ``[d_out]`` or None.

    ``dlora``/``dbase`` are rounded once to ``grad``'s dtype; ``dg`` sums the fp32
    products ``inner*D`` over every leading dimension with ``torch.sum``.
    """
    with torch.autocast(grad.device.type, enabled=False):
        D = grad.float()
        dlora, dbase = F.compose_backward_elementwise(TorchFP32, D, g, s)
        dg = None
        if need_dg:
            terms = F.compose_grad_g_terms(TorchFP32, inner, D)
            dg = terms.reshape(-1, terms.shape[-1]).sum(dim=0)
    return dlora.to(grad.dtype), dbase.to(grad.dtype), dg
