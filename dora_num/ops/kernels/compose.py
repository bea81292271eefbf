"""Fused Triton kernels of the DoRA compose: forward, training forward, backward.

Per element, inputs upcast to fp32, each operation one rounding (the sequence of
:mod:`dora_num.numerics.formulas`, as :mod:`dora_num.ops.reference` evaluates it)::

    gm1 = g - 1;  sl = s * lora;  out = gm1 * base + g * sl  (mul, then add: no FMA)
    inner = sl + base;  backward: dlora = (g s) D,  dbase = gm1 D,  dg = sum_rows(inner D)

Every product that an add follows is :func:`~dora_num.ops.kernels._common.mul_rn` (never contracted
into an FMA, whoever compiles the kernel) and our launches pass ``enable_fp_fusion=False`` besides, so
the outputs are bitwise the eager reference's, launched by us or by Inductor (``traced``).  ``dg`` is a fixed-order two-stage sum (per-block partials, then chunks in sequence; no
float atomics): ``|dg^ - dg| <= gamma_{A+1} sum |inner D|`` (:func:`dg_error_bound`).  The sequence,
the ``ADD_BASE``/``ADD_GRAD`` folds and the reduction order in full: docs/operator.md.

References: tiles (``OpConfig.compose_tiles``) from the sweep in ``data/gpu/tile_sweep.csv``
(``dora-num record tiles``); bounds: lemma 1 (the compose) and lemma 7 (``dg``) of docs/bounds.md;
docs/operator.md, "The compose kernels".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import OpConfig, get_config
from ._common import fusion_opts, launcher, mul_rn, new_buffer

U32 = 2.0**-24


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------

@triton.jit
def _compose_fwd_kernel(
    base_ptr, lora_ptr, g_ptr, out_ptr, inner_ptr, flag_ptr,
    n_rows, n_cols, s,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_INNER: tl.constexpr, ADD_BASE: tl.constexpr,
    G_FLAG: tl.constexpr, RN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    g = tl.load(g_ptr + cols, mask=col_mask, other=1.0)
    if G_FLAG:  # the finiteness flag of g, one slot per column block (written by the first row block)
        if pid_m == 0:
            bad = tl.max(tl.where(col_mask & ~(tl.abs(g) < float("inf")), 1, 0), axis=0)  # NaN: not < inf
            tl.store(flag_ptr + pid_n, bad)
    base = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    lora = tl.load(lora_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gm1 = g - 1.0
    sl = mul_rn(s, lora, RN)
    t = mul_rn(g[None, :], sl, RN)
    prod = mul_rn(gm1[None, :], base, RN)
    out = (prod + t).to(out_ptr.dtype.element_ty)
    if ADD_BASE:  # y = base + delta, delta rounded first: torch's add of the two tensors, bit for bit
        out = (base + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, out, mask=mask)
    if WRITE_INNER:
        inner = sl + base
        tl.store(inner_ptr + offsets, inner, mask=mask)


@triton.jit
def _compose_bwd_kernel(
    grad_ptr, inner_ptr, base_ptr, lora_ptr, g_ptr, dlora_ptr, dbase_ptr, partial_ptr, count_ptr, dg_ptr,
    n_rows, n_cols, s,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_DLORA: tl.constexpr, WRITE_DBASE: tl.constexpr, NEED_DG: tl.constexpr,
    RECOMPUTE_INNER: tl.constexpr, FINAL_IN_KERNEL: tl.constexpr, CHUNK: tl.constexpr,
    ADD_GRAD: tl.constexpr, RN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    g = tl.load(g_ptr + cols, mask=col_mask, other=1.0)
    d = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if WRITE_DLORA:
        gs = mul_rn(g, s, RN)
        tl.store(dlora_ptr + offsets, mul_rn(gs[None, :], d, RN).to(dlora_ptr.dtype.element_ty), mask=mask)
    if WRITE_DBASE:
        gm1 = g - 1.0
        dbase = mul_rn(gm1[None, :], d, RN).to(dbase_ptr.dtype.element_ty)
        if ADD_GRAD:  # base also fed y = base + delta directly: D + dbase, as autograd accumulates them
            dbase = (d + dbase.to(tl.float32)).to(dbase_ptr.dtype.element_ty)
        tl.store(dbase_ptr + offsets, dbase, mask=mask)
    if NEED_DG:
        if RECOMPUTE_INNER:  # the forward's inner, bit for bit: sl = s*lora; inner = sl + base
            base = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            lora = tl.load(lora_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            sl = mul_rn(s, lora, RN)
            inner = sl + base
        else:
            inner = tl.load(inner_ptr + offsets, mask=mask, other=0.0)
        part = tl.sum(mul_rn(inner, d, RN), axis=0)
        tl.store(partial_ptr + pid_m.to(tl.int64) * n_cols + cols, part, mask=col_mask)
        if FINAL_IN_KERNEL:
            # The last program of this column block to arrive (an integer counter: no
            # float atomics) adds the partials in the fixed order of _dg_final_sum.
            # Which program is last varies; the order of the sum does not.
            tl.debug_barrier()  # every thread's partial store precedes the release below
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(0) - 1:
                _dg_final_sum(partial_ptr, dg_ptr, cols, col_mask, tl.num_programs(0), n_cols, BLOCK_N, CHUNK)
                tl.store(count_ptr + pid_n, 0)  # every program has arrived: reset for the next launch


@triton.jit
def _dg_final_sum(partial_ptr, dg_ptr, cols, col_mask, n_blocks, n_cols, BLOCK_N: tl.constexpr,
                  CHUNK: tl.constexpr):
    # Fixed order: chunks of CHUNK row blocks in sequence, each reduced by tl.sum's
    # (compile-time fixed) tree.  A sequential loop over single rows was latency
    # bound: ~50 us of a 0.24 ms backward at 8192x8192 on the H200.  ".cg": read
    # from L2, where the other programs' partials are (not from this SM's L1).
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_blocks, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        tile = tl.load(partial_ptr + idx[:, None].to(tl.int64) * n_cols + cols[None, :],
                       mask=(idx[:, None] < n_blocks) & col_mask[None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(tile, axis=0)
    tl.store(dg_ptr + cols, acc, mask=col_mask)


@triton.jit
def _dg_final_kernel(partial_ptr, dg_ptr, n_blocks, n_cols, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Stage 2 as its own launch (``OpConfig.dg_stage2_in_kernel=False``)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _dg_final_sum(partial_ptr, dg_ptr, cols, cols < n_cols, n_blocks, n_cols, BLOCK_N, CHUNK)


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------

def _as_2d(name: str, t: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` -> contiguous ``[M, N]`` (a copy if ``t`` is not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(-1, t.shape[-1]) if t.dim() != 2 else t


_COUNTERS: dict = {}  # (device, stream) -> int32 arrival counters, all zero between launches
_OUTGROWN: list = []  # buffers replaced by larger ones, kept alive (a captured graph may point at them)


def _arrival_counters(device: torch.device, n: int, stateless: bool = False) -> torch.Tensor:
    """``n`` int32 arrival counters of the in-kernel dg stage 2, zero on entry.

    The kernel's last program of each column block resets its counter to zero, so
    the buffer is reused in eager mode (no fill launch per backward: the layer's step
    is bound by the host).  One buffer per device and stream: kernels on one stream
    run in order, so they never share a counter concurrently.  While a CUDA graph is
    being captured the buffer is a fresh ``torch.zeros`` captured with the graph and
    never cached: the graph owns it (its fill replays with it), whatever stream it is
    later replayed on and whatever other graphs do.  A buffer outgrown by a larger
    launch is kept alive.  Under the interpreter, a fresh zeroed buffer every call.
    """
    if stateless or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _fwd_blocks(n_cols: int, tiles) -> tuple[int, int]:
    block_n = min(tiles.fwd_max_block_n, triton.next_power_of_2(max(n_cols, 1)))
    block_m = max(1, tiles.fwd_tile_elems // block_n)
    return block_m, block_n


def compose_fwd(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float, *,
                write_inner: bool = False, out: torch.Tensor | None = None, add_base: bool = False,
                fp_fusion: bool = False, return_kernel: bool = False, config: OpConfig | None = None,
                g_flag: torch.Tensor | None = None, traced: bool = False):
    """Fused stable compose.  Returns ``(out, inner)`` (``inner`` None unless asked).

    ``g_flag``: an int32 device tensor of at least ``ceil(N / block_n)`` entries (:func:`g_flag_size`)
    that the kernel fills with the finiteness flag of ``g`` (entry ``j`` nonzero iff a ``g`` of
    column block ``j`` is NaN or Inf), so that the public compose checks ``g`` without launches
    of its own; with an empty ``base`` it is filled by torch.

    ``config`` (default :func:`~dora_num.ops.config.get_config`): the tiles
    (``compose_tiles``) and ``poison`` to launch with.

    ``add_base``: ``out = base + delta`` with ``delta`` rounded to the activation dtype
    first, i.e. bitwise ``base + compose(...)`` in torch (the layer's output, one pass
    and one launch fewer).

    ``s`` must already be fp32-exact (:func:`~dora_num.numerics.formulas.scale_constants`).
    ``out`` may alias ``base`` or ``lora`` (in-place inference: each element is
    read before it is written, by the same program) and must then be contiguous.
    ``fp_fusion=True`` lets the compiler contract into FMA: a study variant only,
    never the production path.  With ``return_kernel`` the compiled kernel handle
    is appended (to read its PTX).  ``traced``: launched through ``torch.library.wrap_triton``
    (the body of a ``triton_op`` that Inductor traces: :mod:`dora_num.ops.compose`); the same kernel
    and arguments, so the same bits (:func:`~dora_num.ops.kernels._common.mul_rn`).
    """
    cfg = get_config() if config is None else config
    shape = base.shape
    base2 = _as_2d("base", base)
    lora2 = _as_2d("lora", lora)
    n_rows, n_cols = base2.shape
    if out is None:
        out2 = new_buffer(base2.shape, base2.dtype, base2.device, cfg.poison)
    else:
        if not out.is_contiguous():
            raise ValueError("out must be contiguous for the in-place fused compose")
        if out.shape != shape or out.dtype != base.dtype or out.device != base.device:
            raise ValueError(f"out must match base ({tuple(shape)}, {base.dtype}, {base.device}), got "
                             f"({tuple(out.shape)}, {out.dtype}, {out.device})")
        out2 = out.view(n_rows, n_cols)
    inner2 = new_buffer((n_rows, n_cols), torch.float32, base.device, cfg.poison) if write_inner else None
    kernel = None
    if base2.numel():
        block_m, block_n = _fwd_blocks(n_cols, cfg.compose_tiles)
        grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
        # unused pointers point at an input, never at out2: where Inductor cannot tell which arguments the
        # kernel writes it takes all of them as written, and an output aliased by two of them comes back
        # from the functional launch as either copy
        kernel = launcher(_compose_fwd_kernel, traced)[grid](
            base2, lora2, g.contiguous(), out2, inner2 if write_inner else base2,
            g_flag if g_flag is not None else base2,
            n_rows, n_cols, float(s),
            BLOCK_M=block_m, BLOCK_N=block_n, WRITE_INNER=write_inner, ADD_BASE=add_base,
            G_FLAG=g_flag is not None, RN=not (fp_fusion or cfg.interpret),
            num_warps=cfg.compose_tiles.fwd_num_warps, **fusion_opts(fp_fusion, traced),
        )
    elif g_flag is not None:
        g_flag.copy_((~torch.isfinite(g).all()).to(torch.int32).expand(g_flag.shape))
    res = (out2.view(shape), inner2.view(shape) if write_inner else None)
    return res + (kernel,) if return_kernel else res


def g_flag_size(n_cols: int, config: OpConfig | None = None) -> int:
    """Entries of the ``g_flag`` of :func:`compose_fwd` for ``n_cols`` columns: its column blocks."""
    cfg = get_config() if config is None else config
    return triton.cdiv(max(n_cols, 1), _fwd_blocks(n_cols, cfg.compose_tiles)[1])


def compose_bwd(grad: torch.Tensor, inner: torch.Tensor | None, g: torch.Tensor, s: float, *,
                need_dlora: bool = True, need_dbase: bool = True, need_dg: bool = True,
                base: torch.Tensor | None = None, lora: torch.Tensor | None = None, add_grad: bool = False,
                config: OpConfig | None = None, stateless: bool = False, traced: bool = False):
    """Fused compose backward: ``(dlora, dbase, dg)``; entries not asked for are None.

    ``stateless``: fresh zeroed arrival counters for the in-kernel ``dg`` stage 2 instead of the
    reused buffer (one fill launch; what the compiled op asks for: a graph owns its buffers).
    ``traced``: as :func:`compose_fwd`'s.

    ``config`` (default :func:`~dora_num.ops.config.get_config`; the autograd backward
    passes its forward's): the tiles (``compose_tiles``), where stage 2 of ``dg`` runs
    (``dg_stage2_in_kernel``) and ``poison``.

    ``add_grad`` (the backward of ``compose_fwd(add_base=True)``): ``dbase = grad + (g-1)*grad``
    with the second term rounded first, bitwise autograd's accumulation of the two.

    ``dg`` is fp32 ``[N]``, summed over every leading dimension by the
    deterministic two-stage reduction of the module docstring, from the saved
    fp32 ``inner``, or (``inner=None``, ``base`` and ``lora`` given) from
    ``inner`` recomputed in registers with the forward's two operations (the
    same bits; saves writing and re-reading 4 bytes per element).
    """
    cfg = get_config() if config is None else config
    tiles = cfg.compose_tiles
    shape = grad.shape
    grad2 = _as_2d("grad", grad)
    n_rows, n_cols = grad2.shape
    dev = grad.device
    recompute = need_dg and inner is None and base is not None and lora is not None
    if need_dg and recompute:
        base2, lora2 = _as_2d("base", base), _as_2d("lora", lora)
        if base2.shape != grad2.shape or lora2.shape != grad2.shape:
            raise ValueError(f"base and lora must have grad's shape {tuple(shape)}")
    elif need_dg:
        if inner is None:
            raise ValueError("inner is required for dg (save it in the forward: write_inner=True), "
                             "or pass base and lora to recompute it")
        inner2 = _as_2d("inner", inner)
        if inner2.dtype != torch.float32 or inner2.shape != grad2.shape:
            raise ValueError(f"inner must be float32 of grad's shape {tuple(shape)}, got "
                             f"{inner.dtype} {tuple(inner.shape)}")
    dlora = new_buffer(grad2.shape, grad2.dtype, dev, cfg.poison) if need_dlora else None
    dbase = new_buffer(grad2.shape, grad2.dtype, dev, cfg.poison) if need_dbase else None
    dg = new_buffer((n_cols,), torch.float32, dev, cfg.poison) if need_dg else None
    if need_dg and grad2.numel() == 0:
        dg.zero_()  # an empty sum
    if grad2.numel() and (need_dlora or need_dbase or need_dg):
        block_m = tiles.bwd_block_m
        block_n = min(tiles.bwd_max_block_n, triton.next_power_of_2(n_cols))
        n_blocks = triton.cdiv(n_rows, block_m)
        n_col_blocks = triton.cdiv(n_cols, block_n)
        partials = new_buffer((n_blocks, n_cols), torch.float32, dev, cfg.poison) if need_dg else None
        final_in_kernel = need_dg and cfg.dg_stage2_in_kernel
        counts = _arrival_counters(dev, n_col_blocks, stateless) if final_in_kernel else None
        dummy = grad2
        launcher(_compose_bwd_kernel, traced)[(n_blocks, n_col_blocks)](
            grad2, inner2 if need_dg and not recompute else dummy,
            base2 if recompute else dummy, lora2 if recompute else dummy, g.contiguous(),
            dlora if need_dlora else dummy, dbase if need_dbase else dummy,
            partials if need_dg else dummy, counts if final_in_kernel else dummy, dg if need_dg else dummy,
            n_rows, n_cols, float(s),
            BLOCK_M=block_m, BLOCK_N=block_n,
            WRITE_DLORA=need_dlora, WRITE_DBASE=need_dbase, NEED_DG=need_dg, RECOMPUTE_INNER=recompute,
            FINAL_IN_KERNEL=final_in_kernel, CHUNK=tiles.fin_chunk, ADD_GRAD=add_grad, RN=not cfg.interpret,
            num_warps=tiles.bwd_num_warps, **fusion_opts(False, traced),
        )
        if need_dg and not final_in_kernel:
            fin_n = min(tiles.fin_block_n, triton.next_power_of_2(n_cols))
            launcher(_dg_final_kernel, traced)[(triton.cdiv(n_cols, fin_n),)](
                partials, dg, n_blocks, n_cols, BLOCK_N=fin_n, CHUNK=tiles.fin_chunk, num_warps=4,
                **fusion_opts(False, traced))
    return (dlora.view(shape) if need_dlora else None,
            dbase.view(shape) if need_dbase else None,
            dg)


def dg_error_bound(inner: torch.Tensor, grad: torch.Tensor, n_rows: int | None = None, *,
                   config: OpConfig | None = None) -> torch.Tensor:
    """A-priori bound on ``|dg_fused - sum_rows(inner * D)|`` per column (fp64 ``[N]``),
    ``inner`` being the fp32 tensor the kernel multiplies (exact sum of its products),
    for the tiles of ``config`` (default :func:`~dora_num.ops.config.get_config`).

    Each product rounds once (``u``, plus ``2^-150`` if it underflows), then passes
    through at most ``A`` additions of this kernel's two-stage tree
    (:func:`dora_num.numerics.bounds.dg_max_additions`, the one count of them):
    ``gamma_{A+1} sum |inner D| + T 2^-150 (1 + gamma_A)``.  The bound of ``dg``
    against the exact value from ``lora`` and ``base`` (which adds the rounding of
    ``inner``) is :func:`dora_num.numerics.bounds.dg_bound`.
    """
    from ...numerics.bounds import dg_max_additions, gamma

    inner2 = inner.reshape(-1, inner.shape[-1]).double()
    d2 = grad.reshape(-1, grad.shape[-1]).double()
    m = inner2.shape[0] if n_rows is None else n_rows
    tiles = (get_config() if config is None else config).compose_tiles
    adds = dg_max_additions("fused", max(1, m), block_m=tiles.bwd_block_m, chunk=tiles.fin_chunk)
    underflow = max(1, m) * 2.0**-150 * (1 + gamma(adds, U32))
    return gamma(adds + 1, U32) * (inner2 * d2).abs().sum(dim=0) + underflow
