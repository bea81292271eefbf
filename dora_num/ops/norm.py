"""Row norms of ``W + s*B@A``: dense (PEFT-style) and factored (never forms BA).

Math
----
``||W_j + s(BA)_j||^2 = base_j + 2s cross_j + s^2 ba_j`` with
``base = rowsum(W*W)``, ``U = W A^T``, ``cross = rowsum(B*U)``,
``G = A A^T``, ``ba = rowsum((B G) * B)``; assembled by
:func:`dora_num.numerics.formulas.norm_assembly`.

Where it loses accuracy: the assembly is a sum whose condition number is
``kappa = (base + |2s cross| + s^2 ba) / wnorm^2``.  With fp32 terms each carrying
relative error ``~ gamma_{d_in} u`` (pairwise summation: ``~ log2(d_in) u``),
``wnorm^2`` carries about ``kappa`` times that; the dense norm pays the same
cancellation at the element level instead (it rounds ``W + s(BA)`` elementwise,
relative error u on each element of the *result*), so the factored norm loses to
the dense one only when ``kappa`` is large (the update cancelling the row).
Realistic adapters have ``||sBA|| << ||W||`` and ``kappa ≈ 1``.

Memory: the only ``d_in``-sized temporaries are one fp32 chunk of W and its
square, ``2 * d_out * chunk * 4`` bytes, kept under ``chunk_bytes``; with a
cached ``base_sq`` the W chunk is still needed for ``U = W A^T``.
"""

from __future__ import annotations

import torch

from ..numerics.arithmetic import TorchFP32CorrectSqrt
from ..numerics.formulas import norm_assembly, scale_constants
from .validation import check_finite, check_lora_factors, check_scale, check_tensor

CHUNK_ALIGN = 64  # columns; chunk widths are multiples of this (coalesced, tensor-core friendly)
DEFAULT_CHUNK_BYTES = 256 * 2**20


