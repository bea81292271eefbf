r"""The factored norm's cancellation guard: which rows to trust, and the accurate recompute of the others.

Per row, from the tail's fp32 terms of ``Q = base + 2s cross + s^2 ba``: the assembly's condition
``kappa = (base + |2s cross| + s^2 ba) / Q`` and a guaranteed relative error bound ``rel`` of the
computed norm (lemma 4' of docs/bounds.md); rows with ``rel > CANCELLATION_REL = 2^-6`` are formed
again in float64 from the rows of W and A (lemma 5').  The decision travels in the norm's finiteness
flag (no device sync on the fast path).  The whole account (the flag's codes, the causes named, the
modes, the cost): docs/operator.md, "The cancellation guard of the factored norm".
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from ..numerics.arithmetic import TorchFP32CorrectSqrt
from ..numerics.formulas import norm_assembly, scale_constants
from ..numerics.norm_bounds import PosteriorConstants, posterior_constants
from ..numerics.norm_posterior import lora_row_magnitudes, posterior_from_terms
from ..numerics.standard_model import U32, U64, gamma
from .config import uses_tail_kernel
from .products import factored_products, fp32_matmul_precision, takes_w_whole
from .terms import factored_terms
from .validation import FORMAT_NAMES

ON_CANCELLATION = ("recompute", "warn", "raise", "off")
CANCELLATION_REL = 2.0**-6  # the guaranteed relative error of wnorm above which a row is recomputed (docstring)
FLAG_OK, FLAG_CANCELLATION, FLAG_UNRESOLVED, FLAG_NONFINITE = 0, 1, 2, 3  # codes of the norm's flag (largest wins)
FLAG_COUNT = 4  # the kernel's per-program flag is FLAG_COUNT * (rows flagged) + the largest code (decode)
_NAMED = 8  # rows named in a message


class CancellationWarning(RuntimeWarning):
    """Rows of the factored norm were recomputed (``on_cancellation="warn"``), or stay inaccurate
    after the recompute (a documented finite result, reported in every mode)."""


class CancellationError(ValueError):
    """``on_cancellation="raise"`` and the factored norm cannot guarantee some rows."""


def check_on_cancellation(mode) -> str:
    if mode not in ON_CANCELLATION:
        raise ValueError(f"on_cancellation must be one of {ON_CANCELLATION}, got {mode!r}")
    return mode


def tensor_core_products(W: torch.Tensor) -> bool:
    """Whether the guard charges the tensor-core model (lemma 4: exact products of 16-bit inputs, an
    accumulator that may truncate and flush partial sums, ``gamma_{2 d_in}``) for the factored norm
    of ``W``: 16-bit W on CUDA (directly or through the split).  IEEE fp32 GEMMs, on CUDA too, are
    charged the fp32 model, float64 accumulation (under TF32 or bf16 switches) its own:
    :func:`products_of`."""
    return products_of(W) in ("tensor_core", "split")


def products_of(W: torch.Tensor, split: int | None = None) -> str:
    """The product model (:data:`~dora_num.numerics.norm_posterior.PRODUCT_MODELS`) of ``U``, ``G`` for
    the factored norm of ``W`` (``split``: the piece count where ``U``, ``G`` came from the split of A),
    as :func:`dora_num.ops.products.product_model` chose it from the same switches."""
    if split is not None:
        return "split"
    if takes_w_whole(W):
        return "tensor_core"
    return "fp32" if fp32_matmul_precision(W.device.type) == "ieee" else "fp64"


def tail_is_certifiable(W: torch.Tensor) -> bool:
    """Whether the products of the factored norm's tail are those lemma 4' charges.  The Triton tail's
    ``B G`` is an IEEE fp32 dot (``input_precision="ieee"``); the torch tail's ``B G`` is an fp32 GEMM,
    which torch's switches may turn into TF32 (CUDA) or bf16 (oneDNN on the CPU under
    ``set_float32_matmul_precision("medium")``): then no row is certified by its terms and the guard
    recomputes every row in float64 (:func:`dora_num.ops.products.fp32_matmul_precision`)."""
    return uses_tail_kernel(W.device) or fp32_matmul_precision(W.device.type) == "ieee"


def guard_constants(two_s: float, s_sq: float, W: torch.Tensor, r: int, split: int | None = None,
                    tail_bg: str | None = None) -> PosteriorConstants:
    """The constants of lemma 4' for the factored norm of ``W`` at rank ``r``; ``split``: the piece
    count where ``U`` and ``G`` came from the split of A into pieces of W's dtype
    (:func:`dora_num.ops.products.split_mm`); ``tail_bg``: B's format where the Triton tail forms ``B G``
    on tensor cores (:func:`tail_bg_format`).  The product model is :func:`products_of`'s; where the
    tail's own fp32 GEMM is not IEEE (:func:`tail_is_certifiable`) the constants certify no row."""
    fmt = "fp16" if W.dtype == torch.float16 else "bf16"
    return posterior_constants(two_s, s_sq, d_in=W.shape[1], r=r, products=products_of(W, split),
                               split_pieces=split, split_format=fmt, certify=tail_is_certifiable(W), tail_bg=tail_bg)




