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
