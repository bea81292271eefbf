"""The sum of a product's blocks in one fixed order: the last step of the split products.

``U = W [P_1; ...; P_p]^T`` comes as ``[d_out, p r]`` and ``G = S S^T`` as ``[p r, p r]``
(:mod:`dora_num.ops.products`); their ``p`` (``p^2``) blocks are added in fp32, in the order block 0, 1,
... (row-major over the ``(a, b)`` blocks of G), each addition one rounding.  A torch ``.sum`` over those
blocks leaves the order to the reduction kernel, and a compiled graph's reduction (Inductor's tree)
orders them otherwise: the norm's bits would then depend on whether the layer is compiled.  This kernel
(no multiplications, so nothing to contract) is what eager and compiled both run on CUDA; elsewhere
:func:`dora_num.ops.products.block_sum` adds the blocks with torch in the same order, bit for bit.

References: the block additions are charged in lemma 4 (the split's ``p - 1`` and ``p^2 - 1`` additions,
:mod:`dora_num.numerics.split_products`), whatever their order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import OpConfig, get_config
from ._common import new_buffer


@triton.jit
def _block_sum_kernel(src_ptr, dst_ptr, n_rows, n_cols, ld, PA: tl.constexpr, PB: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_rows * n_cols
    i = offs // n_cols
    j = offs % n_cols
    acc = tl.load(src_ptr + i * ld + j, mask=mask, other=0.0)
    for t in tl.static_range(1, PA * PB):
        a = t // PB
        b = t % PB
        acc = acc + tl.load(src_ptr + (a * n_rows + i) * ld + b * n_cols + j, mask=mask, other=0.0)
    tl.store(dst_ptr + offs, acc, mask=mask)


def block_sum_cuda(src: torch.Tensor, n_rows: int, n_cols: int, pa: int, pb: int, *,
                   config: OpConfig | None = None, traced: bool = False) -> torch.Tensor:
    """fp32 ``[n_rows, n_cols]``: the sum of the ``pa x pb`` blocks of the contiguous fp32 ``src``
    (``[pa n_rows, pb n_cols]``) in row-major block order.  ``traced``: launched through
    ``torch.library.wrap_triton`` (the body of a traced op, :mod:`dora_num.ops.weight_norm`)."""
    cfg = get_config() if config is None else config
    out = new_buffer((n_rows, n_cols), torch.float32, src.device, cfg.poison)
    n = n_rows * n_cols
    if n:
        block = 1024
        kernel = torch.library.wrap_triton(_block_sum_kernel) if traced else _block_sum_kernel
        opts = {} if traced else {"enable_fp_fusion": False}  # nothing to contract; the package's convention
        kernel[(triton.cdiv(n, block),)](src, out, n_rows, n_cols, src.stride(0), PA=pa, PB=pb, BLOCK=block,
                                        num_warps=4, **opts)
    return out