def tail_bg_format(B: torch.Tensor, cfg) -> str | None:
    """B's format (``"fp32"``, ``"fp16"``, ``"bf16"``) where the Triton tail forms ``B G`` on tensor cores
    (``OpConfig.tail_bg = "tensor_core"``): what its guard constants and lemma 4 charge; None for the fp32 dot."""
    return FORMAT_NAMES.get(B.dtype) if cfg.tail_bg == "tensor_core" else None


def status(wnorm: torch.Tensor, rel: torch.Tensor | None, flag: torch.Tensor | None = None,
           g: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-d int32 device tensor: the largest ``FLAG_*`` code over all rows (the kernel's
    per-program ``flag`` if given, else from ``wnorm``, ``g`` and ``rel`` in torch).  No sync."""
    if flag is not None:
        return (flag % FLAG_COUNT).max() if flag.numel() else torch.zeros((), dtype=torch.int32, device=wnorm.device)
    bad = ~torch.isfinite(wnorm).all()
    if g is not None:
        bad = bad | ~torch.isfinite(g.detach()).all()
    code = bad.to(torch.int32) * FLAG_NONFINITE
    if rel is not None:
        code = torch.maximum(code, (rel > CANCELLATION_REL).any().to(torch.int32))
    return code


def decode(flag: torch.Tensor) -> tuple[int, int]:
    """``(code, flagged)`` of a per-program flag of the tail kernel (host or device tensor; a
    device one is read: a sync): the largest ``FLAG_*`` code and the number of rows the guard
    flagged (and recomputed, with the kernel's recompute)."""
    f = flag.to("cpu", torch.int64)
    if f.numel() == 0:
        return FLAG_OK, 0
    return int((f % FLAG_COUNT).max()), int((f // FLAG_COUNT).sum())


def report_kernel(code: int, aux: torch.Tensor, mode: str, *, where: str, warn: bool = True,
                  wnorm: torch.Tensor | None = None, d_in: int | None = None) -> None:
    """What the Triton tail's recompute leaves to be reported, once its flag was read with the
    largest code ``code`` (< ``FLAG_NONFINITE``): ``aux`` the kernel's ``[3, d_out]`` rows
    ``kappa``, ``rel`` (lemma 4', of the factored value) and ``rel_out`` (of the returned value);
    ``wnorm`` the returned norm and ``d_in`` W's width (for naming the cause, :func:`_report`).
    The values were recomputed already; the reports are those of :func:`resolve`.  Reads ``aux``
    (a sync: the rare path)."""
    if code < FLAG_CANCELLATION or mode == "off":
        return
    kappa, rel, rel_out = (t.cpu() for t in aux)
    rows = torch.nonzero(rel > CANCELLATION_REL).flatten()
    w = None if wnorm is None else wnorm.detach().cpu()[rows]
    _report(where, mode, warn, rows, kappa[rows], rel[rows], rel_out[rows], stacklevel=5, w=w, d_in=d_in)


CANCELLING_KAPPA = 2.0  # a flagged row with kappa above this cancels (the update cancels the row of W)
# A flagged row that does not cancel either has terms near fp32's underflow (Q below d_in 2^-140: the
# terms' absolute errors, d_in 2^-149 each, are then more than 2^-9 of Q) or a large update (the
# bound's relative floor, which grows with d_in, r and ||sBA|| / ||W||, passed 2^-6: docs/bounds.md)
UNDERFLOW_Q_PER_COLUMN = 2.0**-140


def causes(kappa, w, d_in: int | None) -> list[str]:
    """Why each flagged row was flagged: ``"cancellation"`` (``kappa > CANCELLING_KAPPA``),
    ``"underflow"`` (``w^2 < d_in UNDERFLOW_Q_PER_COLUMN``: the fp32 terms carry absolute errors of
    fp32's subnormal range) or ``"large update"`` (neither: the guarantee's relative floor, which
    grows with ``d_in``, the rank and ``||sBA|| / ||W||``, exceeds ``2^-6``).  ``w``: the row's
    accurate (recomputed) norm; without it (or ``d_in``) a non-cancelling row is ``"underflow or
    large update"``."""
    out = []
    for j in range(len(kappa)):
        if float(kappa[j]) > CANCELLING_KAPPA:
            out.append("cancellation")
        elif w is None or d_in is None:
            out.append("underflow or large update")
        elif float(w[j]) ** 2 < d_in * UNDERFLOW_Q_PER_COLUMN:
            out.append("underflow")
        else:
            out.append("large update")
    return out


_CAUSE_TEXT = {
    "cancellation": "cancellation (the update cancels the row of W: W ~ -s B A)",
    "underflow": "fp32 terms near the underflow range (a tiny norm, no cancellation)",
    "large update": ("a large update (no cancellation: ||sBA|| is a large part of ||W|| at this rank and width, "
                     "and the factored norm's guaranteed error bound passes 2^-6)"),
    "underflow or large update": "no cancellation (fp32 terms near the underflow range, or a large update)",
}


def _report(where: str, mode: str, warn: bool, idx, kappa, rel, rel_out, stacklevel: int, w=None,
            d_in: int | None = None) -> None:
    """The reports of the flagged rows ``idx`` (host tensors: their ``kappa``, the factored value's bound
    ``rel``, the returned value's ``rel_out`` and, if given, the returned norm ``w``).  Each flagged row
    has a cause (:func:`causes`): cancellation, fp32 terms near the underflow range, or a large update;
    all were recomputed.  ``"raise"``: :class:`CancellationError` for the cancelling rows that are not
    exactly zero and for the rows still not certified; ``"warn"`` (if ``warn``): a
    :class:`CancellationWarning` naming every recomputed row by cause; rows still above the threshold
    after the recompute are warned about in every mode."""
    exact = rel_out == 0
    cause = causes(kappa, w, d_in)
    cancelling = torch.tensor([c == "cancellation" for c in cause], dtype=torch.bool) & ~exact
    bad = rel_out > CANCELLATION_REL
    if mode == "raise" and bool((cancelling | bad).any()):
        parts = []
        if bool(cancelling.any()):
            parts.append(f"cancellation (the update cancels the row of W, W ~ -s B A): "
                         f"{_rows_text(idx[cancelling], kappa[cancelling], rel[cancelling])}")
        still = bad & ~cancelling
        if bool(still.any()):
            parts.append(f"not certified even in float64: {_rows_text(idx[still], kappa[still], rel_out[still])}")
        raise CancellationError(
            f"{where}: the factored norm cannot guarantee {int((cancelling | bad).sum())} row(s): {'; '.join(parts)}"
            f" (kappa = (base + |2s cross| + s^2 ba) / ||W + sBA||^2; rel = the guaranteed relative error bound, "
            f"above {CANCELLATION_REL:.3g}).  Pass on_cancellation='recompute' to have them recomputed in float64.")
    if mode == "warn" and warn:
        parts = []
        for name in _CAUSE_TEXT:
            sel = torch.tensor([c == name for c in cause], dtype=torch.bool) & ~exact
            if bool(sel.any()):
                parts.append(f"{_CAUSE_TEXT[name]}: {_rows_text(idx[sel], kappa[sel], rel[sel])}")
        if parts:
            warnings.warn(f"{where}: {int((~exact).sum())} row(s) recomputed in float64 ({'; '.join(parts)})",
                          CancellationWarning, stacklevel=stacklevel)
    if bool(bad.any()):
        warnings.warn(f"{where}: {int(bad.sum())} row(s) have no accurate fp32 norm even in float64 (the norm "
                      f"is below fp32's normal range 1.2e-38, or W + sBA cancels to float64 roundoff): rows "
                      f"{_rows_text(idx[bad], kappa[bad], rel_out[bad])} (rel now: the float64 bound); "
                      "returned: the float64 norm rounded to fp32", CancellationWarning, stacklevel=stacklevel)


_NO_BITS = 1 << 20  # the lsb exponent given to zeros: they constrain nothing


def _lsb_exponent(x: torch.Tensor) -> torch.Tensor:
    """Per element of a float64 tensor the exponent of its lowest set bit (``x`` is an odd multiple of
    ``2^e``); ``_NO_BITS`` for zeros."""
    bits = x.contiguous().view(torch.int64)
    field = (bits >> 52) & 0x7FF
    sig = (bits & ((1 << 52) - 1)) | torch.where(field > 0, 1 << 52, 0)
    low = sig & (-sig)  # the lowest set bit of the significand, a power of two <= 2^52 (exact in float64)
    tz = torch.frexp(low.double()).exponent.to(torch.int64) - 1
    e = torch.where(field > 0, field - 1075, torch.full_like(field, -1074)) + tz
    return torch.where(x == 0, torch.full_like(e, _NO_BITS), e)


def dense_rows_fp64(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float, rows: torch.Tensor, *,
                    chunk_bytes: int = 64 * 2**20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``(w, rel, kappa)`` for the ``k`` rows ``rows``: fp32 ``w = RN32(||W_j + s (B A)_j||)`` with
    ``x = W_j + s (B_j A)`` formed in float64 (lemma 5', docs/bounds.md), fp32 ``rel`` a guaranteed
    bound on its relative error (0 for an exactly zero row; ``inf`` where none holds), and the
    float64 condition ``kappa = (base + |2s cross| + s^2 ba) / w^2`` of the factored assembly
    (from float64 terms, for messages; ``inf`` where ``w = 0`` and the terms are not).

    Error: the products ``B_jk A_ki`` of fp32 numbers are exact in float64 (48 bits, no
    underflow above ``2^-298``), so ``|x^_i - x_i| <= e_i = gamma64_{r+1} (|W_i| + |s| (|B||A|)_i)``;
    and ``e_i = 0`` where float64 forms ``x_i`` exactly: every product is a multiple of
    ``2^(qB_j + qA_i)`` (the smallest quanta of ``B_j`` and of column ``i`` of ``A``), so where
    ``M_i = (|B||A|)_i < 2^(53 + qB_j + qA_i)`` every partial sum is representable, and
    ``s (BA)_i`` and ``W_i + s (BA)_i`` likewise where ``|s| M_i`` and ``|W_i| + |s| M_i`` stay below
    ``2^53`` times the quanta involved.  ``| ||x^|| - ||x|| | <= ||e||``; the float64 sum of squares
    and the faithful square root add ``gamma64_{d+2} w64``; the rounding to fp32 ``u32 w64``
    (``2^-150`` below ``2^-126``).  With ``E`` their sum (``||e||`` evaluated in float64, raised by
    ``1 + 2^-30``), ``rel = E / (w64 - ||e|| - gamma64_{d+2} w64)`` where that is positive.  ``A`` is
    read in float64 column chunks under ``chunk_bytes``; memory ``O(k d_in)``."""
    k, (r, d_in) = rows.numel(), A.shape
    dev = W.device
    if k == 0:
        z = torch.zeros(0, dtype=torch.float32, device=dev)
        return z, z.clone(), z.double()
    sf = float(s)
    Br = B[rows].double()
    aBr = Br.abs()
    qB = _lsb_exponent(Br).amin(dim=1)  # [k]: every B_jk is a multiple of 2^qB_j
    q_s = int(_lsb_exponent(torch.tensor([sf], dtype=torch.float64))[0])
    sumsq = torch.zeros(k, dtype=torch.float64, device=dev)
    esq = torch.zeros(k, dtype=torch.float64, device=dev)
    base = torch.zeros(k, dtype=torch.float64, device=dev)
    U = torch.zeros(k, r, dtype=torch.float64, device=dev)
    ba = torch.zeros(k, dtype=torch.float64, device=dev)
    cols = max(1, min(d_in, chunk_bytes // (8 * (3 * k + 2 * r))))
    g_r = float(gamma(r + 1, U64))
    lim = 2.0**53 * (1 - 2.0**-40)  # float64 evaluation of the magnitudes below: a few roundings each
    for c0 in range(0, d_in, cols):
        Ac = A[:, c0:c0 + cols].double()
        Wc = W[rows, c0:c0 + cols].double()  # gathered per chunk: O(k cols) in memory
        BAc = Br @ Ac
        x = Wc + sf * BAc
        sumsq += (x * x).sum(1)
        base += (Wc * Wc).sum(1)
        ba += (BAc * BAc).sum(1)
        U += Wc @ Ac.T
        M = aBr @ Ac.abs()
        # where float64 forms x exactly (the docstring's quanta), e_i = 0
        qA = _lsb_exponent(Ac).amin(dim=0)  # [cols]
        q = (qB[:, None] + qA[None, :]).clamp(max=_NO_BITS).double()
        qW = _lsb_exponent(Wc).double()
        q_sx = (q + q_s).clamp(max=_NO_BITS)
        exact = (M < lim * torch.exp2(q)) & (abs(sf) * M < lim * torch.exp2(q_sx)) \
            & (Wc.abs() + abs(sf) * M < lim * torch.exp2(torch.minimum(qW, q_sx)))
        e = torch.where(exact, torch.zeros_like(M), g_r * (Wc.abs() + abs(sf) * M))
        esq += (e * e).sum(1)
        del Ac, Wc, x, e, BAc, M, exact
    w64 = torch.sqrt(sumsq)
    en = torch.sqrt(esq) * (1 + 2.0**-30)
    g_d = float(gamma(d_in + 2, U64))
    w32 = w64.float()
    rnd = torch.where(w64 >= 2.0**-126, U32 * w64, torch.where(w64 > 0, torch.full_like(w64, 2.0**-150), 0.0 * w64))
    E = (en + g_d * w64 + rnd) * (1 + 2.0**-40)  # the bound's own float64 roundings (a few, on non-negative terms)
    lo = (w64 - en - g_d * w64) * (1 - 2.0**-40)
    rel = torch.where(lo > 0, E / torch.where(lo > 0, lo, torch.ones_like(lo)), torch.full_like(E, math.inf))
    rel = torch.where((E == 0) & (w64 == 0), torch.zeros_like(rel), rel)  # an exactly zero row: exact
    S = base + abs(2 * sf) * (Br * U).sum(1).abs() + sf * sf * ba
    kappa = torch.where(w64 > 0, S / torch.where(w64 > 0, w64 * w64, torch.ones_like(w64)),
                        torch.where(S == 0, torch.ones_like(S), torch.full_like(S, math.inf)))
    return w32, (rel * (1 + 2.0**-23)).float(), kappa  # raised before rounding to fp32: still an upper bound


def _rows_text(rows, kappa, rel) -> str:
    shown = ", ".join(f"{int(j)} (kappa {float(kp):.3g}, rel {float(rl):.3g})"
                      for j, kp, rl in zip(rows[:_NAMED], kappa[:_NAMED], rel[:_NAMED]))
    more = f" and {len(rows) - _NAMED} more" if len(rows) > _NAMED else ""
    return shown + more


def resolve(W, A, B, s: float, wnorm: torch.Tensor, rel: torch.Tensor, mode: str, *,
            where: str = "factored row norm", warn: bool = True) -> torch.Tensor:
    """The guarded norm: ``wnorm`` with the rows whose ``rel > CANCELLATION_REL`` recomputed by
    :func:`dense_rows_fp64` (a new tensor; ``wnorm`` itself where no row is flagged).  Syncs (the
    rare path).  ``mode``: ``"recompute"``, ``"warn"`` (a :class:`CancellationWarning` naming the
    rows, if ``warn``) or ``"raise"`` (:class:`CancellationError` for rows that cancel or stay
    uncertified: :func:`_report`).  Rows that stay above the threshold after the recompute are
    reported in every mode (``where`` names the caller in messages)."""
    rows = torch.nonzero(rel > CANCELLATION_REL).flatten()
    if rows.numel() == 0:
        return wnorm
    w_new, rel_new, kappa64 = dense_rows_fp64(W, A, B, s, rows)
    _report(where, mode, warn, rows.cpu(), kappa64.float().cpu(), rel[rows].cpu(), rel_new.cpu(), stacklevel=4,
            w=w_new.cpu(), d_in=W.shape[1])
    out = wnorm.clone()
    out[rows] = w_new
    return out


class GuardRows(NamedTuple):
    """Per row, what the guard of the factored norm's torch tail decides (:func:`guard_rows`)."""

    bare: torch.Tensor  # fp32: the factored value (on_cancellation="off")
    kappa: torch.Tensor  # fp32: the assembly's condition from the fp32 terms (lemma 4')
    rel: torch.Tensor  # fp32: lemma 4''s guaranteed relative error of `bare` (inf: not certified)
    recomputed: torch.Tensor  # bool: rows formed in float64 (rel > CANCELLATION_REL, or bare not finite)
    guarded: torch.Tensor  # fp32: the returned norm (on_cancellation="recompute")
    rel_out: torch.Tensor  # fp32: its guaranteed relative error (rel, or lemma 5''s where recomputed)
    products: str  # the product model charged (norm_posterior.PRODUCT_MODELS)


def guard_rows(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> GuardRows:
    """The guard's decision row by row, from the same public pieces and in the same order as the
    torch tail of :func:`dora_num.ops.norm.factored_row_norm` (no cached zero-row mask): its terms
    (:func:`~dora_num.ops.terms.factored_terms`), products (:func:`~dora_num.ops.products.factored_products`),
    row magnitudes and lemma 4' (:func:`~dora_num.numerics.norm_posterior.posterior_from_terms`), and the
    float64 recompute (:func:`dense_rows_fp64`) of the flagged rows and of rows whose fp32 value is not
    finite.  ``guarded`` is bitwise the torch tail's result; the reviewer's kit checks each row against
    the lemma that covers it."""
    base, cross, ba, two_s, s_sq = factored_terms(W, A, B, scale)
    s = scale_constants(scale)[0]
    r = A.shape[0]
    with torch.no_grad():
        if s == 0.0:
            C, inv = guard_constants(two_s, s_sq, W, r), None
            la = bb = torch.zeros_like(base)
            products = products_of(W)
        else:
            prod = factored_products(W, A)
            C = guard_constants(two_s, s_sq, W, r, prod.pieces)
            inv = prod.inv if C.inv_runtime else None
            la, bb = lora_row_magnitudes(B, prod.G, constants=C, inv=inv)
            products = products_of(W, prod.pieces)
        kappa, rel = posterior_from_terms(base, cross, ba, la, bb, C, inv)
        bare = norm_assembly(TorchFP32CorrectSqrt, base, cross, ba, two_s, s_sq)
        guarded, rel_out = bare.clone(), rel.clone()
        redo = ~torch.isfinite(bare) | (rel > CANCELLATION_REL)
        rows = torch.nonzero(redo).flatten()
        if rows.numel():
            w64, rel64, _ = dense_rows_fp64(W, A, B, s, rows)
            guarded[rows], rel_out[rows] = w64, rel64
    return GuardRows(bare, kappa, rel, redo, guarded, rel_out, products)
