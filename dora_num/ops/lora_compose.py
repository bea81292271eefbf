"""The LoRA products and the compose of :class:`~dora_num.ops.layer.DoRALinear` as one autograd node.

Eagerly, ``lora = (x A^T) B^T`` and ``compose(base, lora, g)`` record up to seven autograd nodes
(two casts of the adapters under autocast, a cast of ``x``, two products, the transposes of A and
B folded into them, the compose), and each node costs the autograd engine host time on every
backward; at the model level the DoRA layer's training step is bound by that host time, not by
the GPU (``data/gpu/layer_breakdown.csv``).  :class:`LoraComposeFunction` records one node and
computes, in its backward, the very operations autograd would run for those nodes, in the same
order and with the same operand layouts (``torch.mm`` of the same views; autograd's
``mm_mat1_backward``/``mm_mat2_backward`` choose the layout from the strides of the operand, and
the transposed weights ``A^T``, ``B^T`` are column-major), so the forward and every gradient are
bitwise the unfused path's (tests: ``tests/ops/test_lora_compose.py``, on the CPU and on CUDA).

What it covers (:func:`covers`; the layer keeps the unfused path otherwise): autocast on (the
adapters and ``x`` cast to the autocast dtype, as ``F.linear`` under autocast casts them) or
adapters of the activation dtype without autocast (no casts); no dropout between ``x`` and the
LoRA branch (the compose then sees the same ``x`` in both terms); no promotion of ``lora`` to a
wider dtype; no ``compose_fn`` seam; not under ``torch.compile`` (the custom ops serve it).
"""

from __future__ import annotations

import torch

from .compose import _bwd_impl, _fwd_impl
from .config import OpConfig

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts for F.linear


def lora_dtype(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, base: torch.Tensor) -> torch.dtype | None:
    """The dtype of the LoRA products on the path :class:`LoraComposeFunction` serves, or None
    where it does not serve these arguments (the layer's unfused path then runs)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        cdt = torch.get_autocast_dtype(dev)
        if x.dtype != cdt or A.dtype not in _CASTABLE or B.dtype not in _CASTABLE:
            # x is cast by autocast, which shares one cast among the uses of a leaf (the base
            # product's and the LoRA branch's): their gradients then meet in the autocast dtype;
            # fp64 adapters are not cast by autocast (F.linear's error is the unfused path's)
            return None
    else:
        cdt = x.dtype
        if A.dtype != cdt or B.dtype != cdt:
            return None  # the promoting path (wider adapters without autocast)
    return cdt if base.dtype == cdt else None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _mm_mat1_grad(grad: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """The gradient of ``mat1`` in ``mat1.mm(mat2)`` as autograd's ``MmBackward0`` forms it (a
    column-major ``mat1`` gets a column-major gradient)."""
    return mat2.mm(grad.t()).t() if _column_major(mat1) else grad.mm(mat2.t())


def _mm_mat2_grad(grad: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """The gradient of ``mat2`` in ``mat1.mm(mat2)`` as autograd's ``MmBackward0`` forms it."""
    return grad.t().mm(mat1).t() if _column_major(mat2) else mat1.t().mm(grad)


class LoraComposeFunction(torch.autograd.Function):
    """``compose(base, (x A^T) B^T, g)`` with the LoRA products in ``cdt`` (module docstring).

    ``apply(base, x, A, B, g, s, cdt, fused, add_base, cfg)``: ``base`` ``[..., d_out]`` (the
    base product, its own autograd node), ``x`` ``[..., d_in]``, ``A`` ``[r, d_in]``, ``B``
    ``[d_out, r]`` (cast to ``cdt`` where they are not in it), ``g`` fp32 ``[d_out]``, ``s`` the
    fp32-exact scale, ``fused`` the compose tier, ``add_base`` the output add folded into the
    compose (:func:`~dora_num.ops.compose._compose`), ``cfg`` the configuration of forward and
    backward.  Returns the compose's output.
    """

    @staticmethod
    def forward(ctx, base, x, A, B, g, s: float, cdt: torch.dtype, fused: bool, add_base: bool,
                cfg: OpConfig):
        x_c, A_c, B_c = _as(x, cdt), _as(A, cdt), _as(B, cdt)
        x2 = x_c.reshape(-1, x_c.shape[-1])
        # F.linear of a 2-D input with no bias is mm(input, weight.t()); a batched input is folded
        # to 2-D first, as matmul folds it
        xa = torch.mm(x2, A_c.t())
        lora = torch.mm(xa, B_c.t())
        lora = lora.view(*base.shape[:-1], lora.shape[-1])
        recompute = fused and cfg.recompute_inner and g.requires_grad
        out, inner = _fwd_impl(base, lora, g, s, g.requires_grad and not recompute, fused, cfg, add_base=add_base)
        ctx.save_for_backward(x2, A_c, xa, B_c, g, inner, base if recompute else None, lora if recompute else None)
        ctx.s, ctx.fused, ctx.add_base, ctx.cfg = s, fused, add_base, cfg
        ctx.dtypes = (x.dtype, A.dtype, B.dtype)
        ctx.x_shape = x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x2, A_c, xa, B_c, g, inner, base, lora = ctx.saved_tensors
        n_base, n_x, n_A, n_B, n_g = ctx.needs_input_grad[:5]
        need_lora = n_x or n_A or n_B
        dlora, dbase, dg = _bwd_impl(grad, inner, g, ctx.s, need_lora, n_base, n_g, ctx.fused, ctx.cfg, base, lora,
                                     add_grad=ctx.add_base)
        dx = dA = dB = None
        if need_lora:
            dl2 = dlora.reshape(-1, dlora.shape[-1])
            # autograd's MmBackward0 of mm(xa, B_c.t()) and mm(x2, A_c.t()), then the transposes'
            # backward (.t()) and the casts' (to the adapter's and x's own dtype)
            if n_B:
                dB = _as(_mm_mat2_grad(dl2, xa, B_c.t()).t(), ctx.dtypes[2])
            if n_x or n_A:
                dxa = _mm_mat1_grad(dl2, xa, B_c.t())
                if n_A:
                    dA = _as(_mm_mat2_grad(dxa, x2, A_c.t()).t(), ctx.dtypes[1])
                if n_x:
                    dx = _as(_mm_mat1_grad(dxa, x2, A_c.t()), ctx.dtypes[0]).view(ctx.x_shape)
        return dbase, dx, dA, dB, dg, None, None, None, None, None
