"""The fp32 terms of the factored row norm: ``base``, ``cross``, ``ba``, before the assembly.

``||W_j + s(BA)_j||^2 = base_j + 2s cross_j + s^2 ba_j`` with ``base = rowsum(W*W)`` (one pass over
the frozen W, which also finds its exactly zero rows: what the norm caches), ``U = W A^T`` and
``G = A A^T`` (:mod:`dora_num.ops.products`), ``cross = rowsum(B*U)`` and ``ba = rowsum((B G) * B)``
by the torch tail (row blocks of ``B``; the Triton tail sums them in its own order,
:mod:`dora_num.ops.kernels.norm_tail`).  Each is a sum within
:func:`~dora_num.numerics.bounds.factored_norm_bound` in any order.  :func:`factored_terms` is the
reference the torch tail assembles (``norm_assembly(TorchFP32CorrectSqrt, *factored_terms(...))``
is its bare result bit for bit); the orchestration of cache, tail, guard and flag is
:mod:`dora_num.ops.norm`.  Memory and the tails in full: docs/operator.md, "Row norms".
"""

from __future__ import annotations

import torch

from ..numerics.formulas import scale_constants
from ..numerics.norm_posterior import lora_row_magnitudes
from .config import OpConfig, get_config, uses_tail_kernel
from .products import _products, autocast_off, chunk_columns
from .validation import check_lora_factors, check_scale, check_tensor

# The torch tail's three [rows, r] fp32 blocks: 24 MiB keeps 8192 x r=384 to two row blocks, since the
# loop is bound by its launches (the CUDA default is the tail kernel: data/gpu/norm_bench.csv)
ROW_CHUNK_BYTES = 24 * 2**20
_PASSES = [0]  # passes of _base_and_zero_rows over a W, for base_passes()


def base_passes() -> int:
    """How many passes over a W have formed ``rowsum(W*W)`` in this process (eager or inside the
    compiled custom ops): the tests' check that a cache, not the call, forms it."""
    return _PASSES[0]


def base_pass(W: torch.Tensor, chunk_bytes, cfg: OpConfig) -> tuple:
    """Which pass :func:`_base_and_zero_rows` runs over ``W`` under ``cfg``, as a hashable key: the row
    kernel with its tiles and W's strides, which the launch specializes on (``("kernel",
    OpConfig.row_sumsq_tiles, strides)``), or torch over fp32 column chunks of that width (``("torch",
    columns)``).  Each fixes the order of ``rowsum(W*W)``: a value formed by one pass is not another's
    bit for bit, so every cache of it keys on this."""
    if uses_tail_kernel(W.device, cfg):
        return ("kernel", cfg.row_sumsq_tiles, tuple(W.stride()))
    return ("torch", chunk_columns(W.shape[0], W.shape[1], chunk_bytes))


def _base_and_zero_rows(W: torch.Tensor, chunk_bytes, cfg: OpConfig, zero: bool = True):
    """``(rowsum(W*W), W's exactly zero rows)`` (fp32, bool ``[d_out]``; the second None without
    ``zero``), from one pass over W (:func:`base_pass`: the kernel where the tail is the Triton one, else fp32 column
    chunks of W under ``chunk_bytes``)."""
    d_out, d_in = W.shape
    kind, cols = base_pass(W, chunk_bytes, cfg)[:2]
    _PASSES[0] += 1
    with torch.no_grad():
        if kind == "kernel":
            from .kernels.row_sumsq import row_sumsq  # imported lazily: triton is heavy

            base, zero_rows = row_sumsq(W.detach(), config=cfg)
            return base, (zero_rows if zero else None)
        with autocast_off(W.device.type):
            acc = torch.zeros(d_out, dtype=torch.float32, device=W.device)
            zero_rows = torch.ones(d_out, dtype=torch.bool, device=W.device) if zero else None
            for start in range(0, d_in, cols):
                Wc = W[:, start : start + cols].float()
                acc += (Wc * Wc).sum(dim=1)
                if zero:
                    zero_rows &= (Wc == 0).all(dim=1)
        return acc, zero_rows


