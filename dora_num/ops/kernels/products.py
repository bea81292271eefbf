"""The exact steps of the split products in Triton: the split of A into 16-bit pieces and the sum of a
product's blocks in one fixed order.

The block sum is what the factored norm runs on CUDA, eagerly and in a compiled graph (launched there by
Inductor through ``torch.library.wrap_triton``), so that the two form the same bits; the split is the
compiled graph's (eagerly torch's steps, the same values: each is exact or correctly rounded):

- :func:`split_cuda`: ``P[p] = RN(R_p)``, ``R_{p+1} = R_p - P[p]`` (exact), as
  :func:`dora_num.ops.products.split_pieces` defines them.  Written as torch operations and compiled,
  Inductor fuses the cast to 16 bits and the upcast back into one kernel and drops the pair (its
  ``emulate_precision_casts`` is off by default): every later piece would come out zero, and ``U``,
  ``G`` would keep only A's first 8 bits (measured on an H100: adapter gradients off by up to 0.4% of their
  largest entry).
- :func:`block_sum_cuda`: ``U = W [P_1; ...; P_p]^T`` comes as ``[d_out, p r]`` and ``G = S S^T`` as
  ``[p r, p r]``; their ``p`` (``p^2``) blocks are added in fp32 in the order block 0, 1, ... (row-major
  over the ``(a, b)`` blocks of G), each addition one rounding.  A torch ``.sum`` leaves the order to the
  reduction kernel, and a compiled graph's reduction orders the blocks otherwise.

Neither has a multiplication that an addition follows (the fp16 split's scaling is ``mul_rn``), so
nothing to contract.  Elsewhere (CPU, the interpreter, which truncates casts to bf16) torch runs the same
steps (:mod:`dora_num.ops.products`).

References: the split's exactness and the block additions' charge: lemma 4 and
:mod:`dora_num.numerics.split_products`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import OpConfig, get_config
from ._common import fusion_opts, launcher, mul_rn, new_buffer


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
    (``[pa n_rows, pb n_cols]``) in row-major block order, on CUDA.  ``traced``: launched through
    ``torch.library.wrap_triton`` (the body of a traced op, :mod:`dora_num.ops.weight_norm`)."""
    cfg = get_config() if config is None else config
    out = new_buffer((n_rows, n_cols), torch.float32, src.device, cfg.poison)
    n = n_rows * n_cols
    if n:
        block = 1024
        kernel, opts = launcher(_block_sum_kernel, traced), fusion_opts(False, traced)
        kernel[(triton.cdiv(n, block),)](src, out, n_rows, n_cols, src.stride(0), PA=pa, PB=pb, BLOCK=block,
                                        num_warps=4, **opts)
    return out


@triton.jit
def _split_kernel(a_ptr, scale_ptr, p_ptr, n, PIECES: tl.constexpr, HAS_SCALE: tl.constexpr, RN: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:  # fp16 pieces: A 2^k (a power of two: exact unless it underflows)
        r = mul_rn(r, tl.load(scale_ptr), RN)
    for p in tl.static_range(PIECES):
        piece = r.to(p_ptr.dtype.element_ty)  # round to nearest even
        tl.store(p_ptr + p * n + offs, piece, mask=mask)
        r = r - piece.to(tl.float32)  # exact


def split_cuda(A: torch.Tensor, dtype: torch.dtype, pieces: int, scale: torch.Tensor | None = None, *,
               config: OpConfig | None = None, traced: bool = False) -> torch.Tensor:
    """``P`` ``[pieces, r, d]`` of ``dtype``: the greedy split of ``A`` (times the 0-dim fp32 ``scale``, if
    given) of :func:`dora_num.ops.products.split_pieces`, on CUDA.  ``traced``: launched through
    ``wrap_triton``."""
    cfg = get_config() if config is None else config
    a = A if A.is_contiguous() else A.contiguous()
    P = new_buffer((pieces,) + tuple(A.shape), dtype, A.device, cfg.poison)
    n = a.numel()
    if n:
        block = 1024
        kernel, opts = launcher(_split_kernel, traced), fusion_opts(False, traced)
        kernel[(triton.cdiv(n, block),)](a, scale if scale is not None else a, P, n, PIECES=pieces,
                                        HAS_SCALE=scale is not None, RN=not cfg.interpret, BLOCK=block, num_warps=4,
                                        **opts)
    return P
