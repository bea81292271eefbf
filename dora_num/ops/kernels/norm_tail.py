"""The tail of the factored row norm in one Triton launch: ``cross``, ``ba``, the
assembly, and (for :class:`~dora_num.ops.layer.DoRALinear`) ``max(wnorm, eps)`` with
a finiteness flag of ``g = m / max(wnorm, eps)``.

Given the fp32 ``U = W A^T`` ``[d_out, r]``, ``G = A A^T`` ``[r, r]`` and
``base_sq = rowsum(W*W)`` (:mod:`dora_num.ops.norm`), each program takes
``BLOCK_M`` rows of ``B`` and computes, in fp32::

    cross = rowsum(B * U)            # products rounded, then tl.sum's fixed tree
    BG    = B @ G                    # tl.dot, input_precision="ieee" (fp32 FMA chain)
    ba    = rowsum(BG * B)
    wnorm = assembly(base_sq, cross, ba)   # norm_assembly.assemble, production variant
    den   = max(wnorm, eps)          # optional, with m:
    flag[program] = any(!isfinite(wnorm) or !isfinite(m / den))   # div_rn: torch's division

Why a kernel: the torch sequence it replaces (a cast of ``B``, two products, a
GEMM, two reductions, two copies, the six operations of the assembly, then the
clamp, the division and ``isfinite(g).all()``) is ~17 launches of microseconds
each; at 4096->4096, r=384 the layer's forward+backward was bound by that host
work (notebook 05).  Here it is one launch, and ``BG`` and the fp32 copy of ``B``
never exist in memory (extra memory: ``U`` and ``G``, plus 3 x ``d_out`` fp32).

Numerics.  ``cross`` and ``ba`` are sums in an order other than torch's; the
bound of :func:`dora_num.numerics.bounds.factored_norm_bound` holds for any
order (it charges ``gamma_{d+r}`` and ``gamma_{d+2r}``).  The assembly is the
production variant (no contraction: ``enable_fp_fusion=False``; correctly
rounded ``sqrt_rn``), so given the same ``cross`` and ``ba`` it is bitwise equal
to :func:`~dora_num.numerics.formulas.norm_assembly` in torch; ``max`` is exact
and ``div_rn`` is the correctly rounded division torch uses, so ``m / den`` in
torch is bitwise the ``g`` the flag looked at.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import OpConfig, get_config
from .compose import new_buffer
from .norm_assembly import assemble


@triton.jit
def _norm_tail_kernel(u_ptr, b_ptr, gram_ptr, base_ptr, m_ptr, wnorm_ptr, den_ptr, flag_ptr,
                      d_out, r, two_s, s_sq, eps,
                      HAS_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < d_out
    row_off = rows.to(tl.int64)[:, None] * r
    cross = tl.zeros([BLOCK_M], dtype=tl.float32)
    ba = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, r, BLOCK_R):
        cols = n0 + tl.arange(0, BLOCK_R)
        col_mask = cols < r
        mask = row_mask[:, None] & col_mask[None, :]
        b_n = tl.load(b_ptr + row_off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u_n = tl.load(u_ptr + row_off + cols[None, :], mask=mask, other=0.0)
        cross += tl.sum(b_n * u_n, axis=1)
        bg = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, r, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < r
            b_k = tl.load(b_ptr + row_off + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                          other=0.0).to(tl.float32)
            g_k = tl.load(gram_ptr + ks[:, None] * r + cols[None, :], mask=k_mask[:, None] & col_mask[None, :],
                          other=0.0)
            bg = tl.dot(b_k, g_k, bg, input_precision="ieee")
        ba += tl.sum(bg * b_n, axis=1)
    base = tl.load(base_ptr + rows, mask=row_mask, other=0.0)
    w = assemble(base, cross, ba, two_s, s_sq, 1)
    tl.store(wnorm_ptr + rows, w, mask=row_mask)
    if HAS_M:
        den = tl.maximum(w, eps, propagate_nan=tl.PropagateNan.ALL)
        tl.store(den_ptr + rows, den, mask=row_mask)
        m = tl.load(m_ptr + rows, mask=row_mask, other=1.0).to(tl.float32)
        g = tl.math.div_rn(m, den)
        finite = (tl.abs(w) < float("inf")) & (tl.abs(g) < float("inf"))  # False for NaN too
        bad = tl.max(tl.where(row_mask & ~finite, 1, 0), axis=0)
        tl.store(flag_ptr + tl.program_id(0), bad)  # one slot per program: no zero-fill, no atomics


def norm_tail(U: torch.Tensor, B: torch.Tensor, G: torch.Tensor, base_sq: torch.Tensor,
              two_s: float, s_sq: float, *, m: torch.Tensor | None = None, eps: float | None = None,
              config: OpConfig | None = None):
    """``(wnorm, den, flag)``: fp32 ``[d_out]`` row norms, and with ``m``: ``max(wnorm, eps)``
    and an int32 device flag with one entry per program (``ceil(d_out / block_m)``), some
    entry nonzero iff some ``wnorm`` or ``m / den`` is not finite (``den`` and ``flag`` are
    None without ``m``).

    ``U`` fp32 ``[d_out, r]``, ``B`` ``[d_out, r]`` (fp32, bf16 or fp16), ``G`` fp32
    ``[r, r]``, ``base_sq`` and ``m`` ``[d_out]`` (``m`` fp32, bf16 or fp16), all on one
    device; ``two_s``, ``s_sq`` from :func:`~dora_num.numerics.formulas.scale_constants`.
    No value checks (the flag is the check).  ``config`` (default
    :func:`~dora_num.ops.config.get_config`): the tiles (``norm_tail_tiles``, whose
    ``block_m`` is the program count's divisor) and ``poison``.
    """
    d_out, r = B.shape
    specs = [("U", U, (d_out, r), (torch.float32,)),
             ("B", B, (d_out, r), (torch.float32, torch.bfloat16, torch.float16)),
             ("G", G, (r, r), (torch.float32,)),
             ("base_sq", base_sq, (d_out,), (torch.float32,))]
    if m is not None:
        specs.append(("m", m, (d_out,), (torch.float32, torch.bfloat16, torch.float16)))
    for name, t, shape, dtypes in specs:
        if t.dtype not in dtypes or tuple(t.shape) != shape or t.device != B.device:
            raise ValueError(f"norm_tail: {name} must be {shape} of {dtypes} on {B.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if m is not None and eps is None:
        raise ValueError("norm_tail: eps is required with m")
    cfg = get_config() if config is None else config
    tiles = cfg.norm_tail_tiles
    dev = B.device
    U, B, G, base_sq = (t.contiguous() for t in (U, B, G, base_sq))
    wnorm = new_buffer((d_out,), torch.float32, dev, cfg.poison)
    den = new_buffer((d_out,), torch.float32, dev, cfg.poison) if m is not None else None
    n_programs = triton.cdiv(d_out, tiles.block_m)
    flag = new_buffer((n_programs,), torch.int32, dev, cfg.poison) if m is not None else None
    if d_out:
        block_r = max(16, min(tiles.block_r, triton.next_power_of_2(r)))
        block_k = max(16, min(tiles.block_k, triton.next_power_of_2(r)))
        _norm_tail_kernel[(n_programs,)](
            U, B, G, base_sq, m.contiguous() if m is not None else base_sq,
            wnorm, den if m is not None else wnorm, flag if m is not None else wnorm,
            d_out, r, float(two_s), float(s_sq), float(eps if eps is not None else 0.0),
            HAS_M=m is not None, BLOCK_M=tiles.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
            num_warps=tiles.num_warps, enable_fp_fusion=False,
        )
    return wnorm, den, flag

