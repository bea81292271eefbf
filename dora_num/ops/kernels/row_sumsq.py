"""``rowsum(W*W)`` in fp32 and the mask of W's exactly zero rows, in one pass over W.

``base_sq`` of the factored norm (:mod:`dora_num.ops.norm`).  Per program, ``BLOCK_M`` rows; per row,
the products ``w*w`` of the upcast entries (exact upcast, one fp32 rounding each), summed over column
blocks of ``BLOCK_K`` by ``tl.sum``'s fixed tree into a running fp32 sum.  The order is fixed by the
tiles, so the result is bitwise the same on every call: eager (cached on W) and compiled (recomputed
per call, since a compiled graph keeps no cache) agree bit for bit.  Bound, any order:
``|base^ - base| <= gamma_{d_in} base`` plus ``d_in 2^-150`` for products below fp32's normal range
(lemma 4 of docs/bounds.md).  Launched without contraction, like every kernel of the package.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import OpConfig, get_config
from .compose import new_buffer

BLOCK_M = 8  # rows per program: d_out = 1024 gives 128 programs on the H200's 132 SMs
BLOCK_K = 512  # columns per step (4 KiB of bf16 per row per step)


@triton.jit
def _row_sumsq_kernel(w_ptr, out_ptr, zero_ptr, d_out, d_in, stride_m, stride_k,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < d_out
    row_off = rows.to(tl.int64)[:, None] * stride_m
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    nonzero = tl.zeros([BLOCK_M], dtype=tl.int32)
    for k0 in range(0, d_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < d_in)[None, :]
        w = tl.load(w_ptr + row_off + cols[None, :].to(tl.int64) * stride_k, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * w, axis=1)
        nonzero = tl.maximum(nonzero, tl.max(tl.where(w != 0.0, 1, 0), axis=1))
    tl.store(out_ptr + rows, acc, mask=row_mask)
    tl.store(zero_ptr + rows, (nonzero == 0).to(tl.int8), mask=row_mask)


def row_sumsq(W: torch.Tensor, *, config: OpConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base_sq, zero_rows)``: fp32 ``rowsum(W*W)`` ``[d_out]`` and bool ``[d_out]``, True where the
    row of ``W`` (fp32, bf16 or fp16, any strides) is exactly zero.  ``config``: ``poison``."""
    cfg = get_config() if config is None else config
    d_out, d_in = W.shape
    out = new_buffer((d_out,), torch.float32, W.device, cfg.poison)
    zero = new_buffer((d_out,), torch.int8, W.device, cfg.poison)
    if d_out:
        _row_sumsq_kernel[(triton.cdiv(d_out, BLOCK_M),)](
            W, out, zero, d_out, d_in, W.stride(0), W.stride(1), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
            num_warps=4, enable_fp_fusion=False)
    return out, zero.view(torch.bool)
