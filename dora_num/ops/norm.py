"""Row norms of ``W + s*B@A``: dense (PEFT-style) and factored (never forms BA), in one place.

``||W_j + s(BA)_j||^2 = base_j + 2s cross_j + s^2 ba_j`` with ``base = rowsum(W*W)``, ``U = W A^T``,
``cross = rowsum(B*U)``, ``G = A A^T``, ``ba = rowsum((B G) * B)``, assembled by
:func:`dora_num.numerics.formulas.norm_assembly`; within
:func:`~dora_num.numerics.bounds.factored_norm_bound` (lemma 4 of docs/bounds.md), rows the
cancellation guard flags formed in float64 (:mod:`dora_num.ops.guard`).  This module is the
factored norm's orchestration: the cache of ``base`` and W's zero rows (:func:`cached_base_row_norm_sq`),
the products and the tail (:func:`_factored_core`), the guard's decision and the flag
(:func:`factored_norm`: what the public norm, the eager layer and the compiled custom ops all call),
beside its references (:func:`dense_row_norm`; the torch tail's terms,
:func:`~dora_num.ops.terms.factored_terms`).  Where it loses accuracy, the products, the memory and
the tails: docs/operator.md, "Row norms: dense and factored".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..numerics import formulas
from ..numerics.arithmetic import TorchFP32, TorchFP32CorrectSqrt
from ..numerics.formulas import norm_assembly, scale_constants
from ..numerics.norm_posterior import posterior_from_terms
from . import finite
from . import guard as _guard
from .config import OpConfig, get_config, uses_tail_kernel  # noqa: F401  (uses_tail_kernel: public here too)
from .guard import check_on_cancellation
from .magnitude import default_eps, initial_magnitude, magnitude_scale  # noqa: F401  (public here too)
from .products import (CHUNK_ALIGN, DEFAULT_CHUNK_BYTES, Products, _products, autocast_off,  # noqa: F401
                       chunk_columns, resolve_chunk_bytes, split_gram, split_mm, split_pieces)
from .terms import (ROW_CHUNK_BYTES, _base_and_zero_rows, _check_base_sq, _torch_tail_terms,  # noqa: F401
                    base_pass, base_passes, base_row_norm_sq, factored_terms)
from .validation import check_finite, check_lora_factors, check_scale, check_tensor

_autocast_off = autocast_off  # the name the package used before autocast_off moved to ops.products


def dense_row_norm(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """``||W + s*B@A||_row`` in fp32 by materialising the dense ``[d_out, d_in]`` sum.

    The PEFT-style reference, evaluated in fp32 (PEFT itself works in the weight
    dtype).  Costs ``d_out * d_in * 4`` bytes (twice, with the product).  Checks
    all inputs for NaN/Inf, and raises ``ValueError`` where the fp32 result overflows.  No gradient.
    """
    check_lora_factors(W, A, B)
    s = check_scale(scale)
    for name, t in (("W", W), ("A", A), ("B", B)):
        check_finite(name, t)
    with torch.no_grad(), torch.autocast(W.device.type, enabled=False):
        dense = W.float() + s * (B.float() @ A.float())
        out = torch.linalg.vector_norm(dense, dim=1)
    if not bool(torch.isfinite(out).all()):
        rows = torch.nonzero(~torch.isfinite(out)).flatten()[:8].tolist()
        raise ValueError(f"dense row norm overflowed float32 on rows {rows} (inputs are finite): W + sBA or its "
                         "squared row norm exceeds 3.4e38; rescale W or the adapter")
    return out


# --------------------------------------------------------------------------
# The cache of rowsum(W*W) and W's zero rows
# --------------------------------------------------------------------------

_CACHE_ATTR = "_dora_num_base_sq"


def _cached_base_and_zero_rows(W: torch.Tensor, chunk_bytes, cfg: OpConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rowsum(W*W), W's exactly zero rows)`` cached on the tensor ``W`` itself (key: its storage
    pointer, version counter, shape, dtype and device, and the pass that forms them under ``cfg``:
    the row kernel's tiles or torch's column chunk width, :func:`~dora_num.ops.terms.base_pass`,
    since each sums in its own order)."""
    key = (W.data_ptr(), W._version, tuple(W.shape), W.dtype, W.device, base_pass(W, chunk_bytes, cfg))
    hit = getattr(W, _CACHE_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    val = _base_and_zero_rows(W.detach(), chunk_bytes, cfg)
    setattr(W, _CACHE_ATTR, (key, val))
    return val


def cached_base_row_norm_sq(W: torch.Tensor, *, chunk_bytes: int | None = None) -> torch.Tensor:
    """``rowsum(W*W)`` (fp32, :func:`~dora_num.ops.terms.base_row_norm_sq`), cached on the tensor ``W``.

    The key is W's storage pointer, version counter (bumped by every in-place write through
    autograd), shape, dtype and device: such changes recompute.  A write through ``W.data`` bumps no
    version counter, and the new storage can reuse the old address: after one, call
    :func:`clear_base_sq_cache` (:func:`dora_num.peft.clear_caches` for a whole model).  The cache
    dies with W and is shared by every module that wraps the same frozen weight.
    """
    check_tensor("W", W, ndim=2)
    return _cached_base_and_zero_rows(W, chunk_bytes, get_config())[0]


def cached_zero_rows(W: torch.Tensor) -> torch.Tensor:
    """Bool ``[d_out]``: the exactly zero rows of ``W``, from the pass and cache of
    :func:`cached_base_row_norm_sq`.  The guard certifies a row whose W and B rows are both zero as
    exactly 0 (its fp32 terms cannot tell such a row from one whose squares all underflow)."""
    check_tensor("W", W, ndim=2)
    return _cached_base_and_zero_rows(W, None, get_config())[1]


def clear_base_sq_cache(W: torch.Tensor) -> None:
    """Drop the cache of :func:`cached_base_row_norm_sq` from ``W`` (if any), so that ``W`` carries no
    state of this package (:func:`dora_num.peft.restore`), and mark every layer's cache
    (:func:`refresh_base_cache`) stale: each forms its ``base`` once more at its next call (a compiled
    layer cannot tell which W it holds by anything but W's pointer and version counter, which a write
    through ``W.data`` leaves as they were)."""
    if hasattr(W, _CACHE_ATTR):
        delattr(W, _CACHE_ATTR)
    _GENERATION[0] += 1


_KEY_ATTR = "_dora_num_key"  # on a layer's base_sq buffer: the key of the W it holds (refresh_base_cache)
_GENERATION = [0]  # bumped by clear_base_sq_cache; part of every layer cache's key


def base_cache_key(W: torch.Tensor, chunk_bytes, cfg: OpConfig) -> tuple:
    """What ``rowsum(W*W)`` and the zero rows depend on: W's storage pointer, version counter, shape,
    dtype and device (as :func:`cached_base_row_norm_sq` keys them), the pass that forms them (the row
    kernel with its tiles, or torch over column chunks of that width:
    :func:`~dora_num.ops.terms.base_pass`; a value summed under other tiles is never reused) and the
    count of :func:`clear_base_sq_cache` calls."""
    return (W.data_ptr(), W._version, tuple(W.shape), W.dtype, W.device, base_pass(W, chunk_bytes, cfg),
            _GENERATION[0])


def refresh_base_cache(W: torch.Tensor, base_sq: torch.Tensor, zero_rows: torch.Tensor, chunk_bytes,
                       cfg: OpConfig) -> bool:
    """Bring a layer's cache up to date with ``W``: ``base_sq`` (fp32 ``[d_out]``) and ``zero_rows``
    (bool ``[d_out]``) are overwritten in place with ``rowsum(W*W)`` and W's zero rows, by the pass
    of the eager cache (bitwise its values), where the key they were formed with
    (:func:`base_cache_key`, kept on ``base_sq``) is not W's now; returns whether it formed them.

    The compiled layer calls this inside its custom op (:mod:`dora_num.ops.weight_norm`), with the
    layer's buffers as the op's inputs: a step reads them, and W is read again only when its
    storage or version counter changed (an optimizer step on a trainable base), or after
    :func:`clear_base_sq_cache` or :meth:`~dora_num.ops.layer.DoRALinear.clear_norm_cache` (a write
    through ``W.data``, which no version counter sees).  Under CUDA-graph capture it always forms them:
    a replay runs no Python, so a graph without the pass would keep a stale ``base`` once W changes."""
    d_out = W.shape[0]
    if base_sq.shape != (d_out,) or base_sq.dtype != torch.float32 or zero_rows.shape != (d_out,) \
            or zero_rows.dtype != torch.bool or base_sq.device != W.device or zero_rows.device != W.device:
        raise ValueError(f"the base cache must be float32 and bool [d_out] = [{d_out}] on {W.device}, got "
                         f"{base_sq.dtype} {tuple(base_sq.shape)} and {zero_rows.dtype} {tuple(zero_rows.shape)}")
    key = base_cache_key(W, chunk_bytes, cfg)
    capturing = W.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing and base_sq.__dict__.get(_KEY_ATTR) == key:
        return False
    base, zero = _base_and_zero_rows(W.detach(), chunk_bytes, cfg)
    with torch.no_grad():
        base_sq.copy_(base)
        zero_rows.copy_(zero)
    base_sq.__dict__[_KEY_ATTR] = key
    return True


def clear_base_cache(base_sq: torch.Tensor) -> None:
    """Mark a layer's cache (:func:`refresh_base_cache`) stale: the next call forms it again."""
    base_sq.__dict__.pop(_KEY_ATTR, None)


# --------------------------------------------------------------------------
# Running flags
# --------------------------------------------------------------------------

FLAG_FIELDS = ("code", "rows_flagged", "calls")  # the entries of a running flag (new_flag)


def new_flag(device) -> torch.Tensor:
    """A zeroed running flag: int64 ``[3]``, :data:`FLAG_FIELDS` (the largest ``guard.FLAG_*`` code,
    the rows the guard flagged, the calls, since the last reset)."""
    return torch.zeros(len(FLAG_FIELDS), dtype=torch.int64, device=device)


def _accumulate(acc: torch.Tensor, code: torch.Tensor, count) -> None:
    """Raise the running flag ``acc`` by one call with ``code`` (0-d) and ``count`` flagged rows
    (torch operations: no sync)."""
    code = code.reshape(()).to(torch.int64)
    if isinstance(count, torch.Tensor):  # a Python int is added as a kernel argument (no copy to the device)
        count = count.reshape(()).to(torch.int64)
    acc.copy_(torch.stack((torch.maximum(acc[0], code), acc[1] + count, acc[2] + 1)))


# --------------------------------------------------------------------------
# Products and tail
# --------------------------------------------------------------------------

class _Core(NamedTuple):
    """What :func:`_factored_core` computed (fields None where not asked for or not available)."""

    wnorm: torch.Tensor  # the Triton tail with the guard: flagged rows recomputed already
    den: torch.Tensor | None  # the tail kernel with m: the denominator of g
    flag: torch.Tensor | None  # the tail kernel with m or the guard: per-program codes (guard.decode)
    rel: torch.Tensor | None  # the guard: per-row guaranteed relative error bound of the factored value
    aux: torch.Tensor | None  # the tail kernel with the guard: [3, d_out] kappa, rel, rel_out


def _factored_core(W, A, B, consts, cols: int, chunk_bytes, base_sq, cfg: OpConfig, m=None, eps=None, *,
                   guard: bool = True, zero_rows=None, acc=None) -> _Core:
    """:class:`_Core` of the factored norm, unchecked (callers hold no_grad, autocast off).

    With the tail kernel: with ``guard`` the flagged rows are recomputed in the kernel, and with
    ``m`` it also writes ``den`` (``wnorm``, ``eps`` at zero rows); ``flag`` is its per-program
    int32 (:func:`dora_num.ops.kernels.norm_tail.norm_tail`, :func:`dora_num.ops.guard.decode`).
    With the torch tail and ``guard``: ``rel`` per row (lemma 4'); the decision and the recompute
    are the caller's (:func:`factored_norm`).  ``zero_rows`` (a bool mask of the exactly zero rows
    of W) certifies the rows whose W and B rows are both zero as exact (``rel = 0``), which the
    terms alone cannot.  ``acc``: a running flag the tail kernel raises (:func:`~dora_num.ops.kernels.norm_tail.norm_tail`;
    on the other paths the caller's).
    """
    s, two_s, s_sq = consts
    acc_base = base_row_norm_sq(W, chunk_bytes=chunk_bytes) if base_sq is None else base_sq
    r = A.shape[0]
    if s == 0.0:
        zeros = torch.zeros_like(acc_base)
        wnorm = norm_assembly(TorchFP32CorrectSqrt, acc_base, zeros, zeros, 0.0, 0.0)
        rel = None
        if guard:
            C = _guard.guard_constants(two_s, s_sq, W, r)
            rel = posterior_from_terms(acc_base, zeros, zeros, zeros, zeros, C)[1]
            if zero_rows is not None:
                rel = torch.where(zero_rows, torch.zeros_like(rel), rel)
        return _Core(wnorm, None, None, rel, None)
    prod = _products(W, A, cols, cfg)
    if uses_tail_kernel(W.device, cfg):
        t = tail_kernel(W, A, B, prod, acc_base, consts, cfg, m=m, eps=eps, guard=guard, zero_rows=zero_rows, acc=acc)
        return _Core(t.wnorm, t.den, t.flag, t.rel, t.aux)
    C = _guard.guard_constants(two_s, s_sq, W, r, prod.pieces) if guard else None
    terms = _torch_tail_terms(prod.U, B, prod.G, C, prod.inv)
    cross, ba = terms[:2]
    wnorm = norm_assembly(TorchFP32CorrectSqrt, acc_base, cross, ba, two_s, s_sq)
    if not guard:
        return _Core(wnorm, None, None, None, None)
    lora_abs, b_abs = terms[2:]
    rel = posterior_from_terms(acc_base, cross, ba, lora_abs, b_abs, C, prod.inv)[1]
    if zero_rows is not None:  # W and B rows exactly zero: Q = 0 = Q^ exactly
        rel = torch.where(zero_rows & (b_abs == 0), torch.zeros_like(rel), rel)
    return _Core(wnorm, None, None, rel, None)


def tail_kernel(W, A, B, prod, base_sq, consts, cfg: OpConfig, *, m=None, eps=None, guard: bool = True,
                zero_rows=None, acc=None, traced: bool = False):
    """The Triton tail of the factored norm on the products ``prod`` (:class:`Products`): the guard's
    constants for them (with ``guard``: rows flagged are recomputed in the kernel), ``den`` with ``m``, the
    running flag ``acc`` raised (:func:`dora_num.ops.kernels.norm_tail.norm_tail`'s
    :class:`~dora_num.ops.kernels.norm_tail.TailResult`).  The one launch of it: :func:`_factored_core`
    (eager, and the opaque compiled op) and the traced compiled op (:mod:`dora_num.ops.weight_norm`; ``traced``:
    there the launch is Inductor's)."""
    from .kernels.norm_tail import norm_tail

    s, two_s, s_sq = consts
    tail_bg = _guard.tail_bg_format(B, cfg)
    C = _guard.guard_constants(two_s, s_sq, W, A.shape[0], prod.pieces, tail_bg) if guard else None
    return norm_tail(prod.U, B, prod.G, base_sq, two_s, s_sq, m=m, eps=eps, guard=C,
                     rel_max=_guard.CANCELLATION_REL if guard else None, zero_rows=zero_rows,
                     recompute=(W, A, s) if guard else None, inv=prod.inv if C is not None and C.inv_runtime else None,
                     acc=acc, config=cfg, traced=traced)


# --------------------------------------------------------------------------
# The orchestration: tail, guard, flag (eager and compiled)
# --------------------------------------------------------------------------

class Norm(NamedTuple):
    """What :func:`factored_norm` computed (fields None where not asked for)."""

    wnorm: torch.Tensor  # the guarded norm (flagged rows recomputed)
    g: torch.Tensor | None  # with m (and want_g): m.float() / den
    flag: torch.Tensor | None  # int32 device: FLAG_COUNT * (rows flagged) + the largest code (guard.decode)
    den: torch.Tensor | None  # with m: the denominator of g (wnorm, eps on a zero row)
    aux: torch.Tensor | None  # the tail kernel with the guard: [3, d_out] kappa, rel, rel_out


def factored_norm(W, A, B, consts, cols: int, chunk_bytes, base_sq, cfg: OpConfig, *, mode: str = "recompute",
                  zero_rows=None, m=None, eps=None, acc=None, check: bool = False, want_g: bool = True,
                  where: str = "factored row norm", warn: bool = True) -> Norm:
    """The guarded factored norm of detached ``W``, ``A``, ``B`` (``consts``: the scale's
    :func:`~dora_num.numerics.formulas.scale_constants`; ``base_sq``, ``zero_rows``: the cache, or
    None), and with ``m`` the layer's ``g = m / den``: the one sequence the public norm
    (:func:`factored_row_norm`), the eager layer and the compiled custom ops
    (:mod:`dora_num.ops.weight_norm`) run.

    Tail kernel: products, tail, guard (flagged rows recomputed in the kernel), ``den`` and the flag
    in one launch, which also raises the running flag ``acc``.  Torch tail: the guard's decision is
    read now (``_guard.status``: free on the CPU, a sync on CUDA's A/B baseline); rows whose fp32
    intermediates overflowed while W, A, B are finite are formed in float64 first
    (:func:`_recompute_not_finite`; ``check``: raise where the inputs or the norm itself are not
    finite), then the flagged rows (:func:`dora_num.ops.guard.resolve`, reporting as ``mode`` says;
    with ``m``, not while rows stay non-finite: the caller reports ``g``'s non-finite flag instead).
    With ``m`` the flag (``FLAG_NONFINITE`` where ``wnorm`` or ``g`` is not finite, the guard's code
    and count as in the kernel's) is formed and added to ``acc``.  The flag is read by the caller
    (:mod:`dora_num.ops.finite`), never here.  Without ``m`` and on the torch tail ``flag`` is None.
    While tracing (``torch.compile`` of the public norm) the torch tail's guard does not act.
    """
    guard = mode != "off"
    tail_m = m.detach() if m is not None and m.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
    with torch.no_grad(), autocast_off(W.device.type):
        core = _factored_core(W, A, B, consts, cols, chunk_bytes, base_sq, cfg, m=tail_m, eps=eps, guard=guard,
                              zero_rows=zero_rows if guard else None, acc=acc)
    if core.den is not None:  # the tail kernel with m: the guard acted, and it raised acc itself
        # den = magnitude_denominator(wnorm, eps) of formulas.magnitude_scale, selected (exactly) in the
        # kernel; this is its division (tests: bitwise equal to magnitude_scale(m, wnorm)).
        return Norm(core.wnorm, m.float() / core.den if want_g else None, core.flag, core.den, core.aux)
    if m is None and core.flag is not None:  # the tail kernel, the norm alone: the guard acted
        return Norm(core.wnorm, None, core.flag, None, core.aux)
    wnorm, rel = core.wnorm, core.rel
    if guard and not torch.compiler.is_compiling():  # the torch tail: the guard's decision now (while tracing
        # the bare norm: traced code cannot read the device, and the compiled layer runs this in a custom op)
        code = int(_guard.status(wnorm, rel))
        if code >= _guard.FLAG_NONFINITE:  # fp32 intermediates that overflow where the norm fits: float64
            wnorm, rel = _recompute_not_finite(W, A, B, consts[0], wnorm, rel, base_sq, check)
            code = int(_guard.status(wnorm, rel))
        if code >= _guard.FLAG_CANCELLATION and (m is None or code < _guard.FLAG_NONFINITE):
            with torch.no_grad(), autocast_off(W.device.type):
                wnorm = _guard.resolve(W, A, B, consts[0], wnorm, rel, mode, where=where, warn=warn)
    if m is None:
        return Norm(wnorm, None, None, None, None)
    with torch.no_grad():
        den = formulas.magnitude_denominator(TorchFP32, wnorm.detach(), eps)
    g = m.float() / den  # bitwise magnitude_scale(m, wnorm, eps=eps)
    bad = _guard.status(wnorm, None, None, g)
    n = (rel > _guard.CANCELLATION_REL).sum().to(torch.int32) if guard else 0
    if guard:  # the code and count of the rows the guard recomputed, as in the kernel's flag
        bad = torch.maximum(bad, (n > 0).to(torch.int32)) + _guard.FLAG_COUNT * n
    if acc is not None:
        _accumulate(acc, bad % _guard.FLAG_COUNT, n)
    return Norm(wnorm, g if want_g else None, bad, den, None)


# --------------------------------------------------------------------------
# Public: the checked factored norm
# --------------------------------------------------------------------------

def factored_row_norm(
    W: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: float,
    *,
    chunk_bytes: int | None = None,
    base_sq: torch.Tensor | None = None,
    check: bool = True,
    return_flag: bool = False,
    on_cancellation: str = "recompute",
):
    """``||W + s*B@A||_row`` in fp32 without forming ``B@A`` or an fp32 copy of W.

    ``base = rowsum(W*W)`` (fp32, over column chunks of W under ``chunk_bytes``,
    unless the cached ``base_sq`` is given: fp32 ``[d_out]``, its values checked at once, a device
    read, since a negative entry would give a zero norm unnoticed), ``U = W A^T`` and ``G = A A^T`` in
    fp32 (:mod:`dora_num.ops.products`: tensor-core products with exact products and fp32
    accumulation for 16-bit W on CUDA, no fp32 copy of W; with an fp32 A through its exact split
    into 16-bit pieces), then ``cross``, ``ba`` and the assembly of
    :func:`~dora_num.numerics.formulas.norm_assembly` with a correctly rounded square root: one
    Triton launch on CUDA (:mod:`dora_num.ops.kernels.norm_tail`), torch operations over row
    blocks of ``B`` elsewhere (temporaries under ``ROW_CHUNK_BYTES``); all under ``no_grad`` with
    autocast off.  The two tails sum ``cross`` and ``ba`` in different orders, both within
    :func:`~dora_num.numerics.bounds.factored_norm_bound`.  ``scale == 0`` skips the cross and
    Gram terms.

    Cancellation guard (:mod:`dora_num.ops.guard`): the tail also evaluates, per row, the
    assembly's condition and a guaranteed relative error bound of the result (lemma 4' of
    docs/bounds.md); rows whose bound exceeds ``CANCELLATION_REL = 2^-6`` (the update cancelling
    the row) are recomputed in float64 from the rows of W and A (lemma 5'): inside the Triton
    tail on CUDA (no sync), on the host after the torch tail.  ``on_cancellation``:
    ``"recompute"`` (the default, silent), ``"warn"`` (a
    :class:`~dora_num.ops.guard.CancellationWarning` naming the rows), ``"raise"``
    (:class:`~dora_num.ops.guard.CancellationError` naming the rows and their ``kappa``), ``"off"``
    (the bare factored norm).  Every returned row is within ``2^-6`` relative of the exact norm,
    or within its float64 bound, or named in a warning (a norm below fp32's normal range).

    A non-finite result raises ``ValueError`` naming the input at fault.  On CUDA the check
    and the guard's reports need no device sync (:mod:`dora_num.ops.finite`,
    ``OpConfig.finite_check``; default ``"deferred"``: they are raised or warned at a later call
    of the operator or at :func:`~dora_num.ops.finite.check_pending`, and this call returns its
    values, the recomputed rows included; ``"sync"`` reads the flag here); on the CPU everything
    is immediate.  The torch tail on CUDA (``OpConfig.norm_tail="torch"``, the A/B baseline) reads
    the guard's decision at once (a sync).  ``check=False`` skips the finiteness check, for
    callers that check the final ``g`` once instead (the guard still acts);
    ``return_flag=True`` returns ``(wnorm, bad)`` with the finiteness unchecked, ``bad`` a 0-dim
    device bool (true iff some ``wnorm`` is not finite).  A zero row gives ``wnorm = 0``
    exactly; :func:`magnitude_scale` turns that into a finite ``g``.  Where the tail runs:
    :func:`uses_tail_kernel`.
    """
    mode = check_on_cancellation(on_cancellation)
    cfg = get_config()
    if not torch.compiler.is_compiling():
        finite.poll()
    wnorm = _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, check and not return_flag, cfg, mode,
                               given_base_sq=True)
    return (wnorm, finite.any_not_finite(wnorm)) if return_flag else wnorm


