"""What every launcher of :mod:`dora_num.ops.kernels` shares: the output allocator
(:func:`new_buffer`) and the row-block prologue of the row kernels (:func:`row_block`).

References: ``OpConfig.poison`` (:mod:`dora_num.ops.config`) for the allocator; the row kernels
(:mod:`.row_sumsq`, :mod:`.norm_tail`) for the prologue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def new_buffer(shape, dtype, device, poison: bool) -> torch.Tensor:
    """A kernel's output buffer: ``torch.empty``, or with ``poison`` (``OpConfig.poison``, set
    by the tests) filled with NaN (-1 for integers) first, so an element a kernel fails to
    write shows up (one extra pass).  Every launcher of :mod:`dora_num.ops.kernels` allocates
    through it."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if not poison:
        return t
    return t.fill_(float("nan") if t.is_floating_point() else -1)


@triton.jit
def row_block(n_rows, BLOCK_M: tl.constexpr):
    """``(rows, row_mask)`` of this program: rows ``pid * BLOCK_M ..`` of a grid over row blocks,
    and which of them exist (the last block's tail is masked)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows < n_rows


@triton.jit
def mul_rn(a, b, RN: tl.constexpr, F64: tl.constexpr = False):
    """``a * b`` in fp32 (float64 with ``F64``), rounded once and never contracted into an FMA with a following add.

    ``RN`` (the launchers pass it on CUDA): inline PTX ``mul.rn.f32`` (``mul.rn.f64``), which neither LLVM (it
    cannot see into the asm) nor ptxas (an explicit rounding modifier is never fused) contracts, whatever
    ``enable_fp_fusion`` the kernel is compiled with.  That makes a kernel's bits independent of who
    compiles it: our launchers pass ``enable_fp_fusion=False``, Inductor compiles a kernel launched
    through ``torch.library.wrap_triton`` with Triton's default (fusion on).  ``libdevice.mul_rn``
    would not do: Triton links libdevice with FTZ reflection on, which flushes subnormals.  Without
    ``RN`` (the interpreter, which runs no asm and contracts nothing; the FMA study's variant) a plain
    multiply.  ``tl.cast``, not ``.to``: a scalar argument reaches the kernel as a Python float when Inductor
    analyses which arguments a wrapped kernel writes (it compiles the kernel with the scalars as constants).  With
    ``F64`` a constant operand must be float64 already (``tl.full([], c, tl.float64)``): a Python float in fp32's
    range is an fp32 constant in Triton, rounded before the cast."""
    if RN and F64:
        a, b = tl.broadcast(tl.cast(a, tl.float64), tl.cast(b, tl.float64))
        return tl.inline_asm_elementwise("mul.rn.f64 $0, $1, $2;", "=l,l,l", [a, b], dtype=tl.float64,
                                         is_pure=True, pack=1)
    elif RN:
        a, b = tl.broadcast(tl.cast(a, tl.float32), tl.cast(b, tl.float32))
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def mul_rn64(a, b, RN: tl.constexpr):
    """:func:`mul_rn` in float64."""
    return mul_rn(a, b, RN, True)


def launcher(kernel, traced: bool):
    """``kernel``, or ``wrap_triton(kernel)`` where a ``triton_op``'s body is traced (Inductor then launches
    the kernel from its generated code, with no Python of ours per call)."""
    return torch.library.wrap_triton(kernel) if traced else kernel


def fusion_opts(fp_fusion: bool, traced: bool) -> dict:
    """The launch's ``enable_fp_fusion`` (our launches: off, the package's convention); none where traced
    (Inductor compiles a wrapped kernel with Triton's default, fusion on, and takes no such option): the
    kernels' :func:`mul_rn` keeps the bits."""
    return {} if traced else {"enable_fp_fusion": fp_fusion}