def dense_row_norm(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """``||W + s*B@A||_row`` in fp32 by materialising the dense ``[d_out, d_in]`` sum.

    The PEFT-style reference, evaluated in fp32 (PEFT itself works in the weight
    dtype).  Costs ``d_out * d_in * 4`` bytes (twice, with the product).  Checks
    all inputs for NaN/Inf.  No gradient.
    """
    check_lora_factors(W, A, B)
    s = check_scale(scale)
    for name, t in (("W", W), ("A", A), ("B", B)):
        check_finite(name, t)
    with torch.no_grad(), torch.autocast(W.device.type, enabled=False):
        dense = W.float() + s * (B.float() @ A.float())
        return torch.linalg.vector_norm(dense, dim=1)


def _chunk_columns(d_out: int, d_in: int, chunk_bytes: int) -> int:
    """Widest chunk (a multiple of 64 columns, or all of ``d_in``) whose fp32
    copy of W plus its square fit in ``chunk_bytes``."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    per_column = 2 * 4 * max(d_out, 1)  # fp32 chunk of W and its elementwise square
    smallest = min(CHUNK_ALIGN, d_in)
    if chunk_bytes < smallest * per_column:
        raise ValueError(
            f"chunk_bytes={chunk_bytes} is smaller than one {smallest}-column fp32 chunk of W "
            f"(needs {smallest * per_column} bytes for d_out={d_out})"
        )
    cols = chunk_bytes // per_column
    if cols >= d_in:
        return d_in
    return max(CHUNK_ALIGN, cols // CHUNK_ALIGN * CHUNK_ALIGN)


def base_row_norm_sq(W: torch.Tensor, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``rowsum(W*W)`` in fp32, chunked along ``d_in``; depends on the frozen W only."""
    check_tensor("W", W, ndim=2)
    d_out, d_in = W.shape
    cols = _chunk_columns(d_out, d_in, chunk_bytes)
    with torch.no_grad(), torch.autocast(W.device.type, enabled=False):
        acc = torch.zeros(d_out, dtype=torch.float32, device=W.device)
        for start in range(0, d_in, cols):
            Wc = W[:, start : start + cols].float()
            acc += (Wc * Wc).sum(dim=1)
        return acc


def factored_row_norm(
    W: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: float,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    base_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """``||W + s*B@A||_row`` in fp32 without forming ``B@A`` or an fp32 copy of W.

    Accumulates ``base = rowsum(W*W)`` and ``U = W A^T`` over column chunks of W
    (each a multiple of 64 columns, under ``chunk_bytes``), in fp32 under
    ``no_grad`` with autocast off, then ``cross``, ``ba`` and the assembly of
    :func:`~dora_num.numerics.formulas.norm_assembly` with a correctly rounded
    square root.  ``scale == 0`` skips the cross and Gram terms.  ``base_sq``, if
    given, is the cached ``rowsum(W*W)`` (fp32 ``[d_out]``).

    A non-finite result raises ``ValueError`` naming the input at fault (the check
    costs O(d_out) unless it fires).  A zero row gives ``wnorm = 0`` exactly;
    :func:`magnitude_scale` turns that into a finite ``g``.
    """
    d_out, d_in, r = check_lora_factors(W, A, B)
    s_raw = check_scale(scale)
    cols = _chunk_columns(d_out, d_in, chunk_bytes)
    if base_sq is not None:
        check_tensor("base_sq", base_sq, ndim=1, dtypes=(torch.float32,))
        if base_sq.shape[0] != d_out or base_sq.device != W.device:
            raise ValueError(
                f"base_sq must be float32 [d_out] = [{d_out}] on {W.device}, "
                f"got shape {tuple(base_sq.shape)} on {base_sq.device}"
            )
    s, two_s, s_sq = scale_constants(s_raw)
    with torch.no_grad(), torch.autocast(W.device.type, enabled=False):
        need_base = base_sq is None
        acc_base = torch.zeros(d_out, dtype=torch.float32, device=W.device) if need_base else base_sq
        U = torch.zeros(d_out, r, dtype=torch.float32, device=W.device) if s != 0.0 else None
        for start in range(0, d_in, cols):
            Wc = W[:, start : start + cols].float()
            if need_base:
                acc_base = acc_base + (Wc * Wc).sum(dim=1)
            if U is not None:
                U.addmm_(Wc, A[:, start : start + cols].float().T)
            del Wc
        if U is None:
            zeros = torch.zeros_like(acc_base)
            wnorm = norm_assembly(TorchFP32CorrectSqrt, acc_base, zeros, zeros, 0.0, 0.0)
        else:
            Bf = B.float()
            Af = A.float()
            cross = (Bf * U).sum(dim=1)
            G = Af @ Af.T
            ba = ((Bf @ G) * Bf).sum(dim=1)
            wnorm = norm_assembly(TorchFP32CorrectSqrt, acc_base, cross, ba, two_s, s_sq)
    if not bool(torch.isfinite(wnorm).all()):
        for name, t in (("W", W), ("A", A), ("B", B)) + ((("base_sq", base_sq),) if base_sq is not None else ()):
            check_finite(name, t)
        raise ValueError(
            "factored row norm overflowed float32 (inputs are finite): the squared row norm "
            "exceeds 3.4e38; rescale W or the adapter"
        )
    return wnorm


def magnitude_scale(m: torch.Tensor, wnorm: torch.Tensor, *, eps: float | None = None) -> torch.Tensor:
    """``g = m / max(wnorm, eps)`` in fp32 (differentiable in ``m``; ``wnorm`` detached).

    ``eps`` defaults by the dtype of ``m``: ``1e-12`` for fp32/fp64 (as
    ``torch.nn.functional.normalize``), ``1e-6`` for bf16/fp16 magnitudes.  A row
    with ``wnorm = 0`` (an all-zero row of ``W + sBA``, where PEFT divides by
    zero) thus gets the finite ``g = m / eps``; at DoRA init such a row has
    ``m = 0`` and so ``g = 0``.
    """
    check_tensor("m", m, ndim=1)
    check_tensor("wnorm", wnorm, ndim=1, dtypes=(torch.float32, torch.float64))
    if m.shape != wnorm.shape:
        raise ValueError(f"m has shape {tuple(m.shape)} but wnorm has {tuple(wnorm.shape)}")
    if m.device != wnorm.device:
        raise ValueError(f"m is on {m.device} but wnorm on {wnorm.device}")
    if eps is None:
        eps = 1e-6 if m.dtype in (torch.float16, torch.bfloat16) else 1e-12
    if not (eps > 0):
        raise ValueError(f"eps must be positive, got {eps}")
    check_finite("m", m.detach())
    check_finite("wnorm", wnorm)
    return m.float() / torch.clamp_min(wnorm.detach().float(), eps)