def _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, check: bool, cfg: OpConfig,
                       on_cancellation: str = "recompute", zero_rows=None, given_base_sq: bool = False) -> torch.Tensor:
    """:func:`factored_row_norm` under the configuration ``cfg`` (``zero_rows``: the optional
    cached mask of the exactly zero rows of W, :func:`cached_zero_rows`): :func:`factored_norm`, then
    the checks and the guard's reports as :func:`_watch_norm` (none while tracing: the custom ops run
    this at run time)."""
    d_out, d_in, r = check_lora_factors(W, A, B)
    s_raw = check_scale(scale)
    cols = chunk_columns(d_out, d_in, chunk_bytes)
    if base_sq is not None:
        _check_base_sq(base_sq, d_out, W.device)
        if given_base_sq:  # a caller's cache (the public norm's base_sq=): its values read once
            _check_given_base_sq_values(base_sq, W)
    consts = scale_constants(s_raw)
    res = factored_norm(W, A, B, consts, cols, chunk_bytes, base_sq, cfg, mode=on_cancellation, zero_rows=zero_rows,
                        check=check, where="factored_row_norm")
    if torch.compiler.is_compiling():
        return res.wnorm
    return _watch_norm(res, W, A, B, base_sq, consts[0], check, cfg, on_cancellation, "factored_row_norm")


