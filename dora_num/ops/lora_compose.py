"""The LoRA up-projection and the compose of :class:`~dora_num.ops.layer.DoRALinear` as one autograd node
that keeps ``xa = x A^T`` instead of ``lora = xa B^T``.

The compose's backward needs ``inner = s*lora + base`` for ``dg``; kept as ``base`` and ``lora`` that is
4 bytes per output element in bf16 (``OpConfig.recompute_inner``).  ``xa`` (``[T, r]``) is kept anyway
(the up-projection's backward needs it), so :class:`LoraComposeFunction` saves ``base``, ``xa`` and the
cast ``B`` and forms ``lora = xa B^T`` again in its backward: the same ``torch.mm`` of the same operands
and layouts, so the same bits, and half the bytes.  Its backward then runs the very operations autograd
would run for ``F.linear(xa, B)`` (``MmBackward0``'s layouts, the cast back to B's dtype), so every
gradient is bitwise the unfused path's (tests/ops/test_lora_compose.py).  One difference: an ``xa`` used
by two forwards before one backward under autocast gets B's two gradient terms summed in fp32, where
autocast's shared cast of B sums them in its dtype first (``OpConfig.recompute_lora=False`` restores it).
Under ``torch.compile`` the same node is the custom op ``dora_num::lora_compose_fwd`` (:func:`lora_compose`),
with the output add in the same pass (the same kernels as eagerly, forward and backward).
"""

from __future__ import annotations

import torch

from .compose import _EMPTY, _bwd_impl, _fwd_impl, _kernels, compose_bwd_op, traceable
from .config import OpConfig

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts for F.linear


def lora_dtype(xa: torch.Tensor, B: torch.Tensor, base: torch.Tensor) -> torch.dtype | None:
    """The dtype of ``lora = xa B^T`` on the path :class:`LoraComposeFunction` serves, or None where it
    does not serve these arguments (autocast off with B of another dtype: the promoting path)."""
    dev = xa.device.type
    if torch.is_autocast_enabled(dev):
        cdt = torch.get_autocast_dtype(dev)
        if xa.dtype != cdt or B.dtype not in _CASTABLE:
            return None
    else:
        cdt = xa.dtype
        if B.dtype != cdt:
            return None
    return cdt if base.dtype == cdt else None


