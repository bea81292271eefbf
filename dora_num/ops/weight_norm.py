"""The layer's ``g = m / ||W + sBA||_row`` from the factored norm, eager and compiled.

Eager (:func:`magnitude_scale_and_flag`): ``rowsum(W*W)`` and W's zero rows are cached on W
(:func:`cached_base_row_norm_sq`); the guarded factored norm (:mod:`dora_num.ops.norm`) gives the
denominator ``den`` (``wnorm``, ``eps`` on a zero row) and a device flag that the caller reads late
(:mod:`dora_num.ops.finite`); ``g = m / den``.

Compiled (``torch.compile``): the custom op ``dora_num::weight_den`` gives ``den`` with no cache, no
host read and no device state of its own.  It recomputes ``rowsum(W*W)`` and the zero rows (the
cached values' kernel: bitwise the same) and raises the caller's running flag ``acc`` (an explicit
input it mutates, :func:`new_flag`), which :func:`dora_num.ops.layer.check_flags` reads;
``g = m / den`` is ``dora_num::magnitude_div`` (torch's correctly rounded division, as in eager).
So a compiled layer's ``g`` is bitwise the eager one, and the graph replays under CUDA graphs.
"""

from __future__ import annotations

import torch

from ..numerics import formulas
from ..numerics.arithmetic import TorchFP32
from ..numerics.formulas import scale_constants
from . import guard as _guard
from .config import OpConfig, get_config
from .guard import check_on_cancellation
from .magnitude import _magnitude_div_op, default_eps, magnitude_scale
from .norm import (_autocast_off, _base_and_zero_rows, _factored_core, _factored_row_norm, _recompute_not_finite,
                   chunk_columns, resolve_chunk_bytes)
from .validation import check_lora_factors, check_scale, check_tensor

_CACHE_ATTR = "_dora_num_base_sq"
FLAG_FIELDS = ("code", "rows_flagged", "calls")  # the entries of a running flag (new_flag)


def _cached_base_and_zero_rows(W: torch.Tensor, chunk_bytes, cfg: OpConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rowsum(W*W), W's exactly zero rows)`` cached on the tensor ``W`` itself (key: its storage
    pointer, version counter, shape, dtype and device)."""
    key = (W.data_ptr(), W._version, tuple(W.shape), W.dtype, W.device)
    hit = getattr(W, _CACHE_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    val = _base_and_zero_rows(W.detach(), chunk_bytes, cfg)
    setattr(W, _CACHE_ATTR, (key, val))
    return val


def cached_base_row_norm_sq(W: torch.Tensor, *, chunk_bytes: int | None = None) -> torch.Tensor:
    """``rowsum(W*W)`` (fp32, :func:`~dora_num.ops.norm.base_row_norm_sq`), cached on the tensor ``W``.

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
    state of this package (:func:`dora_num.peft.restore`)."""
    if hasattr(W, _CACHE_ATTR):
        delattr(W, _CACHE_ATTR)


# --------------------------------------------------------------------------
# Running flags (compiled layers)
# --------------------------------------------------------------------------

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
# Eager
# --------------------------------------------------------------------------

def weight_norm_cached(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, *,
                       chunk_bytes: int | None = None, check: bool = True,
                       on_cancellation: str = "recompute") -> torch.Tensor:
    """Factored ``||W + sBA||_row`` with the cached ``base_sq`` (detached), guarded as
    :func:`~dora_num.ops.norm.factored_row_norm`.  Under ``torch.compile`` the custom op
    ``dora_num::weight_norm`` (no graph break; no cache; its finiteness check reads the device, a
    sync: the compiled layer uses :func:`weight_den` instead)."""
    return _weight_norm_cached(W, A, B, scale, chunk_bytes, check, get_config(), check_on_cancellation(on_cancellation))


def _weight_norm_cached(W, A, B, scale, chunk_bytes, check: bool, cfg: OpConfig,
                        on_cancellation: str = "recompute") -> torch.Tensor:
    if torch.compiler.is_compiling():
        cb = resolve_chunk_bytes(W.shape[0], W.shape[1], chunk_bytes)
        return _weight_norm_op(W.detach(), A.detach(), B.detach(), float(scale), int(cb), bool(check), cfg.key,
                               on_cancellation)
    base_sq, zero_rows = _cached_base_and_zero_rows(W, chunk_bytes, cfg)
    return _factored_row_norm(W.detach(), A.detach(), B.detach(), scale, chunk_bytes, base_sq, check, cfg,
                              on_cancellation, zero_rows)


@torch.library.custom_op("dora_num::weight_norm", mutates_args=())
def _weight_norm_op(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float,
                    chunk_bytes: int, check: bool, config: str, on_cancellation: str) -> torch.Tensor:
    cfg = OpConfig.from_key(config)
    base_sq, zero_rows = _base_and_zero_rows(W, chunk_bytes, cfg)
    return _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, check, cfg, on_cancellation, zero_rows)


@_weight_norm_op.register_fake
def _(W, A, B, scale, chunk_bytes, check, config, on_cancellation):
    return W.new_empty((W.shape[0],), dtype=torch.float32)


def magnitude_scale_and_flag(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, m: torch.Tensor, *,
                             chunk_bytes: int | None = None,
                             on_cancellation: str = "recompute") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(g, bad)``: :class:`~dora_num.ops.layer.DoRALinear`'s ``g`` and a device flag, without a sync.

    ``g = m / ||W + sBA||_row`` (``m / eps`` on a zero row; fp32, differentiable in ``m``) from the
    guarded factored norm with the cached ``base_sq``, bitwise ``magnitude_scale(m, wnorm)`` of that
    norm.  ``bad`` is an int32 device tensor to read once, late (reading syncs):
    :func:`dora_num.ops.guard.decode` gives the largest code (``FLAG_NONFINITE`` where some ``wnorm``
    or ``g`` is not finite; ``FLAG_UNRESOLVED``/``FLAG_CANCELLATION`` where the guard recomputed rows,
    whose values are right) and the number of rows recomputed.  ``bad`` is None under
    ``torch.compile`` (where the layer uses :func:`weight_den`).  On CUDA the norm's tail, the guard,
    the denominator and the flag are one Triton launch and ``g`` one division.
    """
    return _magnitude_scale_and_flag(W, A, B, scale, m, chunk_bytes, get_config(),
                                     check_on_cancellation(on_cancellation))[:2]