def _watch_norm(res: Norm, W, A, B, base_sq, s: float, check: bool, cfg: OpConfig, mode: str,
                where: str, on_report=None) -> torch.Tensor:
    """The checked ``wnorm`` of :func:`factored_norm`'s ``res`` (without ``m``).

    Tail kernel (``res.flag`` given): the kernel's flag goes to :func:`dora_num.ops.finite.watch`
    (deferred on CUDA by default), which, when set, raises the finiteness error (``check``) or
    reports the guard (:func:`dora_num.ops.guard.report_kernel`; ``on_report(code, flagged)`` is
    called first).  Torch tail: the guard acted in :func:`factored_norm` (raising there, with
    ``check``, where the norm is not finite); without the guard the finiteness of ``wnorm`` is
    watched (``check``).
    """
    if res.flag is not None:
        def on_fail(host_flag):
            code, flagged = _guard.decode(host_flag)
            if code >= _guard.FLAG_NONFINITE:
                if not check:
                    return True
                _raise_norm_not_finite(W, A, B, base_sq, s=s, wnorm=res.wnorm)
            if on_report is not None:
                on_report(code, flagged)
            if mode != "off" and res.aux is not None:
                _guard.report_kernel(code, res.aux, mode, where=where, wnorm=res.wnorm, d_in=W.shape[1])
            return True

        watched = finite.watch(res.flag, where, cfg.finite_check, on_fail=on_fail)
        if watched is not None:
            watched.check()
        return res.wnorm
    wnorm = res.wnorm
    if mode == "off" and check:
        watched = finite.watch(finite.all_finite(wnorm), where, cfg.finite_check, is_ok=True,
                               on_fail=lambda _: _raise_norm_not_finite(W, A, B, base_sq, s=s, wnorm=wnorm))
        if watched is not None:
            watched.check()
    return wnorm


def _check_given_base_sq_values(base_sq, W) -> None:
    """A caller's cached ``rowsum(W*W)``, read once (a device read; the layer's own cache, computed
    here, is not): a NaN or a negative entry is no sum of squares, and a negative one would turn into
    a zero norm unnoticed (``+inf`` is a row whose squares overflowed fp32, formed again in float64).
    A non-finite W is named first: its squares are what made the cache so."""
    bad = ~(base_sq >= 0)
    if bool(bad.any()):
        check_finite("W", W)
        rows = torch.nonzero(bad).flatten()
        raise ValueError(f"base_sq has {rows.numel()} entries that are NaN or negative (rows {rows[:8].tolist()}): "
                         "not a sum of squares, a corrupt cache (recompute it with base_row_norm_sq(W))")


def _recompute_not_finite(W, A, B, s: float, wnorm, rel, base_sq, check: bool):
    """``(wnorm, rel)`` with the rows whose factored value is not finite formed in float64
    (:func:`dora_num.ops.guard.dense_rows_fp64`, lemma 5'), where W, A and B are finite: the fp32
    intermediates (``U``, ``G``, the terms) may overflow while the norm fits in fp32 (``s = 2^-100``,
    ``A = B = 2^60``: ``ba = 2^240``, norm ``2^20``).  Raises (``check``) where the norm itself
    exceeds fp32, or an input (or the cached ``base_sq``) is not finite; without ``check`` such rows
    are left as they are."""
    inputs_ok = all(bool(torch.isfinite(t).all()) for t in (W, A, B)) and _base_sq_ok(base_sq)
    if not inputs_ok:  # a non-finite input or a corrupt cached base_sq: named, or left as is (check=False)
        if check:
            _raise_norm_not_finite(W, A, B, base_sq)
        return wnorm, rel
    rows = torch.nonzero(~torch.isfinite(wnorm)).flatten()
    with torch.no_grad(), autocast_off(W.device.type):
        w_new, rel_new, _ = _guard.dense_rows_fp64(W, A, B, s, rows)
    if check and not bool(torch.isfinite(w_new).all()):
        _raise_norm_not_finite(W, A, B, base_sq, s=s, wnorm=wnorm)
    wnorm, rel = wnorm.clone(), rel.clone()
    wnorm[rows], rel[rows] = w_new, rel_new
    return wnorm, rel


