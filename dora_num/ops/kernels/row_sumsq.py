"""``rowsum(W*W)`` in fp32 and the mask of W's exactly zero rows, in one pass over W.

``base_sq`` of the factored norm (:mod:`dora_num.ops.norm`).  Per program, ``block_m`` rows; per row,
the products ``w*w`` of the upcast entries (exact upcast, one fp32 rounding each), summed over column
blocks of ``block_k`` by ``tl.sum``'s fixed tree into a running fp32 sum (the tiles:
``OpConfig.row_sumsq_tiles``).  The order is fixed by the tiles and by W's strides (Triton specializes a
launch on them: on the H100 a transposed W and its contiguous copy differ in the last bit on 25 of 70 rows),
so the result is bitwise the same on every call for one W under one configuration: eager (cached on W)
and compiled (recomputed per call, since a compiled graph keeps no cache) agree bit for bit, and a
cached value carries the tiles and strides it was formed under (:func:`dora_num.ops.norm.base_cache_key`).  Bound, any order and so any tiles:
``|base^ - base| <= gamma_{d_in} base + (1 + gamma_{d_in}) n_b 2^-150``, ``n_b <= d_in`` the squares
below fp32's normal range.  Launched without contraction, like every kernel of the package.

References: the bound is lemma 4 of docs/bounds.md (its first line); the tiles' defaults come from
the sweep in ``data/gpu/tile_sweep.csv`` (``dora-num record tiles``, its ``row_sumsq`` rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import OpConfig, get_config
from ._common import new_buffer, row_block


@triton.jit
def _row_sumsq_kernel(w_ptr, out_ptr, zero_ptr, d_out, d_in, stride_m, stride_k,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, row_mask = row_block(d_out, BLOCK_M)
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
    row of ``W`` (fp32, bf16 or fp16, any strides) is exactly zero (``-0.0`` is zero).  ``config``
    (default :func:`~dora_num.ops.config.get_config`): the tiles (``row_sumsq_tiles``) and ``poison``."""
    cfg = get_config() if config is None else config
    tiles = cfg.row_sumsq_tiles
    d_out, d_in = W.shape
    out = new_buffer((d_out,), torch.float32, W.device, cfg.poison)
    zero = new_buffer((d_out,), torch.int8, W.device, cfg.poison)
    if d_out:
        _row_sumsq_kernel[(triton.cdiv(d_out, tiles.block_m),)](
            W, out, zero, d_out, d_in, W.stride(0), W.stride(1), BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps, enable_fp_fusion=False)
    return out, zero.view(torch.bool)