def _magnitude_scale_and_flag(W, A, B, scale, m, chunk_bytes, cfg: OpConfig, on_cancellation: str = "recompute",
                              trusted: bool = False, where: str = "factored row norm", warn: bool = True,
                              cached: bool = True, acc=None, want_g: bool = True):
    """``(g, bad, den, aux)``: :func:`magnitude_scale_and_flag`, the fp32 ``den`` that ``g =
    m.float() / den`` divides by (the layer's norm cache keeps it) and the tail kernel's ``[3, d_out]``
    guard rows (:func:`dora_num.ops.guard.report_kernel`; None on the torch tail, where the guard acted
    already).  ``trusted``: the caller validated W, A, B and m (only the shapes' consistency is
    checked).  ``where``, ``warn``: the torch tail's guard messages.  ``cached=False``: ``base_sq`` and
    the zero rows recomputed, not cached (the compiled op); ``acc``: a running flag raised by this
    call (:func:`new_flag`); ``want_g=False``: ``g`` is None (the caller divides)."""
    if torch.compiler.is_compiling():
        den = weight_den(W, A, B, scale, m, chunk_bytes=chunk_bytes, on_cancellation=on_cancellation, config=cfg)
        return _magnitude_div_op(m, den), None, None, None
    if trusted and A.shape[1] == W.shape[1] and B.shape == (W.shape[0], A.shape[0]) and m.shape == W.shape[:1]:
        d_out, d_in = W.shape
    else:
        d_out, d_in, _ = check_lora_factors(W, A, B)
        check_tensor("m", m, ndim=1)
        if m.shape[0] != d_out or m.device != W.device:
            raise ValueError(f"m must be [d_out] = [{d_out}] on {W.device}, got {tuple(m.shape)} on {m.device}")
    eps = default_eps(m.dtype)
    base_sq, zero_rows = (_cached_base_and_zero_rows(W, chunk_bytes, cfg) if cached
                          else _base_and_zero_rows(W, chunk_bytes, cfg))
    guard = on_cancellation != "off"
    tail_m = m.detach() if m.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
    consts = scale_constants(check_scale(scale))
    with torch.no_grad(), _autocast_off(W.device.type):
        core = _factored_core(W.detach(), A.detach(), B.detach(), consts, chunk_columns(d_out, d_in, chunk_bytes),
                              chunk_bytes, base_sq, cfg, m=tail_m, eps=eps, guard=guard,
                              zero_rows=zero_rows if guard else None, acc=acc)
    if core.den is not None:  # the kernel raised acc itself
        # den = magnitude_denominator(wnorm, eps) of formulas.magnitude_scale, selected (exactly) in the
        # kernel; this is its division (tests: bitwise equal to magnitude_scale(m, wnorm)).
        return (m.float() / core.den if want_g else None), core.flag, core.den, core.aux
    wnorm = core.wnorm
    rel = core.rel
    if guard:  # the torch tail: the guard's decision now (free on the CPU; a sync on CUDA's A/B baseline)
        code = int(_guard.status(wnorm, rel))
        if code >= _guard.FLAG_NONFINITE:  # fp32 intermediates that overflow where the norm fits: float64
            wnorm, rel = _recompute_not_finite(W.detach(), A.detach(), B.detach(), consts[0], wnorm, rel, base_sq,
                                               False)
            code = int(_guard.status(wnorm, rel))
        if _guard.FLAG_CANCELLATION <= code < _guard.FLAG_NONFINITE:
            with torch.no_grad(), _autocast_off(W.device.type):
                wnorm = _guard.resolve(W.detach(), A.detach(), B.detach(), consts[0], wnorm, rel,
                                       on_cancellation, where=where, warn=warn)
    with torch.no_grad():
        den = formulas.magnitude_denominator(TorchFP32, wnorm.detach(), eps)
    g = m.float() / den  # bitwise magnitude_scale(m, wnorm, eps=eps)
    bad = _guard.status(wnorm, None, None, g)
    n = (rel > _guard.CANCELLATION_REL).sum().to(torch.int32) if guard else 0
    if guard:  # the code and count of the rows the guard recomputed, as in the kernel's flag
        bad = torch.maximum(bad, (n > 0).to(torch.int32)) + _guard.FLAG_COUNT * n
    if acc is not None:
        _accumulate(acc, bad % _guard.FLAG_COUNT, n)
    return g, bad, den, None


# --------------------------------------------------------------------------
# Compiled: the denominator as a custom op with an explicit running flag
# --------------------------------------------------------------------------

def weight_den(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, m: torch.Tensor, *,
               acc: torch.Tensor | None = None, chunk_bytes: int | None = None, on_cancellation: str = "recompute",
               config: OpConfig | None = None) -> torch.Tensor:
    """The denominator of ``g = m / den`` (fp32 ``[d_out]``, detached) by the custom op
    ``dora_num::weight_den``: what a compiled layer calls.  ``acc`` (:func:`new_flag`; a fresh one if
    None) is raised by the call: finiteness of ``den`` and ``m / den``, the guard's code and count."""
    cfg = get_config() if config is None else config
    if acc is None:
        acc = new_flag(W.device)
    cb = resolve_chunk_bytes(W.shape[0], W.shape[1], chunk_bytes)
    return _weight_den_op(W.detach(), A.detach(), B.detach(), m.detach(), acc, float(scale), int(cb), cfg.key,
                          check_on_cancellation(on_cancellation))


@torch.library.custom_op("dora_num::weight_den", mutates_args=("acc",))
def _weight_den_op(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor, acc: torch.Tensor,
                   scale: float, chunk_bytes: int, config: str, on_cancellation: str) -> torch.Tensor:
    """No cache, no sync, no state but ``acc``; ``config``: the traced
    :attr:`~dora_num.ops.config.OpConfig.key`."""
    return _magnitude_scale_and_flag(W, A, B, scale, m, chunk_bytes, OpConfig.from_key(config), on_cancellation,
                                     trusted=True, cached=False, acc=acc, want_g=False)[2]


@_weight_den_op.register_fake
def _(W, A, B, m, acc, scale, chunk_bytes, config, on_cancellation):
    return W.new_empty((W.shape[0],), dtype=torch.float32)


@torch.library.custom_op("dora_num::flag_not_finite", mutates_args=("acc",))
def _flag_not_finite_op(t: torch.Tensor, acc: torch.Tensor) -> None:
    """Raise ``acc`` to ``FLAG_NONFINITE`` where ``t`` has a NaN or Inf (a compiled layer's given ``g``)."""
    bad = (~torch.isfinite(t)).any().to(torch.int64) * _guard.FLAG_NONFINITE
    _accumulate(acc, bad, 0)


@_flag_not_finite_op.register_fake
def _(t, acc):
    return None


__all__ = ["cached_base_row_norm_sq", "cached_zero_rows", "clear_base_sq_cache", "magnitude_scale",
           "magnitude_scale_and_flag", "new_flag", "weight_den", "weight_norm_cached"]