def _base_sq_ok(base_sq) -> bool:
    """``base_sq`` is finite or ``+inf`` (W's squares overflowed fp32 on a row; the row is formed
    again in float64 from W, A and B): a NaN or a negative infinity can only be a corrupt cache
    (a given one is refused at entry, :func:`_check_base_sq`; the layer's own is computed here)."""
    return base_sq is None or bool((torch.isfinite(base_sq) | (base_sq == math.inf)).all())


def _raise_norm_not_finite(W, A, B, base_sq, *, s: float | None = None, wnorm=None) -> None:
    """Raise ``ValueError`` naming why a factored norm was not finite (syncs: the error path): a
    non-finite input, a corrupt ``base_sq``, fp32 intermediates that overflowed although the norm fits
    in fp32 (the float64 norm of those rows, when ``s`` and ``wnorm`` are given), or a norm beyond fp32."""
    for name, t in (("W", W), ("A", A), ("B", B)):
        check_finite(name, t)
    if not _base_sq_ok(base_sq):
        try:
            check_finite("base_sq", base_sq)
        except ValueError as e:
            raise ValueError(f"{e} although W is finite: a corrupt cache (a NaN or -inf is never a "
                             "sum of squares)") from None
    if s is not None and wnorm is not None:
        rows = torch.nonzero(~torch.isfinite(wnorm)).flatten()
        with torch.no_grad(), autocast_off(W.device.type):
            w64 = _guard.dense_rows_fp64(W, A, B, s, rows)[0]
        fits = torch.isfinite(w64)
        shown = rows[:8].tolist()
        if bool(fits.all()) and rows.numel():
            raise ValueError(
                f"factored row norm: fp32 intermediates (U = W A^T, G = A A^T, or a term of the assembly) "
                f"overflowed on rows {shown} although their norms fit in float32 (formed in float64: up to "
                f"{float(w64.max()):.6g}); rescale W or the adapter (factored_row_norm's guard, on the torch tail, "
                "forms such rows in float64)")
        raise ValueError(
            f"factored row norm overflowed float32 (inputs are finite): the row norm of W + sBA exceeds 3.4e38 on "
            f"rows {rows[~fits][:8].tolist()}; rescale W or the adapter")
    raise ValueError(
        "factored row norm overflowed float32 (inputs are finite): the squared row norm "
        "exceeds 3.4e38; rescale W or the adapter"
    )
