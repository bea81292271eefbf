"""The layer's ``g = m / ||W + sBA||_row`` from the factored norm, eager and compiled.

Eager (:func:`magnitude_scale_and_flag`): ``rowsum(W*W)`` and W's zero rows are cached on W
(:func:`cached_base_row_norm_sq`); the guarded factored norm (:mod:`dora_num.ops.norm`) gives the
denominator ``den`` (``wnorm``, ``eps`` on a zero row) and a device flag that the caller reads late
(:mod:`dora_num.ops.finite`); ``g = m / den``.

Compiled (``torch.compile``): :func:`weight_den` gives ``den`` with no host read.  Its inputs include the
layer's cache of ``rowsum(W*W)`` and the zero rows (two buffers, formed again only when W changed:
:func:`~dora_num.ops.norm.refresh_base_cache`) and the caller's running flag ``acc`` (:func:`new_flag`),
which it raises and :func:`dora_num.ops.layer.check_flags` reads; ``g = m / den`` is
``dora_num::magnitude_div`` (torch's correctly rounded division, as in eager).  With
``OpConfig.traced_ops`` on (the default), on CUDA with the tail kernel, ``den`` comes from the ``triton_op``
``dora_num::weight_den_traced``: the products traced into the graph (Inductor launches the split's and the
block sums' kernels and calls the GEMMs), then one short opaque op, the cache's refresh and the tail's launch
(``dora_num::norm_den``); with ``OpConfig.traced_tail`` the tail is traced too (Inductor launches it:
:func:`~dora_num.ops.norm.tail_kernel`) beside the refresh alone (``dora_num::base_refresh``).  Otherwise it
comes from the opaque ``dora_num::weight_den``, which runs :func:`~dora_num.ops.norm.factored_norm` whole.  Either forms the eager products and tail with the
eager arguments, so a compiled layer's ``g`` is bitwise the eager one.
"""

from __future__ import annotations

import torch

from ..numerics.formulas import scale_constants
from . import guard as _guard
from .config import OpConfig, get_config, traces_kernels
from .guard import check_on_cancellation
from .magnitude import (_magnitude_div_op, default_eps, magnitude_div,  # noqa: F401  (public here too)
                        magnitude_scale)
from .norm import (FLAG_FIELDS, _accumulate, _base_and_zero_rows, _cached_base_and_zero_rows,  # noqa: F401
                   _factored_row_norm, _products, cached_base_row_norm_sq, cached_zero_rows, chunk_columns,
                   clear_base_sq_cache, factored_norm, new_flag, refresh_base_cache, resolve_chunk_bytes,
                   tail_kernel, uses_tail_kernel)
from .products import Products, takes_w_whole
from .validation import check_lora_factors, check_scale, check_tensor


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
                              cached: bool = True, acc=None, want_g: bool = True, base=None):
    """``(g, bad, den, aux)``: :func:`magnitude_scale_and_flag`, the fp32 ``den`` that ``g =
    m.float() / den`` divides by (the layer's norm cache keeps it) and the tail kernel's ``[3, d_out]``
    guard rows (:func:`dora_num.ops.guard.report_kernel`; None on the torch tail, where the guard acted
    already).  ``trusted``: the caller validated W, A, B and m (only the shapes' consistency is
    checked).  ``where``, ``warn``: the torch tail's guard messages.  ``cached=False``: ``base_sq`` and
    the zero rows recomputed, not cached (the compiled op); ``acc``: a running flag raised by this
    call (:func:`new_flag`); ``want_g=False``: ``g`` is None (the caller divides); ``base``: ``(base_sq,
    zero_rows)`` of W, current (a layer's cache, :func:`~dora_num.ops.norm.refresh_base_cache`), instead
    of W's own cache."""
    if torch.compiler.is_compiling():
        den = weight_den(W, A, B, scale, m, chunk_bytes=chunk_bytes, on_cancellation=on_cancellation, config=cfg)
        return magnitude_div(m, den, cfg), None, None, None
    if trusted and A.shape[1] == W.shape[1] and B.shape == (W.shape[0], A.shape[0]) and m.shape == W.shape[:1]:
        d_out, d_in = W.shape
    else:
        d_out, d_in, _ = check_lora_factors(W, A, B)
        check_tensor("m", m, ndim=1)
        if m.shape[0] != d_out or m.device != W.device:
            raise ValueError(f"m must be [d_out] = [{d_out}] on {W.device}, got {tuple(m.shape)} on {m.device}")
    eps = default_eps(m.dtype)
    if base is not None:
        base_sq, zero_rows = base
    else:
        base_sq, zero_rows = (_cached_base_and_zero_rows(W, chunk_bytes, cfg) if cached
                              else _base_and_zero_rows(W, chunk_bytes, cfg))
    res = factored_norm(W.detach(), A.detach(), B.detach(), scale_constants(check_scale(scale)),
                        chunk_columns(d_out, d_in, chunk_bytes), chunk_bytes, base_sq, cfg, mode=on_cancellation,
                        zero_rows=zero_rows, m=m, eps=eps, acc=acc, want_g=want_g, where=where, warn=warn)
    return res.g, res.flag, res.den, res.aux


