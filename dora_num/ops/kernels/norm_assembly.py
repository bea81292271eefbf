"""Triton norm assembly ``wnorm = sqrt(max(base_sq + 2s*cross + s^2*ba, 0))``, in variants.

The sequence of :func:`dora_num.numerics.formulas.norm_assembly` (:func:`assemble`, shared with the
production tail of :mod:`.norm_tail`).  Variants for notebook 02's study: ``fp_fusion`` (contraction of
the two multiply-adds into FMA) and ``sqrt`` (``"approx"``: ``tl.sqrt``, 1 ulp off on about 17% of
inputs on the H200; ``"rn"``: ``tl.sqrt_rn``; ``"ptx"``: inline ``sqrt.rn.f32``).  Production,
``fp_fusion=False, sqrt="rn"``, is bitwise ``norm_assembly(TorchFP32CorrectSqrt, ...)``.  In full:
docs/operator.md.

References: bound: lemma 3 of docs/bounds.md (the assembly; lemma 9, the correctly rounded sqrt);
the variants measured in ``data/gpu/fma_sqrt.csv`` (``dora-num record fma``, notebook 02).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import OpConfig, get_config
from ._common import mul_rn, new_buffer

SQRT_VARIANTS = ("approx", "rn", "ptx")
_SQRT_CODE = {"approx": 0, "rn": 1, "ptx": 2}


@triton.jit
def assemble(base, cross, ba, two_s, s_sq, SQRT: tl.constexpr, RN: tl.constexpr = False):
    """The assembly sequence of the module docstring on fp32 blocks (one definition,
    shared by :func:`_norm_assembly_kernel` and the norm tail of :mod:`.norm_tail`);
    ``SQRT``: 0 ``tl.sqrt``, 1 ``tl.sqrt_rn`` (production), 2 inline PTX ``sqrt.rn.f32``; ``RN``: the
    products by :func:`~dora_num.ops.kernels._common.mul_rn`, never contracted whatever the launch's
    ``enable_fp_fusion`` (the tail); without it the launch's flag decides (the FMA study's variants)."""
    t = mul_rn(two_s, cross, RN) + base
    t = mul_rn(s_sq, ba, RN) + t
    t = tl.maximum(t, 0.0, propagate_nan=tl.PropagateNan.ALL)
    if SQRT == 0:
        w = tl.sqrt(t)
    elif SQRT == 1:
        w = tl.sqrt_rn(t)
    else:
        w = tl.inline_asm_elementwise("sqrt.rn.f32 $0, $1;", "=r,r", [t],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return w


@triton.jit
def _norm_assembly_kernel(base_ptr, cross_ptr, ba_ptr, out_ptr, n, two_s, s_sq,
                          SQRT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    base = tl.load(base_ptr + offsets, mask=mask, other=0.0)
    cross = tl.load(cross_ptr + offsets, mask=mask, other=0.0)
    ba = tl.load(ba_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, assemble(base, cross, ba, two_s, s_sq, SQRT), mask=mask)


def norm_assembly_triton(base_sq: torch.Tensor, cross: torch.Tensor, ba: torch.Tensor,
                         two_s: float, s_sq: float, *, fp_fusion: bool = False, sqrt: str = "rn",
                         return_kernel: bool = False, config: OpConfig | None = None):
    """``wnorm`` fp32 from fp32 ``base_sq, cross, ba`` (same shape) by one Triton launch.

    ``two_s``, ``s_sq`` come from :func:`~dora_num.numerics.formulas.scale_constants`;
    ``config`` (default :func:`~dora_num.ops.config.get_config`) gives ``poison`` and
    ``interpret`` (one large block under the interpreter).
    """
    cfg = get_config() if config is None else config
    if sqrt not in SQRT_VARIANTS:
        raise ValueError(f"sqrt must be one of {SQRT_VARIANTS}, got {sqrt!r}")
    if sqrt == "ptx" and cfg.interpret:
        raise NotImplementedError("sqrt='ptx' (inline PTX) cannot run under TRITON_INTERPRET=1; "
                                  "use sqrt='rn' (the same instruction, sqrt.rn.f32) or a GPU")
    for name, t in (("base_sq", base_sq), ("cross", cross), ("ba", ba)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.shape != base_sq.shape or t.device != base_sq.device:
            raise ValueError(f"{name} must match base_sq ({tuple(base_sq.shape)} on {base_sq.device}), "
                             f"got {tuple(t.shape)} on {t.device}")
    b, c, a = (t.contiguous().view(-1) for t in (base_sq, cross, ba))
    out = new_buffer(b.shape, torch.float32, b.device, cfg.poison)
    n = b.numel()
    kernel = None
    if n:
        block = 1 << 16 if cfg.interpret else 1024
        kernel = _norm_assembly_kernel[(triton.cdiv(n, block),)](
            b, c, a, out, n, float(two_s), float(s_sq),
            SQRT=_SQRT_CODE[sqrt], BLOCK=block, num_warps=4, enable_fp_fusion=fp_fusion)
    out = out.view(base_sq.shape)
    return (out, kernel) if return_kernel else out


def ptx_instruction_counts(kernel) -> dict[str, int]:
    """Counts of the instructions the FMA/sqrt study cares about in a compiled kernel's PTX."""
    ptx = kernel.asm["ptx"] if kernel is not None else ""
    return {
        "fma.rn.f32": ptx.count("fma.rn.f32"),
        "mul.rn.f32": ptx.count("mul.rn.f32") + ptx.count("mul.f32"),
        "add.rn.f32": ptx.count("add.rn.f32") + ptx.count("add.f32"),
        "sqrt.approx": ptx.count("sqrt.approx"),
        "sqrt.rn": ptx.count("sqrt.rn"),
    }
