"""The GPU suite's ``norm`` section (notebook 05): row-norm time, peak extra memory and
error against fp64 for the PEFT-style dense norm in the weight dtype, the dense fp32
norm, and the factored norm without and with the cached ``base_sq`` (the paper's
Table 1 shapes), plus the cached norm on its torch tail (the same-run A/B of the
tail kernel).

And the norm kernels' rows of the ``tiles`` section (:func:`norm_tile_sweep`): the row-sum kernel
over a grid of ``RowSumsqTiles`` and the tail over a grid of ``NormTailTiles``, at the operator's
shapes, each configuration checked against its bound before it is timed."""

from __future__ import annotations

import dataclasses
import math

import torch

from ...numerics.formulas import scale_constants
from ...numerics.standard_model import ETA32, TINY32, U32, U64, gamma
from ...ops.config import NormTailTiles, RowSumsqTiles, get_config
from ...ops.norm import base_row_norm_sq, dense_row_norm, factored_row_norm
from ...oracles import row_norm_ref64, row_norm_ref64_error_bound
from .. import inputs
from ..bench import (copy_bandwidth, device_name, host_path, log, max_rel_err, norm_tail_bytes, peak_extra_bytes,
                     row_sumsq_bytes, time_ms)

NORM_SHAPES = ((4096, 4096, 384), (8192, 8192, 384), (8192, 8192, 512), (8192, 28672, 384))
SEED = inputs.SUITE_SEED + 1


def _peft_style_norm(W, A, B, s):
    """PEFT's DoRA weight norm: ``||W + s*(B@A)||_row`` in the weight dtype (no fp32)."""
    with torch.no_grad():
        return torch.linalg.norm(W + s * (B @ A), dim=1).to(W.dtype)


def _torch_tail_norm(W, A, B, s, base_sq):
    """The cached factored norm with the torch tail: the same-run A/B of the tail kernel."""
    with host_path("torch"):
        return factored_row_norm(W, A, B, s, base_sq=base_sq)