def _column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _mm_mat1_grad(grad: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """The gradient of ``mat1`` in ``mat1.mm(mat2)`` as autograd's ``MmBackward0`` forms it."""
    return mat2.mm(grad.t()).t() if _column_major(mat1) else grad.mm(mat2.t())


def _mm_mat2_grad(grad: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """The gradient of ``mat2`` in ``mat1.mm(mat2)`` as autograd's ``MmBackward0`` forms it."""
    return grad.t().mm(mat1).t() if _column_major(mat2) else mat1.t().mm(grad)


class LoraComposeFunction(torch.autograd.Function):
    """``compose(base, xa B^T, g)`` (module docstring).

    ``apply(base, xa, B, g, s, cdt, fused, add_base, cfg)``: ``base`` ``[..., d_out]``, ``xa``
    ``[..., r]`` (the down-projection's output), ``B`` ``[d_out, r]`` (cast to ``cdt`` where it is not in
    it, as ``F.linear`` under autocast casts it), ``g`` fp32 ``[d_out]``, ``s`` the fp32-exact scale,
    ``fused`` the compose tier, ``add_base`` the output add folded into the compose, ``cfg`` the
    configuration of forward and backward.
    """

    @staticmethod
    def forward(ctx, base, xa, B, g, s: float, cdt: torch.dtype, fused: bool, add_base: bool, cfg: OpConfig):
        B_c = B if B.dtype == cdt else B.to(cdt)
        xa2 = xa.reshape(-1, xa.shape[-1])  # F.linear of a batched input: matmul folds it to 2-D
        lora = torch.mm(xa2, B_c.t()).view(*base.shape[:-1], B_c.shape[0])
        out = _fwd_impl(base, lora, g, s, False, fused, cfg, add_base=add_base)[0]
        ctx.save_for_backward(base, xa2, B_c, g)
        ctx.s, ctx.fused, ctx.add_base, ctx.cfg = s, fused, add_base, cfg
        ctx.b_dtype, ctx.xa_shape = B.dtype, xa.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        base, xa2, B_c, g = ctx.saved_tensors
        n_base, n_xa, n_B, n_g = ctx.needs_input_grad[:4]
        lora = torch.mm(xa2, B_c.t()).view(base.shape) if n_g else None  # the forward's, bit for bit
        need_lora = n_xa or n_B
        dlora, dbase, dg = _bwd_impl(grad, None, g, ctx.s, need_lora, n_base, n_g, ctx.fused, ctx.cfg, base, lora,
                                     add_grad=ctx.add_base)
        dxa = dB = None
        if need_lora:
            dl2 = dlora.reshape(-1, dlora.shape[-1])
            if n_B:  # MmBackward0's mat2 gradient, the transpose's backward, the cast's
                dB = _mm_mat2_grad(dl2, xa2, B_c.t()).t()
                dB = dB if dB.dtype == ctx.b_dtype else dB.to(ctx.b_dtype)
            if n_xa:
                dxa = _mm_mat1_grad(dl2, xa2, B_c.t()).view(ctx.xa_shape)
        return dbase, dxa, dB, dg, None, None, None, None, None


def lora_compose(base, xa, B, g, s: float, cdt: torch.dtype, fused: bool, add_base: bool, cfg: OpConfig):
    """The node of :class:`LoraComposeFunction`: eagerly the Function, under ``torch.compile`` the custom
    op ``dora_num::lora_compose_fwd`` (the same saved tensors; its output add is the graph's)."""
    if not torch.compiler.is_compiling():
        return LoraComposeFunction.apply(base, xa, B, g, s, cdt, fused, add_base, cfg)
    B_c = B if B.dtype == cdt else B.to(cdt)
    if traceable(fused, cfg, base.device) and xa.shape[-1] > 1:  # rank 1: Inductor makes a K = 1 product a multiply
        return _lora_compose_fused_op(base, xa, B_c, g, s, add_base, cfg.key)
    return _lora_compose_fwd_op(base, xa, B_c, g, s, fused, add_base, cfg.key)


@torch.library.custom_op("dora_num::lora_compose_fwd", mutates_args=())
def _lora_compose_fwd_op(base: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, g: torch.Tensor, s: float,
                         fused: bool, add_base: bool, config: str) -> torch.Tensor:
    """``compose(base, xa B^T, g)`` (``base +`` it with ``add_base``: the output add in the compose's
    pass, as eagerly); ``B`` already in the products' dtype."""
    lora = torch.mm(xa.reshape(-1, xa.shape[-1]), B.t()).view(*base.shape[:-1], B.shape[0])
    return _fwd_impl(base, lora, g, s, False, fused, OpConfig.from_key(config), add_base=add_base)[0]


@_lora_compose_fwd_op.register_fake
def _(base, xa, B, g, s, fused, add_base, config):
    return torch.empty_like(base)


def _op_setup_context(ctx, inputs, output):
    base, xa, B, g, s, fused, add_base, config = inputs
    ctx.save_for_backward(base, xa, B, g)
    ctx.s, ctx.fused, ctx.add_base, ctx.config, ctx.traced = s, fused, add_base, config, False


def _op_backward(ctx, grad):
    base, xa, B, g = ctx.saved_tensors
    n_base, n_xa, n_B, n_g = ctx.needs_input_grad[:4]
    xa2 = xa.reshape(-1, xa.shape[-1])
    if not n_g:
        lora = base.new_empty(_EMPTY)
    elif ctx.traced:  # the forward's product is in the same traced graph: formed again opaquely (below)
        lora = _lora_again_op(xa2, B).view(base.shape)
    else:
        lora = torch.mm(xa2, B.t()).view(base.shape)
    dlora, dbase, dg = compose_bwd_op(grad.contiguous(), base, lora, g, ctx.s, bool(n_xa or n_B), bool(n_base),
                                      bool(n_g), ctx.fused, ctx.config, bool(ctx.add_base and n_base))
    dxa = dB = None
    if n_xa or n_B:
        dl2 = dlora.reshape(-1, dlora.shape[-1])
        dB = _mm_mat2_grad(dl2, xa2, B.t()).t() if n_B else None
        dxa = _mm_mat1_grad(dl2, xa2, B.t()).view(xa.shape) if n_xa else None
    return (dbase if n_base else None), dxa, dB, (dg if n_g else None), None, None, None, None


_lora_compose_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


@torch.library.triton_op("dora_num::lora_compose_fused", mutates_args=())
def _lora_compose_fused_op(base: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, g: torch.Tensor, s: float,
                           add_base: bool, config: str) -> torch.Tensor:
    """:func:`_lora_compose_fwd_op` on the fused tier on CUDA, traced by Inductor (the product an extern
    ``mm``, the compose kernel launched by Inductor's code: :func:`~dora_num.ops.compose.traceable`)."""
    lora = torch.mm(xa.reshape(-1, xa.shape[-1]), B.t()).view(*base.shape[:-1], B.shape[0])
    return _kernels().compose_fwd(base, lora, g, s, add_base=add_base, config=OpConfig.from_key(config),
                                  traced=True)[0]


def _fused_setup_context(ctx, inputs, output):
    base, xa, B, g, s, add_base, config = inputs
    ctx.save_for_backward(base, xa, B, g)
    ctx.s, ctx.fused, ctx.add_base, ctx.config, ctx.traced = s, True, add_base, config, True


# The backward forms lora = xa B^T again (the forward's product, bit for bit) instead of keeping it.  In a
# graph where the forward's product is traced too, the two are the same node to the joint graph's common
# subexpression elimination, which merges them, and the partitioner then keeps lora (a GEMM is never
# recomputed): 2 bytes per output element more.  Formed inside an opaque op, the product stays the
# backward's own.

@torch.library.custom_op("dora_num::lora_again", mutates_args=())
def _lora_again_op(xa: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``torch.mm(xa, B.t())``: the forward's product, formed again in the backward."""
    return torch.mm(xa, B.t())


@_lora_again_op.register_fake
def _(xa, B):
    return xa.new_empty((xa.shape[0], B.shape[0]))


_lora_compose_fused_op.register_autograd(_op_backward, setup_context=_fused_setup_context)