# --------------------------------------------------------------------------
# Compiled: the denominator as a custom op with an explicit running flag
# --------------------------------------------------------------------------

def weight_den(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, m: torch.Tensor, *,
               acc: torch.Tensor | None = None, base: tuple | None = None, chunk_bytes: int | None = None,
               on_cancellation: str = "recompute", config: OpConfig | None = None) -> torch.Tensor:
    """The denominator of ``g = m / den`` (fp32 ``[d_out]``, detached) by the custom op
    ``dora_num::weight_den``: what a compiled layer calls.  ``acc`` (:func:`new_flag`; a fresh one if
    None) is raised by the call: finiteness of ``den`` and ``m / den``, the guard's code and count.
    ``base``: the caller's cache ``(base_sq, zero_rows)`` of W (fp32 and bool ``[d_out]``, op inputs the
    op brings up to date: :func:`~dora_num.ops.norm.refresh_base_cache`; the layer's buffers); None: a
    fresh pair, formed in the call."""
    cfg = get_config() if config is None else config
    if acc is None:
        acc = new_flag(W.device)
    if base is None:
        base = (W.new_empty(W.shape[:1], dtype=torch.float32), W.new_empty(W.shape[:1], dtype=torch.bool))
    cb = resolve_chunk_bytes(W.shape[0], W.shape[1], chunk_bytes)
    mode = check_on_cancellation(on_cancellation)
    if _traceable_den(W, A, scale, m, cfg):
        return _weight_den_traced_op(W.detach(), A.detach(), B.detach(), m.detach(), acc, base[0], base[1],
                                     float(scale), int(cb), cfg.key, mode != "off")
    return _weight_den_op(W.detach(), A.detach(), B.detach(), m.detach(), acc, base[0], base[1], float(scale),
                          int(cb), cfg.key, mode)


@torch.library.custom_op("dora_num::weight_den", mutates_args=("acc", "base_sq", "zero_rows"))
def _weight_den_op(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor, acc: torch.Tensor,
                   base_sq: torch.Tensor, zero_rows: torch.Tensor, scale: float, chunk_bytes: int, config: str,
                   on_cancellation: str) -> torch.Tensor:
    """No sync and no state but its inputs: ``acc`` raised, ``base_sq`` and ``zero_rows`` formed again
    only where W changed (:func:`~dora_num.ops.norm.refresh_base_cache`); ``config``: the traced
    :attr:`~dora_num.ops.config.OpConfig.key`."""
    cfg = OpConfig.from_key(config)
    refresh_base_cache(W, base_sq, zero_rows, chunk_bytes, cfg)
    return _magnitude_scale_and_flag(W, A, B, scale, m, chunk_bytes, cfg, on_cancellation, trusted=True, acc=acc,
                                     want_g=False, base=(base_sq, zero_rows))[2]


@_weight_den_op.register_fake
def _(W, A, B, m, acc, base_sq, zero_rows, scale, chunk_bytes, config, on_cancellation):
    return W.new_empty((W.shape[0],), dtype=torch.float32)


# The traced denominator (CUDA, the tail kernel): a ``triton_op`` whose body Inductor traces, so that the
# products and the tail run as the graph's own kernels (the split, the block sums and the tail launched by
# Inductor, the GEMMs its extern calls: the same kernels and layouts as eagerly) and one opaque op remains, a
# short body: the base cache's refresh (whose key is host state: W's pointer and version counter).  The tail's
# checks and the guard's constants run once, while tracing (its constants are numbers of d_in and r: under
# symbolic shapes the tail stays in the opaque op ``dora_num::norm_den``, with the refresh).  Each step forms
# eager's values: the GEMMs, the block sums and the tail are eager's calls, the split is a kernel of ours with
# eager's exactly rounded pieces, and Inductor's contraction cannot reach the kernels' products (``mul_rn``;
# tests/ops/kernels/test_sm90.py); tests/ops/test_compiled.py's GPU test holds the bits to eager.

def _traceable_den(W: torch.Tensor, A: torch.Tensor, scale: float, m: torch.Tensor, cfg: OpConfig) -> bool:
    """Whether a compiled layer's denominator takes the traced op: CUDA with the tail kernel (not the
    interpreter), ``OpConfig.traced_ops`` on, a nonzero scale (``s = 0`` skips the products), an ``m`` the
    tail reads, a rank above 1 (Inductor rewrites a product with an output dimension of 1 in max-autotune
    modes, ``out_dtype`` dropped) and a product route that takes W whole
    (:func:`~dora_num.ops.products.takes_w_whole`: a column loop's bounds would be symbolic under dynamic
    shapes)."""
    return (traces_kernels(W.device, cfg) and uses_tail_kernel(W.device, cfg) and float(scale) != 0.0
            and m.dtype in (torch.float32, torch.bfloat16, torch.float16) and A.shape[0] > 1 and takes_w_whole(W))


