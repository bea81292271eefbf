"""Row norms of ``W + s*B@A``: dense (PEFT-style) and factored (never forms BA).

``||W_j + s(BA)_j||^2 = base_j + 2s cross_j + s^2 ba_j`` with ``base = rowsum(W*W)``, ``U = W A^T``,
``cross = rowsum(B*U)``, ``G = A A^T``, ``ba = rowsum((B G) * B)``, assembled by
:func:`dora_num.numerics.formulas.norm_assembly`; within
:func:`~dora_num.numerics.bounds.factored_norm_bound` (lemma 4 of docs/bounds.md), rows the
cancellation guard flags formed in float64 (:mod:`dora_num.ops.guard`).  Where it loses accuracy,
the products, the memory and the tails: docs/operator.md, "Row norms: dense and factored".
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

from ..numerics import formulas
from ..numerics.arithmetic import TorchFP32, TorchFP32CorrectSqrt
from ..numerics.formulas import norm_assembly, scale_constants
from ..numerics.norm_posterior import lora_row_magnitudes, posterior_from_terms
from . import guard as _guard
from .config import OpConfig, get_config
from .products import _products, split_gram, split_mm, split_pieces  # noqa: F401  (public here too)
from .guard import check_on_cancellation
from .magnitude import default_eps, initial_magnitude, magnitude_scale  # noqa: F401  (public here too)
from .validation import check_finite, check_lora_factors, check_scale, check_tensor

CHUNK_ALIGN = 64  # columns; chunk widths are multiples of this (coalesced, tensor-core friendly)
DEFAULT_CHUNK_BYTES = 256 * 2**20


def uses_tail_kernel(device: torch.device, config: OpConfig | None = None) -> bool:
    """Whether the factored norm's tail (cross, ba, assembly; for the layer also the clamp and
    the finiteness flag of g) runs as the one-launch Triton kernel of
    :mod:`dora_num.ops.kernels.norm_tail` on ``device`` under ``config`` (default
    :func:`~dora_num.ops.config.get_config`): ``norm_tail="auto"`` on CUDA, ``"triton"`` on
    CUDA and on CPU under the interpreter; otherwise (``"torch"``, or CPU without the
    interpreter) the torch sequence runs."""
    cfg = get_config() if config is None else config
    if cfg.norm_tail == "torch":
        return False
    if device.type == "cuda":
        return True
    return cfg.norm_tail == "triton" and device.type == "cpu" and cfg.interpret


class _AutocastDisabled:
    """Autocast off for ``device_type`` inside the block, restored after (the one switch the
    norm needs: its products must not be cast).  0.8 us per enter/exit on the CPU machine
    against 4.4 us for ``torch.autocast(..., enabled=False)`` (which also saves and restores the
    autocast dtype and cache state, unchanged here); eager only."""

    __slots__ = ("device_type",)

    def __init__(self, device_type: str):
        self.device_type = device_type

    def __enter__(self):
        torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc):
        torch.set_autocast_enabled(self.device_type, True)
        return False


def _autocast_off(device_type: str):
    """Autocast off for ``device_type`` where it is on, else a no-op (constructing a
    ``torch.autocast`` context costs ~4-10 us of Python on the hot path; while tracing,
    ``torch.autocast`` itself)."""
    if torch.is_autocast_enabled(device_type):
        if torch.compiler.is_compiling():
            return torch.autocast(device_type, enabled=False)
        return _AutocastDisabled(device_type)
    return contextlib.nullcontext()


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


def resolve_chunk_bytes(d_out: int, d_in: int, chunk_bytes: int | None) -> int:
    """The byte budget of one fp32 chunk of W plus its square.

    ``None`` (the default everywhere) means ``min(256 MiB, d_out*d_in*4 / 4)``, never
    below one 64-column chunk: each temporary is then at most an eighth of a dense
    fp32 ``[d_out, d_in]`` matrix (the two together a quarter) for ``d_in >= 512``,
    and never above the 256 MiB of the paper's implementation at large sizes.
    An explicit ``chunk_bytes`` is used as given (validated by :func:`chunk_columns`).
    """
    if chunk_bytes is not None:
        return chunk_bytes
    smallest = min(CHUNK_ALIGN, d_in) * 2 * 4 * max(d_out, 1)
    return max(smallest, min(DEFAULT_CHUNK_BYTES, d_out * d_in))


def chunk_columns(d_out: int, d_in: int, chunk_bytes: int | None) -> int:
    """Widest chunk (a multiple of 64 columns, or all of ``d_in``) whose fp32
    copy of W plus its square fit in ``chunk_bytes`` (``None``: :func:`resolve_chunk_bytes`)."""
    chunk_bytes = resolve_chunk_bytes(d_out, d_in, chunk_bytes)
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


def base_row_norm_sq(W: torch.Tensor, *, chunk_bytes: int | None = None) -> torch.Tensor:
    """``rowsum(W*W)`` in fp32; depends on the frozen W only.  Where the norm's tail is the Triton
    kernel (:func:`uses_tail_kernel`) one pass of :mod:`dora_num.ops.kernels.row_sumsq` (a fixed
    order); elsewhere torch over fp32 column chunks of W under ``chunk_bytes``."""
    check_tensor("W", W, ndim=2)
    return _base_and_zero_rows(W, chunk_bytes, get_config(), zero=False)[0]


def _base_and_zero_rows(W: torch.Tensor, chunk_bytes, cfg: OpConfig, zero: bool = True):
    """``(rowsum(W*W), W's exactly zero rows)`` (fp32, bool ``[d_out]``; the second None without
    ``zero``), from one pass over W (the kernel where the tail is the Triton one, else fp32 column
    chunks of W under ``chunk_bytes``)."""
    d_out, d_in = W.shape
    with torch.no_grad():
        if uses_tail_kernel(W.device, cfg):
            from .kernels.row_sumsq import row_sumsq

            base, zero_rows = row_sumsq(W.detach(), config=cfg)
            return base, (zero_rows if zero else None)
        cols = chunk_columns(d_out, d_in, chunk_bytes)
        with _autocast_off(W.device.type):
            acc = torch.zeros(d_out, dtype=torch.float32, device=W.device)
            zero_rows = torch.ones(d_out, dtype=torch.bool, device=W.device) if zero else None
            for start in range(0, d_in, cols):
                Wc = W[:, start : start + cols].float()
                acc += (Wc * Wc).sum(dim=1)
                if zero:
                    zero_rows &= (Wc == 0).all(dim=1)
        return acc, zero_rows


# The torch tail's three [rows, r] fp32 blocks: 24 MiB keeps 8192 x r=384 to two row blocks, since the
# loop is bound by its launches (the CUDA default is the tail kernel: data/gpu/norm_bench.csv)
ROW_CHUNK_BYTES = 24 * 2**20


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
    from . import finite

    mode = check_on_cancellation(on_cancellation)
    cfg = get_config()
    if not torch.compiler.is_compiling():
        finite.poll()
    wnorm = _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, check and not return_flag, cfg, mode,
                               given_base_sq=True)
    return (wnorm, finite.any_not_finite(wnorm)) if return_flag else wnorm


def _check_base_sq(base_sq, d_out: int, device) -> None:
    check_tensor("base_sq", base_sq, ndim=1, dtypes=(torch.float32,))
    if base_sq.shape[0] != d_out or base_sq.device != device:
        raise ValueError(
            f"base_sq must be float32 [d_out] = [{d_out}] on {device}, "
            f"got shape {tuple(base_sq.shape)} on {base_sq.device}"
        )


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


def _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, check: bool, cfg: OpConfig,
                       on_cancellation: str = "recompute", zero_rows=None, given_base_sq: bool = False) -> torch.Tensor:
    """:func:`factored_row_norm` under the configuration ``cfg`` (``zero_rows``: the optional
    cached mask of the exactly zero rows of W, :func:`cached_zero_rows`); the checks and the
    guard's reports as :func:`_watch_core` (none while tracing: the custom ops run this at run
    time)."""
    d_out, d_in, r = check_lora_factors(W, A, B)
    s_raw = check_scale(scale)
    cols = chunk_columns(d_out, d_in, chunk_bytes)
    if base_sq is not None:
        _check_base_sq(base_sq, d_out, W.device)
        if given_base_sq:  # a caller's cache (the public norm's base_sq=): its values read once
            _check_given_base_sq_values(base_sq, W)
    consts = scale_constants(s_raw)
    guard = on_cancellation != "off"
    with torch.no_grad(), _autocast_off(W.device.type):
        core = _factored_core(W, A, B, consts, cols, chunk_bytes, base_sq, cfg, guard=guard, zero_rows=zero_rows)
    if torch.compiler.is_compiling():
        return core.wnorm
    return _watch_core(core, W, A, B, base_sq, consts[0], check, cfg, on_cancellation, "factored_row_norm")


def _watch_core(core: "_Core", W, A, B, base_sq, s: float, check: bool, cfg: OpConfig, mode: str,
                where: str, on_report=None) -> torch.Tensor:
    """The checked, guarded ``wnorm`` of ``core``.

    Triton tail (``core.flag`` given): the rows were recomputed in the kernel; its flag goes to
    :func:`dora_num.ops.finite.watch` (deferred on CUDA by default), which, when set, raises the
    finiteness error (``check``) or reports the guard (:func:`dora_num.ops.guard.report_kernel`;
    ``on_report(code, flagged)`` is called first, for the layer's own warning).  Torch tail: the
    decision is read now (``_guard.status``: free on the CPU, a sync on CUDA); with the guard, rows
    whose fp32 intermediates overflowed although the inputs are finite are formed in float64 first
    (:func:`_recompute_not_finite`: their norm often fits in fp32), the finiteness error is raised
    (``check``) only for rows whose norm itself exceeds fp32, and the flagged rows are recomputed on
    the host (:func:`dora_num.ops.guard.resolve`).
    """
    from . import finite

    guard = mode != "off"
    if core.flag is not None:
        def on_fail(host_flag):
            code, flagged = _guard.decode(host_flag)
            if code >= _guard.FLAG_NONFINITE:
                if not check:
                    return True
                _raise_norm_not_finite(W, A, B, base_sq, s=s, wnorm=core.wnorm)
            if on_report is not None:
                on_report(code, flagged)
            if guard and core.aux is not None:
                _guard.report_kernel(code, core.aux, mode, where=where, wnorm=core.wnorm, d_in=W.shape[1])
            return True

        watched = finite.watch(core.flag, where, cfg.finite_check, on_fail=on_fail)
        if watched is not None:
            watched.check()
        return core.wnorm
    wnorm = core.wnorm
    if not guard:
        if check:
            watched = finite.watch(finite.all_finite(wnorm), where, cfg.finite_check, is_ok=True,
                                   on_fail=lambda _: _raise_norm_not_finite(W, A, B, base_sq, s=s, wnorm=wnorm))
            if watched is not None:
                watched.check()
        return wnorm
    rel = core.rel
    code = int(_guard.status(wnorm, rel))  # one read: finiteness and the guard
    if code >= _guard.FLAG_NONFINITE:
        wnorm, rel = _recompute_not_finite(W, A, B, s, wnorm, rel, base_sq, check)
        code = int(_guard.status(wnorm, rel))
    if code >= _guard.FLAG_CANCELLATION:
        with torch.no_grad(), _autocast_off(W.device.type):
            wnorm = _guard.resolve(W, A, B, s, wnorm, rel, mode, where=where)
    return wnorm


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
    with torch.no_grad(), _autocast_off(W.device.type):
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
        with torch.no_grad(), _autocast_off(W.device.type):
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
    are the caller's (:func:`_watch_core`).  ``zero_rows`` (a bool mask of the exactly zero rows
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
    C = _guard.guard_constants(two_s, s_sq, W, r, prod.pieces) if guard else None
    if uses_tail_kernel(W.device, cfg):
        from .kernels.norm_tail import norm_tail

        t = norm_tail(prod.U, B, prod.G, acc_base, two_s, s_sq, m=m, eps=eps, guard=C,
                      rel_max=_guard.CANCELLATION_REL if guard else None, zero_rows=zero_rows,
                      recompute=(W, A, s) if guard else None, inv=prod.inv if C is not None and C.inv_runtime else None,
                      acc=acc, config=cfg)
        return _Core(t.wnorm, t.den, t.flag, t.rel, t.aux)
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


def factored_terms(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, *,
                   chunk_bytes: int | None = None, base_sq: torch.Tensor | None = None):
    """``(base_sq, cross, ba, two_s, s_sq)``: what the factored norm's torch tail assembles.

    The fp32 ``[d_out]`` terms ``base_sq = rowsum(W*W)`` (or the given cached one),
    ``cross = rowsum(B * W A^T)``, ``ba = rowsum((B A A^T) * B)`` and the fp32 constants
    ``2s``, ``s^2`` of :func:`~dora_num.numerics.formulas.scale_constants`, computed by the
    same code and in the same order as :func:`factored_row_norm` with the torch tail
    (``OpConfig.norm_tail="torch"``), whose bare result (``on_cancellation="off"``; the guard
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
    with torch.no_grad(), _autocast_off(W.device.type):
        acc_base = base_row_norm_sq(W, chunk_bytes=chunk_bytes) if base_sq is None else base_sq
        if s == 0.0:
            zeros = torch.zeros_like(acc_base)
            return acc_base, zeros, zeros.clone(), 0.0, 0.0
        U, G = _products(W, A, cols, get_config())[:2]
        cross, ba = _torch_tail_terms(U, B, G)
    return acc_base, cross, ba, two_s, s_sq
