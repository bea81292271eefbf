"""The tail of the factored row norm in one Triton launch: ``cross``, ``ba``, the
assembly, the cancellation guard (per row: the assembly's condition ``kappa`` and a
guaranteed relative error bound ``rel``), and (for :class:`~dora_num.ops.layer.DoRALinear`)
the denominator of ``g = m / den`` with one device flag for finiteness and the guard.

Given the fp32 ``U = W A^T`` ``[d_out, r]``, ``G = A A^T`` ``[r, r]`` and
``base_sq = rowsum(W*W)`` (:mod:`dora_num.ops.norm`), each program takes
``BLOCK_M`` rows of ``B`` and computes, in fp32::

    cross = rowsum(B * U)            # products rounded, then tl.sum's fixed tree
    BG    = B @ G                    # tl.dot, input_precision="ieee" (fp32 FMA chain)
    ba    = rowsum(BG * B)
    wnorm = assembly(base_sq, cross, ba)   # norm_assembly.assemble, production variant
    # GUARD (lemma 4', docs/bounds.md), from the same loads of B:
    lora_abs = rowsum(|B| * nA) * k + r eta,  b_abs = rowsum(|B|) * k   # nA_k >= ||A_k|| from diag(G)
    kappa, rel = posterior(base_sq, cross, ba, lora_abs, b_abs)        # ~40 flops per row
    # with m:
    den   = wnorm, or eps where wnorm == 0   # eps guards zero rows only
    flag[program] = max over its rows of: 2 if !isfinite(wnorm) or !isfinite(m / den) (div_rn),
                                          1 if rel > rel_max, else 0

Why a kernel: the torch sequence it replaces (a cast of ``B``, two products, a
GEMM, two reductions, two copies, the six operations of the assembly, then the
clamp, the division and ``isfinite(g).all()``, and the guard's ~40 elementwise
operations) is tens of launches of microseconds each; at 4096->4096, r=384 the
layer's forward+backward was bound by that host work (notebook 05).  Here it is one
launch, and ``BG`` and the fp32 copy of ``B`` never exist in memory (extra memory:
``U`` and ``G``, plus 3 x ``d_out`` fp32 and the flag; with the guard 2 x ``d_out`` more).
The guard's extra work per row is two length-``r`` reductions beside the ``r^2`` of ``BG``
and ~40 flops, against the ``d_in r`` products of ``U`` per row: about ``2 / d_in`` of the
norm's arithmetic (``2.4e-4`` at ``d_in = 8192``).

Numerics.  ``cross`` and ``ba`` are sums in an order other than torch's; the
bound of :func:`dora_num.numerics.bounds.factored_norm_bound` holds for any
order (it charges ``gamma_{d+r}`` and ``gamma_{d+2r}``), and so does the guard's
(``lora_abs`` and ``b_abs`` are raised for a length-``r`` sum in any order).  The assembly is the
production variant (no contraction: ``enable_fp_fusion=False``; correctly
rounded ``sqrt_rn``), so given the same ``cross`` and ``ba`` it is bitwise equal
to :func:`~dora_num.numerics.formulas.norm_assembly` in torch; the guard is the fp32 sequence
of :func:`~dora_num.numerics.norm_bounds.posterior_from_terms` (``sqrt_rn``, ``div_rn``), bitwise
equal given the same terms and magnitudes; the denominator is an exact selection and ``div_rn``
is the correctly rounded division torch uses, so ``m / den`` in torch is bitwise the ``g`` the
flag looked at.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...numerics.norm_bounds import PosteriorConstants
from ..config import OpConfig, get_config
from .compose import new_buffer
from .norm_assembly import assemble


@triton.jit
def _posterior(base, cross, ba, lora_abs, b_abs, two_s, s_sq, ts, s2, cb1, cb2, gb, gc4, gc1, tc, gcr, ga, ga1,
               gar, eta, q_s2, q_u2, q_u3, q_eta, lift, floor, lo, up1, u):
    """``(kappa, rel)`` of :func:`dora_num.numerics.norm_bounds.posterior_from_terms`: the same
    fp32 operations in the same order (launched without contraction, correctly rounded sqrt
    and division), on the constants of :func:`~dora_num.numerics.norm_bounds.posterior_constants`."""
    ab = tl.abs(base)
    aba = tl.abs(ba)
    Qh = (s_sq * ba) + ((two_s * cross) + base)
    tcr = tl.abs(ts * cross)
    mag = ab + tcr + s_sq * aba
    b_up = (ab + cb1) * cb2
    e_b = b_up * gb + cb1
    e_c = tl.sqrt_rn(b_up) * lora_abs * gc4 + (b_abs * gc1) * tc + gcr
    e_a = (lora_abs * lora_abs) * ga + ((b_abs * b_abs) * ga1) * tc + ((b_abs + 1.0) * gar) * eta
    dQ = e_b + e_c * ts + e_a * s2 + aba * q_s2 + aba * eta + (ab + s_sq * aba) * q_u2 + tcr * q_u3 + q_eta
    dQ = dQ * lift + floor
    Q_lo = (Qh - dQ) * lo
    ok = (tl.abs(dQ) < float("inf")) & (tl.abs(Qh) < float("inf")) & (Q_lo > 0.0)
    q = tl.math.div_rn(dQ, tl.where(ok, Q_lo, 1.0))
    rel = tl.where(ok, ((q * 0.5) * up1 + u) * lift, float("inf"))
    pos = (tl.abs(Qh) < float("inf")) & (Qh > 0.0)
    kappa = tl.where(pos, tl.math.div_rn(mag, tl.where(pos, Qh, 1.0)), float("inf"))
    kappa = tl.where(mag == 0.0, 1.0, kappa)
    return kappa, rel


@triton.jit
def _norm_tail_kernel(u_ptr, b_ptr, gram_ptr, base_ptr, m_ptr, wnorm_ptr, den_ptr, flag_ptr, kappa_ptr, rel_ptr,
                      zrow_ptr, gc_ptr, d_out, r, two_s, s_sq, eps, rel_max,
                      HAS_M: tl.constexpr, GUARD: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    if GUARD:  # the constants of posterior_constants, in field order from ts (one small device tensor)
        ts, s2 = tl.load(gc_ptr + 0), tl.load(gc_ptr + 1)
        na_add, na_mul, na_up = tl.load(gc_ptr + 2), tl.load(gc_ptr + 3), tl.load(gc_ptr + 4)
        k_up, r_eta = tl.load(gc_ptr + 5), tl.load(gc_ptr + 6)
        cb1, cb2, gb = tl.load(gc_ptr + 7), tl.load(gc_ptr + 8), tl.load(gc_ptr + 9)
        gc4, gc1, tc, gcr = tl.load(gc_ptr + 10), tl.load(gc_ptr + 11), tl.load(gc_ptr + 12), tl.load(gc_ptr + 13)
        ga, ga1, gar, eta = tl.load(gc_ptr + 14), tl.load(gc_ptr + 15), tl.load(gc_ptr + 16), tl.load(gc_ptr + 17)
        q_s2, q_u2, q_u3, q_eta = tl.load(gc_ptr + 18), tl.load(gc_ptr + 19), tl.load(gc_ptr + 20), tl.load(gc_ptr + 21)
        lift, floor, lo, up1, u = (tl.load(gc_ptr + 22), tl.load(gc_ptr + 23), tl.load(gc_ptr + 24),
                                   tl.load(gc_ptr + 25), tl.load(gc_ptr + 26))
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < d_out
    row_off = rows.to(tl.int64)[:, None] * r
    cross = tl.zeros([BLOCK_M], dtype=tl.float32)
    ba = tl.zeros([BLOCK_M], dtype=tl.float32)
    lora_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    babs_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, r, BLOCK_R):
        cols = n0 + tl.arange(0, BLOCK_R)
        col_mask = cols < r
        mask = row_mask[:, None] & col_mask[None, :]
        b_n = tl.load(b_ptr + row_off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u_n = tl.load(u_ptr + row_off + cols[None, :], mask=mask, other=0.0)
        cross += tl.sum(b_n * u_n, axis=1)
        if GUARD:  # ||A_k|| from the diagonal of G (lora_row_magnitudes), then the two row sums
            g_nn = tl.load(gram_ptr + cols * r + cols, mask=col_mask, other=0.0)
            n_a = tl.sqrt_rn((tl.maximum(g_nn, 0.0) + na_add) * na_mul) * na_up
            a_n = tl.abs(b_n)
            lora_acc += tl.sum(a_n * n_a[None, :], axis=1)
            babs_acc += tl.sum(a_n, axis=1)
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
    finite = tl.abs(w) < float("inf")  # False for NaN too
    if HAS_M:
        den = tl.where(w == 0.0, eps, w)  # eps guards zero rows only (NaN propagates)
        tl.store(den_ptr + rows, den, mask=row_mask)
        m = tl.load(m_ptr + rows, mask=row_mask, other=1.0).to(tl.float32)
        g = tl.math.div_rn(m, den)
        finite = finite & (tl.abs(g) < float("inf"))
    code = tl.where(finite, 0, 2)
    if GUARD:
        lora_abs = lora_acc * k_up + r_eta
        b_abs = babs_acc * k_up
        kappa, rel = _posterior(base, cross, ba, lora_abs, b_abs, two_s, s_sq, ts, s2, cb1, cb2, gb, gc4, gc1, tc,
                                gcr, ga, ga1, gar, eta, q_s2, q_u2, q_u3, q_eta, lift, floor, lo, up1, u)
        if HAS_Z:  # W's row exactly zero and B's too: Q^ = Q = 0 exactly, which the terms alone cannot tell
            z = tl.load(zrow_ptr + rows, mask=row_mask, other=0).to(tl.int32)
            rel = tl.where((z != 0) & (b_abs == 0.0), 0.0, rel)
        tl.store(kappa_ptr + rows, kappa, mask=row_mask)
        tl.store(rel_ptr + rows, rel, mask=row_mask)
        code = tl.maximum(code, tl.where(rel > rel_max, 1, 0))
    if HAS_M or GUARD:
        flag = tl.max(tl.where(row_mask, code, 0), axis=0)
        tl.store(flag_ptr + tl.program_id(0), flag)  # one slot per program: no zero-fill, no atomics


class TailResult(NamedTuple):
    """What :func:`norm_tail` returns (fields None where not asked for)."""

    wnorm: torch.Tensor  # fp32 [d_out]
    den: torch.Tensor | None  # with m: the denominator of g (wnorm, or eps where wnorm == 0)
    flag: torch.Tensor | None  # with m or guard: int32 [programs], the FLAG_* codes of dora_num.ops.guard
    kappa: torch.Tensor | None  # with guard: fp32 [d_out], the assembly's condition from the terms
    rel: torch.Tensor | None  # with guard: fp32 [d_out], the guaranteed relative error bound of wnorm


def norm_tail(U: torch.Tensor, B: torch.Tensor, G: torch.Tensor, base_sq: torch.Tensor,
              two_s: float, s_sq: float, *, m: torch.Tensor | None = None, eps: float | None = None,
              guard: PosteriorConstants | None = None, rel_max: float | None = None,
              zero_rows: torch.Tensor | None = None, config: OpConfig | None = None) -> TailResult:
    """:class:`TailResult` ``(wnorm, den, flag, kappa, rel)``: fp32 ``[d_out]`` row norms; with ``m``
    the denominator ``den`` of ``g = m / den`` (``wnorm``, or ``eps`` where ``wnorm == 0``: eps
    guards zero rows only); with ``guard`` (the constants of
    :func:`~dora_num.numerics.norm_bounds.posterior_constants` for these ``two_s``, ``s_sq``,
    ``d_in``, ``r`` and product model) the per-row condition ``kappa`` and guaranteed relative
    error bound ``rel`` of lemma 4' (docs/bounds.md); ``zero_rows`` (bool ``[d_out]``, with
    ``guard``): rows of W known to be exactly zero, whose ``rel`` is 0 where B's row is zero too
    (the norm is then exactly 0).  ``flag`` (with ``m`` or ``guard``): an
    int32 device tensor with one entry per program (``ceil(d_out / block_m)``), each the largest
    code of its rows: :data:`~dora_num.ops.guard.FLAG_NONFINITE` (2) where ``wnorm`` or ``m / den`` is not finite,
    else :data:`~dora_num.ops.guard.FLAG_CANCELLATION` (1) where ``rel > rel_max``, else
    :data:`~dora_num.ops.guard.FLAG_OK` (0).

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
    if zero_rows is not None:
        specs.append(("zero_rows", zero_rows, (d_out,), (torch.bool,)))
    for name, t, shape, dtypes in specs:
        if t.dtype not in dtypes or tuple(t.shape) != shape or t.device != B.device:
            raise ValueError(f"norm_tail: {name} must be {shape} of {dtypes} on {B.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if m is not None and eps is None:
        raise ValueError("norm_tail: eps is required with m")
    if guard is not None:
        if rel_max is None:
            raise ValueError("norm_tail: rel_max is required with guard")
        if (guard.two_s, guard.s_sq) != (float(two_s), float(s_sq)):
            raise ValueError("norm_tail: guard constants were made for other two_s, s_sq")
    cfg = get_config() if config is None else config
    tiles = cfg.norm_tail_tiles
    dev = B.device
    U, B, G, base_sq = (t.contiguous() for t in (U, B, G, base_sq))
    wnorm = new_buffer((d_out,), torch.float32, dev, cfg.poison)
    den = new_buffer((d_out,), torch.float32, dev, cfg.poison) if m is not None else None
    n_programs = triton.cdiv(d_out, tiles.block_m)
    flag = new_buffer((n_programs,), torch.int32, dev, cfg.poison) if m is not None or guard is not None else None
    kappa = new_buffer((d_out,), torch.float32, dev, cfg.poison) if guard is not None else None
    rel = new_buffer((d_out,), torch.float32, dev, cfg.poison) if guard is not None else None
    if d_out:
        block_r = max(16, min(tiles.block_r, triton.next_power_of_2(r)))
        block_k = max(16, min(tiles.block_k, triton.next_power_of_2(r)))
        _norm_tail_kernel[(n_programs,)](
            U, B, G, base_sq, m.contiguous() if m is not None else base_sq,
            wnorm, den if den is not None else wnorm, flag if flag is not None else wnorm,
            kappa if kappa is not None else wnorm, rel if rel is not None else wnorm,
            zero_rows.contiguous() if zero_rows is not None else wnorm, _constants_on(guard, dev),
            d_out, r, float(two_s), float(s_sq), float(eps if eps is not None else 0.0),
            float(rel_max if rel_max is not None else 0.0),
            HAS_M=m is not None, GUARD=guard is not None, HAS_Z=zero_rows is not None and guard is not None,
            BLOCK_M=tiles.block_m, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=tiles.num_warps,
            enable_fp_fusion=False,
        )
    return TailResult(wnorm, den, flag, kappa, rel)


_CONSTANTS: dict = {}  # (PosteriorConstants, device) -> fp32 device tensor of its fields from ts on


def _constants_on(guard: PosteriorConstants | None, device) -> torch.Tensor:
    """The guard's constants as one fp32 device tensor (cached: one pointer argument instead of 27
    floats, whose per-launch argument handling would cost host time on every forward)."""
    key = (guard, str(device))
    t = _CONSTANTS.get(key)
    if t is None:
        vals = list(guard[2:]) if guard is not None else [0.0] * (len(PosteriorConstants._fields) - 2)
        t = torch.tensor(vals, dtype=torch.float32, device=device)
        assert guard is None or t.double().tolist() == vals  # every constant is an fp32 number
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        _CONSTANTS[key] = t
    return t