def base_row_norm_sq(W: torch.Tensor, *, chunk_bytes: int | None = None) -> torch.Tensor:
    """``rowsum(W*W)`` in fp32; depends on the frozen W only.  Where the norm's tail is the Triton
    kernel (:func:`~dora_num.ops.config.uses_tail_kernel`) one pass of
    :mod:`dora_num.ops.kernels.row_sumsq` (a fixed order); elsewhere torch over fp32 column chunks
    of W under ``chunk_bytes``."""
    check_tensor("W", W, ndim=2)
    return _base_and_zero_rows(W, chunk_bytes, get_config(), zero=False)[0]


def _check_base_sq(base_sq, d_out: int, device) -> None:
    check_tensor("base_sq", base_sq, ndim=1, dtypes=(torch.float32,))
    if base_sq.shape[0] != d_out or base_sq.device != device:
        raise ValueError(
            f"base_sq must be float32 [d_out] = [{d_out}] on {device}, "
            f"got shape {tuple(base_sq.shape)} on {base_sq.device}"
        )


def _torch_tail_terms(U: torch.Tensor, B: torch.Tensor, G: torch.Tensor, guard=None, inv=None):
    """``(cross, ba)`` fp32 ``[d_out]`` of the torch tail: over row blocks of ``B`` (fp32 copies
    under ``ROW_CHUNK_BYTES``), ``cross = rowsum(B*U)`` and ``ba = rowsum((B G) * B)``; with the
    guard's constants also ``(lora_abs, b_abs)`` of
    :func:`~dora_num.numerics.norm_posterior.lora_row_magnitudes` over the same blocks."""
    d_out, r = B.shape
    cross = torch.empty(d_out, dtype=torch.float32, device=B.device)
    ba = torch.empty(d_out, dtype=torch.float32, device=B.device)
    mags = None if guard is None else (torch.empty_like(cross), torch.empty_like(cross))
    rows = max(1, ROW_CHUNK_BYTES // (3 * 4 * r))
    for start in range(0, d_out, rows):
        Bc = B[start : start + rows].float()
        cross[start : start + rows] = (Bc * U[start : start + rows]).sum(dim=1)
        ba[start : start + rows] = ((Bc @ G) * Bc).sum(dim=1)
        if mags is not None:
            la, bb = lora_row_magnitudes(Bc, G, constants=guard, inv=inv)
            mags[0][start : start + rows], mags[1][start : start + rows] = la, bb
        del Bc
    return (cross, ba) if mags is None else (cross, ba, *mags)


def factored_terms(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, *,
                   chunk_bytes: int | None = None, base_sq: torch.Tensor | None = None):
    """``(base_sq, cross, ba, two_s, s_sq)``: what the factored norm's torch tail assembles.

    The fp32 ``[d_out]`` terms ``base_sq = rowsum(W*W)`` (or the given cached one),
    ``cross = rowsum(B * W A^T)``, ``ba = rowsum((B A A^T) * B)`` and the fp32 constants
    ``2s``, ``s^2`` of :func:`~dora_num.numerics.formulas.scale_constants`, computed by the
    same code and in the same order as :func:`~dora_num.ops.norm.factored_row_norm` with the torch
    tail (``OpConfig.norm_tail="torch"``), whose bare result (``on_cancellation="off"``; the guard
    changes only the rows it recomputes) is ``norm_assembly(TorchFP32CorrectSqrt,
    *factored_terms(...))`` bit for bit.  (The Triton
    tail sums ``cross`` and ``ba`` in another order, within the same bound.)  For studies
    of the assembly (notebook 02).  No gradient; inputs are not checked for finiteness.
    """
    d_out, d_in, r = check_lora_factors(W, A, B)
    s, two_s, s_sq = scale_constants(check_scale(scale))
    cols = chunk_columns(d_out, d_in, chunk_bytes)
    if base_sq is not None:
        _check_base_sq(base_sq, d_out, W.device)
    with torch.no_grad(), autocast_off(W.device.type):
        acc_base = base_row_norm_sq(W, chunk_bytes=chunk_bytes) if base_sq is None else base_sq
        if s == 0.0:
            zeros = torch.zeros_like(acc_base)
            return acc_base, zeros, zeros.clone(), 0.0, 0.0
        U, G = _products(W, A, cols, get_config())[:2]
        cross, ba = _torch_tail_terms(U, B, G)
    return acc_base, cross, ba, two_s, s_sq