def bench_norms(shapes, w_dtypes) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    rows = []
    for d_out, d_in, r in shapes:
        for wd in w_dtypes:
            W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).to(wd)
            A = (torch.randn(r, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).to(wd)
            B = (1e-2 * torch.randn(d_out, r, device="cuda", generator=gen) / math.sqrt(r)).to(wd)
            s = 192 / math.sqrt(r)
            ref = row_norm_ref64(W, A, B, s)  # s = fl32(s), as every fp32 method multiplies by
            cache = base_row_norm_sq(W)
            methods = {
                "peft_dense_wdtype": lambda: _peft_style_norm(W, A, B, s),
                "dense_fp32": lambda: dense_row_norm(W, A, B, s),
                "factored": lambda: factored_row_norm(W, A, B, s),
                "factored_cached": lambda: factored_row_norm(W, A, B, s, base_sq=cache),
                "factored_cached_torch_tail": lambda: _torch_tail_norm(W, A, B, s, cache),
            }
            for name, fn in methods.items():
                peak, out = peak_extra_bytes(fn)
                err = max_rel_err(out.double(), ref)
                t = time_ms(fn)
                rows.append({"method": name, "d_out": d_out, "d_in": d_in, "rank": r,
                             "w_dtype": str(wd).removeprefix("torch."), "peak_extra_bytes": peak,
                             "out_bytes": out.numel() * out.element_size(), "rel_err_fp64": err, **t.as_dict()})
            del W, A, B, ref, cache
            torch.cuda.empty_cache()
            log(f"norm {d_out}x{d_in} r={r} {wd} done")
    return rows


# --------------------------------------------------------------------------
# The norm kernels' tile sweep (rows of the ``tiles`` section)
# --------------------------------------------------------------------------

NORM_TILE_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # d_out x d_in: an 8B model's attention and MLP
NORM_TILE_RANKS = (64, 384)
SUMSQ_GRID = tuple(RowSumsqTiles(m, k, w) for m in (4, 8, 16) for k in (256, 512, 1024) for w in (4, 8))
TAIL_GRID = tuple(NormTailTiles(block_m=m, block_r=br, num_warps=w) for m in (16, 32, 64) for br in (32, 64)
                  for w in (4, 8))
NORM_TILES_FULL = dict(shapes=NORM_TILE_SHAPES, ranks=NORM_TILE_RANKS, sumsq_grid=SUMSQ_GRID, tail_grid=TAIL_GRID)
# tiny: a check of the recorder itself (the suite's --smoke; the CPU test under the interpreter)
NORM_TILES_SMOKE = dict(shapes=((40, 96),), ranks=(16,), sumsq_grid=(RowSumsqTiles(), RowSumsqTiles(4, 32, 2)),
                        tail_grid=(NormTailTiles(), NormTailTiles(block_m=16, block_r=16)))
SWEEP_TIMING = dict(warmup=10, rep=50)  # ms per do_bench: the sweep stays under 90 s on one H100


def _check_row_sumsq(W, base, zero) -> tuple[bool, float]:
    """``(ok, err/bound)``: ``base`` within lemma 4's bound of W's row sums (any tiles: the bound holds
    for any order), against the float64 sum (whose own error, ``gamma64_d`` of it, is added), and the
    zero-row mask exact."""
    d = W.shape[1]
    sq = W.double() ** 2  # exact
    ref = sq.sum(dim=1)
    n_b = ((sq > 0) & (sq < TINY32)).sum(dim=1).double()
    g, g64 = gamma(d, U32), gamma(d, U64)
    bound = (g + g64) / (1 - g64) * ref + (1 + g) * n_b * ETA32
    err = (base.double() - ref).abs()
    ok = bool(torch.isfinite(base).all()) and bool((err <= bound).all()) \
        and torch.equal(zero, (W == 0).all(dim=1))
    return ok, float((err / bound.clamp_min(1e-300)).max()) if W.shape[0] else 0.0


def _check_tail(res, ref, ref_err) -> tuple[bool, float]:
    """``(ok, err/bound)``: every row of the tail's ``wnorm`` within its guaranteed bound ``rel_out``
    (lemma 4', any order) of the float64 dense norm, whose own bound (``row_norm_ref64_error_bound``) is
    added; the flag says finite and resolved."""
    from ...ops.guard import FLAG_UNRESOLVED, decode

    bound = res.rel_out.double() * (ref + ref_err) + ref_err
    err = (res.wnorm.double() - ref).abs()
    code, _ = decode(res.flag)
    ok = code < FLAG_UNRESOLVED and bool(torch.isfinite(res.wnorm).all()) and bool((err <= bound).all())
    return ok, float((err / bound.clamp_min(1e-300)).max())


def norm_tile_sweep(shapes, ranks, sumsq_grid, tail_grid, *, device="cuda", timer=time_ms,
                    timing: dict | None = None) -> list[dict]:
    """Rows of the norm kernels' tile sweep: per ``d_out x d_in`` of ``shapes`` (bf16 W, a realistic
    bf16 adapter of each rank in ``ranks``: :func:`.record_guard_cost._inputs`), ``row_sumsq`` under each
    tiles of ``sumsq_grid`` and, per ``d_out`` and rank, the tail as the layer launches it (``m``, the
    guard and its recompute, the zero rows) under each of ``tail_grid``.  Each configuration is checked
    (:func:`_check_row_sumsq`, :func:`_check_tail`) and timed only if it passes (``timer``,
    :func:`~dora_num.studies.bench.time_ms`'s signature, with ``timing``); GB/s from the kernels'
    traffic models (:func:`~dora_num.studies.bench.row_sumsq_bytes`,
    :func:`~dora_num.studies.bench.norm_tail_bytes`) against a copy of as many bytes timed by the same
    timer in the same run (``pct_copy``).  Every row names its tiles, whether they are the defaults and
    the device."""
    from ...ops.guard import CANCELLATION_REL, guard_constants
    from ...ops.kernels.norm_tail import norm_tail
    from ...ops.kernels.row_sumsq import row_sumsq
    from ...ops.magnitude import default_eps
    from ...ops.products import _products, chunk_columns
    from .record_guard_cost import _inputs

    timing = SWEEP_TIMING if timing is None else timing
    base_cfg = get_config()
    gpu = device_name(device)
    copies: dict[int, float] = {}
    rows: list[dict] = []

    def rec(kernel, tiles, default, key, fn, ok, ratio, nbytes, **extra):
        row = {"kernel": kernel, **key, **dataclasses.asdict(tiles), "default": tiles == default, "check_ok": ok,
               "err_over_bound": ratio, "bytes": nbytes, "gpu": gpu, **extra}
        if ok:  # never time a configuration whose check failed
            t = timer(fn, **timing)
            if nbytes not in copies:
                copies[nbytes] = copy_bandwidth(nbytes // 2, device, timer=lambda f: timer(f, **timing))["gbps"]
            gbps = nbytes / (t.ms * 1e-3) / 1e9
            row.update(t.as_dict(), gbps=gbps, copy_gbps=copies[nbytes], pct_copy=100 * gbps / copies[nbytes])
        rows.append(row)

    tails_done = set()
    for d_out, d_in in shapes:
        for i, r in enumerate(ranks):
            W, A, B, s, m = _inputs(d_out, d_in, r, "bfloat16", device)
            W[:: max(1, d_out // 3)] = 0.0  # a few zero rows: the mask is checked too
            key = {"d_out": d_out, "d_in": d_in, "dtype": str(W.dtype).removeprefix("torch.")}
            if i == 0:  # the row sums depend on W alone
                for tiles in sumsq_grid:
                    cfg = dataclasses.replace(base_cfg, row_sumsq_tiles=tiles)
                    ok, ratio = _check_row_sumsq(W, *row_sumsq(W, config=cfg))
                    rec("row_sumsq", tiles, RowSumsqTiles(), key, lambda: row_sumsq(W, config=cfg), ok, ratio,
                        row_sumsq_bytes(d_out, d_in, W.element_size()))
                log(f"tiles: row_sumsq {d_out}x{d_in} done")
            if (d_out, r) in tails_done:  # the tail's work depends on d_out and r only
                continue
            tails_done.add((d_out, r))
            s32, two_s, s_sq = scale_constants(s)
            base_sq, zero = row_sumsq(W, config=base_cfg)
            prod = _products(W, A, chunk_columns(d_out, d_in, None), base_cfg)
            C = guard_constants(two_s, s_sq, W, r, prod.pieces)
            inv = prod.inv if C.inv_runtime else None
            ref, ref_err = row_norm_ref64(W, A, B, s), row_norm_ref64_error_bound(W, A, B, s)
            for tiles in tail_grid:
                cfg = dataclasses.replace(base_cfg, norm_tail_tiles=tiles)

                def call(cfg=cfg):
                    return norm_tail(prod.U, B, prod.G, base_sq, two_s, s_sq, m=m, eps=default_eps(m.dtype), guard=C,
                                     rel_max=CANCELLATION_REL, zero_rows=zero, recompute=(W, A, s32), inv=inv,
                                     config=cfg)

                res = call()
                ok, ratio = _check_tail(res, ref, ref_err)
                rec("norm_tail", tiles, NormTailTiles(), {**key, "rank": r}, call, ok, ratio,
                    norm_tail_bytes(d_out, r, B.element_size(), m_itemsize=m.element_size(), block_m=tiles.block_m),
                    rows_fired=int((res.rel > CANCELLATION_REL).sum()))
            log(f"tiles: norm_tail {d_out} r={r} done")
            del prod, ref, ref_err
        del W, A, B, m
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows
