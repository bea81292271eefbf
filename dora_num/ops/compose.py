"""``compose``: the differentiable DoRA compose and its dispatch.

``path="eager"`` runs the torch reference of :mod:`dora_num.ops.reference`
inside :class:`ComposeFunction`, whose backward is the documented sequence of
:func:`~dora_num.ops.reference.compose_backward_ref` (not autograd's own
derivative of the forward, whose operation order is not under our control).
"""

from __future__ import annotations

import torch

from ..numerics.formulas import scale_constants
from . import reference as ref
from .validation import check_compose_args, check_finite, check_scale

PATHS = ("auto", "eager", "fused")


class ComposeFunction(torch.autograd.Function):
    """Eager stable compose with the contract's explicit backward."""

    @staticmethod
    def forward(ctx, base, lora, g, s: float):
        out = ref.compose_stable_ref(base, lora, g, s)
        inner = ref.compose_inner_ref(base, lora, s) if g.requires_grad else None
        ctx.save_for_backward(inner, g)
        ctx.s = s
        return out

    @staticmethod
    def backward(ctx, grad):
        inner, g = ctx.saved_tensors
        need_dg = ctx.needs_input_grad[2]
        dlora, dbase, dg = ref.compose_backward_ref(grad, inner, g, ctx.s, need_dg=need_dg)
        return (
            dbase if ctx.needs_input_grad[0] else None,
            dlora if ctx.needs_input_grad[1] else None,
            dg,
            None,
        )


def compose(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, scale: float, *, path: str = "auto") -> torch.Tensor:
    """DoRA compose ``delta = (g-1)*base + g*(s*lora)``, autograd-aware.

    ``path``: ``"eager"`` (torch reference), ``"fused"`` (Triton kernels) or
    ``"auto"``.  Every path computes the same function bit for bit in the forward
    (numerical contract, DESIGN.md section 2).  ``g`` must be fp32 and finite;
    non-finite activations propagate as in any torch layer (use
    :func:`compose_stable` to have them rejected).  Empty inputs return empty.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    check_compose_args(base, lora, g)
    s, _, _ = scale_constants(check_scale(scale))
    check_finite("g", g.detach())
    if path in ("auto", "eager"):
        return ComposeFunction.apply(base, lora, g, s)
    raise NotImplementedError("path='fused' needs the Triton kernels (dora_num.ops.kernels)")