@torch.library.triton_op("dora_num::weight_den_traced", mutates_args=("acc", "base_sq", "zero_rows"))
def _weight_den_traced_op(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor, acc: torch.Tensor,
                          base_sq: torch.Tensor, zero_rows: torch.Tensor, scale: float, chunk_bytes: int,
                          config: str, guard: bool) -> torch.Tensor:
    """:func:`_weight_den_op` with its products traced (above); ``guard``: ``on_cancellation`` is not
    ``"off"`` (the kernel recomputes the rows it flags; the reports are :func:`~dora_num.ops.layer.check_flags`'s)."""
    cfg = OpConfig.from_key(config)
    with torch.autocast(W.device.type, enabled=False):
        prod = _products(W, A, None, cfg, traced=True)  # W whole (_traceable_den): no symbolic column budget
    if not (cfg.traced_tail and all(isinstance(d, int) for d in (*W.shape, A.shape[0]))):
        # OpConfig.traced_tail off, or symbolic shapes (the guard's constants are numbers of d_in and r, made
        # here while tracing): the refresh and the tail in the opaque op, which makes the constants per call
        return _norm_den_op(prod.U, B, prod.G, base_sq, zero_rows, m, acc, W, A, prod.inv, float(scale),
                            int(prod.pieces or 0), chunk_bytes, config, guard)
    _base_refresh_op(W, base_sq, zero_rows, chunk_bytes, config)
    return _tail_den(W, A, B, prod, base_sq, zero_rows, m, acc, scale, cfg, guard, traced=True)


def _tail_den(W, A, B, prod: Products, base_sq, zero_rows, m, acc, scale: float, cfg: OpConfig, guard: bool,
              traced: bool = False) -> torch.Tensor:
    """The layer's ``den`` from the products by the tail's one launch (``acc`` raised by the kernel), as
    :func:`~dora_num.ops.norm.factored_norm` launches it: what ``dora_num::norm_den`` runs, and with
    ``OpConfig.traced_tail`` the traced op's body (``traced``: Inductor launches it)."""
    return tail_kernel(W, A, B, prod, base_sq, scale_constants(check_scale(scale)), cfg, m=m, eps=default_eps(m.dtype),
                       guard=guard, zero_rows=zero_rows if guard else None, acc=acc, traced=traced).den


@torch.library.custom_op("dora_num::base_refresh", mutates_args=("base_sq", "zero_rows"))
def _base_refresh_op(W: torch.Tensor, base_sq: torch.Tensor, zero_rows: torch.Tensor, chunk_bytes: int,
                     config: str) -> None:
    """The layer's cache of ``rowsum(W*W)`` and W's zero rows brought up to date
    (:func:`~dora_num.ops.norm.refresh_base_cache`): opaque, since its key is host state (W's pointer and
    version counter), and short: a key comparison, a pass over W only where W changed."""
    refresh_base_cache(W, base_sq, zero_rows, chunk_bytes, OpConfig.from_key(config))


@_base_refresh_op.register_fake
def _(W, base_sq, zero_rows, chunk_bytes, config):
    return None


@torch.library.custom_op("dora_num::norm_den", mutates_args=("base_sq", "zero_rows", "acc"))
def _norm_den_op(U: torch.Tensor, B: torch.Tensor, G: torch.Tensor, base_sq: torch.Tensor, zero_rows: torch.Tensor,
                 m: torch.Tensor, acc: torch.Tensor, W: torch.Tensor, A: torch.Tensor, inv: torch.Tensor | None,
                 scale: float, pieces: int, chunk_bytes: int, config: str, guard: bool) -> torch.Tensor:
    """The tail kernel's denominator of ``g`` from the products, as :func:`~dora_num.ops.norm.factored_norm`
    launches it for the layer (one launch; ``acc`` raised by the kernel), after the base cache's refresh
    (:func:`~dora_num.ops.norm.refresh_base_cache`: formed again only where W changed).  One opaque op for
    both: each costs the dispatcher's time per call."""
    cfg = OpConfig.from_key(config)
    refresh_base_cache(W, base_sq, zero_rows, chunk_bytes, cfg)
    return _tail_den(W, A, B, Products(U, G, pieces or None, inv), base_sq, zero_rows, m, acc, scale, cfg, guard)


@_norm_den_op.register_fake
def _(U, B, G, base_sq, zero_rows, m, acc, W, A, inv, scale, pieces, chunk_bytes, config, guard):
    return U.new_empty((U.shape[0],), dtype=torch.float32)


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
