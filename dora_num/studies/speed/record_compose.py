"""The GPU suite's ``compose`` and ``tiles`` sections (notebook 05): the compose kernels
against eager PyTorch and ``torch.compile``, timed only after their checks pass.

``compose``: forward (inference), backward and training (forward writing inner +
backward) for eager, ``torch.compile(dynamic=False)`` and the fused kernels, over
tokens x d_out and bf16/fp16/fp32.  The fused outputs are checked bitwise against
the eager reference (dg against fp64 within its bound) before they are timed; a
failed check is recorded and the configuration not timed.

``tiles``: a small tile sweep of the fused compose kernels at 8192x8192 bf16 (the
evidence behind ``ComposeTiles``; the norm kernels' rows of the same section:
:func:`dora_num.studies.speed.record_norm.norm_tile_sweep`).
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch

from ...ops import reference as ref
from ...ops.compose import ComposeFunction
from ...ops.config import get_config, override
from ...ops.kernels import compose as kc
from ...oracles import dg_ref64
from .. import inputs
from ..inputs import suite_compose_torch
from ..bench import bitwise_equal, compose_bytes, lift_recompile_limits, log, max_rel_err, time_ms, write_csv

SEED = inputs.SUITE_SEED
SCALE = inputs.SUITE_COMPOSE_SCALE
DEFAULT_TOKENS = (512, 2048, 8192, 16384)
DEFAULT_DOUT = (512, 4096, 8192, 28672)


def autograd_expr(base, lora, g, s):
    """The reference expression in plain torch ops (what eager autograd and torch.compile see)."""
    return ((g - 1.0) * base.float() + g * (s * lora.float())).to(base.dtype)


# Gate for the baselines (eager autograd, torch.compile), which need not follow the
# contract's operation order: a correct fp32-op implementation differs from the
# reference by at most one rounding of the output, so max|err|/max|ref| <= 2u of
# the activation dtype (u = 2^-8 bf16, 2^-11 fp16; 2^-23 fp32 allows a few fp32 roundings).
BASELINE_TOL = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-21}


def bench_compose(tokens_list, dout_list, dtypes, copy_gbps, compile_dtypes_shapes=None, rows=None,
                  checkpoint: Path | None = None) -> list[dict]:
    lift_recompile_limits()
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    s = SCALE
    rows = [] if rows is None else rows
    for dtype in dtypes:
        b = torch.tensor([], dtype=dtype).element_size()
        tol = BASELINE_TOL[str(dtype).removeprefix("torch.")]
        for tokens in tokens_list:
            for d_out in dout_list:
                try:
                    _compose_config(rows, dtype, tokens, d_out, b, tol, s, gen, copy_gbps, compile_dtypes_shapes)
                except Exception as e:  # noqa: BLE001 - record and go on: one GPU run, no retries
                    traceback.print_exc()
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "d_out": d_out,
                                 "op": "error", "impl": repr(e)[:300], "check_ok": False})
                torch.cuda.empty_cache()
                if checkpoint is not None:
                    write_csv(rows, checkpoint)
    return rows


def _compose_config(rows, dtype, tokens, d_out, b, tol, s, gen, copy_gbps, compile_dtypes_shapes):
    do_compile = compile_dtypes_shapes is None or (dtype, tokens, d_out) in compile_dtypes_shapes
    base, lora, g, grad = suite_compose_torch(tokens, d_out, dtype, gen)
    n = base.numel()
    key = {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "d_out": d_out}

    def rec(op, impl, t, ok, err, traffic, **extra):
        nbytes = compose_bytes(traffic, n, b, d_out, bwd_block_m=get_config().compose_tiles.bwd_block_m)
        row = {**key, "op": op, "impl": impl, "check_ok": ok, "err": err, "bytes": nbytes, **extra}
        if t is not None:
            row.update(t.as_dict())
            row["gbps"] = nbytes / (t.ms * 1e-3) / 1e9
            row["pct_copy"] = 100 * row["gbps"] / copy_gbps
        rows.append(row)

    # ---- forward (inference) ----
    out_ref = ref.compose_stable_ref(base, lora, g, s)
    out_f, _ = kc.compose_fwd(base, lora, g, s)
    ok = bitwise_equal(out_f, out_ref)
    rec("fwd", "eager", time_ms(lambda: ref.compose_stable_ref(base, lora, g, s)), True, 0.0, "fwd")
    rec("fwd", "fused", time_ms(lambda: kc.compose_fwd(base, lora, g, s)) if ok else None, ok,
        max_rel_err(out_f, out_ref), "fwd", bitwise=ok)
    if do_compile:
        # the reference's expression in plain torch ops (ref.compose_stable_ref's
        # TorchFP32.const makes a graph break under dynamo)
        cf = torch.compile(lambda b_, l_, g_: autograd_expr(b_, l_, g_, s), dynamic=False)
        with torch.no_grad():
            out_c = cf(base, lora, g)
        okc = bitwise_equal(out_c, out_ref)
        errc = max_rel_err(out_c, out_ref)
        with torch.no_grad():
            tc = time_ms(lambda: cf(base, lora, g)) if errc <= tol else None
        rec("fwd", "compile", tc, errc <= tol, errc, "fwd", bitwise=okc)
    del out_f
    # ---- fused training forward (writes inner) ----
    out_t, inner_f = kc.compose_fwd(base, lora, g, s, write_inner=True)
    inner_ref = ref.compose_inner_ref(base, lora, s)
    ok_inner = bitwise_equal(out_t, out_ref) and bitwise_equal(inner_f, inner_ref)
    rec("fwd_inner", "fused", time_ms(lambda: kc.compose_fwd(base, lora, g, s, write_inner=True))
        if ok_inner else None, ok_inner, 0.0, "fwd_inner", bitwise=ok_inner)
    del out_t
    # ---- backward: dlora/dbase bitwise, dg within bound of fp64 ----
    dl_r, db_r, dg_r = ref.compose_backward_ref(grad, inner_ref, g, s)
    dl_f, db_f, dg_f = kc.compose_bwd(grad, inner_f, g, s)
    dg64 = dg_ref64(inner_ref, grad, max_elems=1 << 27)
    bound = kc.dg_error_bound(inner_ref, grad)
    dg_err = (dg_f.double() - dg64).abs()
    dg_eager_err = (dg_r.double() - dg64).abs()
    ok_b = bitwise_equal(dl_f, dl_r) and bitwise_equal(db_f, db_r) and bool((dg_err <= bound).all())
    dg_rel = float(dg_err.norm() / dg64.norm().clamp_min(1e-300))
    dg_rel_eager = float(dg_eager_err.norm() / dg64.norm().clamp_min(1e-300))
    rec("bwd", "fused", time_ms(lambda: kc.compose_bwd(grad, inner_f, g, s)) if ok_b else None, ok_b,
        max(max_rel_err(dl_f, dl_r), max_rel_err(db_f, db_r)), "bwd", bitwise=ok_b,
        dg_rel_err=dg_rel, dg_bound_ratio=float((dg_err / bound.clamp_min(1e-300)).max()))
    rec("bwd", "eager_ref", time_ms(lambda: ref.compose_backward_ref(grad, inner_ref, g, s)), True, 0.0,
        "bwd", dg_rel_err=dg_rel_eager)
    dl_x, db_x, dg_x = kc.compose_bwd(grad, None, g, s, base=base, lora=lora)
    ok_x = (bitwise_equal(dl_x, dl_r) and bitwise_equal(db_x, db_r) and bitwise_equal(dg_x, dg_f))
    rec("bwd_recompute", "fused", time_ms(lambda: kc.compose_bwd(grad, None, g, s, base=base, lora=lora))
        if ok_x else None, ok_x, 0.0, "bwd_recompute", bitwise=ok_x, dg_rel_err=dg_rel)
    del dl_x, db_x, dg_x
    del dl_f, db_f, db_r, inner_f
    # ---- autograd: eager autograd of the expression, our Function (eager / fused), compile ----
    bl = base.detach().requires_grad_(True)
    ll = lora.detach().requires_grad_(True)
    gg = g.detach().requires_grad_(True)
    inputs = (bl, ll, gg)

    def train_of(fwd):
        def step():
            o = fwd(bl, ll, gg)
            return torch.autograd.grad(o, inputs, grad)
        return step

    def bwd_of(fwd):
        o = fwd(bl, ll, gg)
        return lambda: torch.autograd.grad(o, inputs, grad, retain_graph=True)

    def fused_inner(b_, l_, g_):  # the spec's variant: the forward writes inner
        with override(recompute_inner=False):
            return ComposeFunction.apply(b_, l_, g_, s, True)

    impls = {
        "eager_autograd": lambda b_, l_, g_: autograd_expr(b_, l_, g_, s),
        "eager": lambda b_, l_, g_: ComposeFunction.apply(b_, l_, g_, s, False),
        "fused": lambda b_, l_, g_: ComposeFunction.apply(b_, l_, g_, s, True),
        "fused_inner": fused_inner,
    }
    if do_compile:
        impls["compile"] = torch.compile(lambda b_, l_, g_: autograd_expr(b_, l_, g_, s), dynamic=False)
    for name, fwd in impls.items():
        grads = train_of(fwd)()
        o = fwd(bl, ll, gg).detach()
        err_dl = max_rel_err(grads[1], dl_r)
        dg_e = float((grads[2].double() - dg64).norm() / dg64.norm().clamp_min(1e-300))
        ok_t = (bitwise_equal(o, out_ref) if name in ("eager", "fused", "fused_inner")
                else max_rel_err(o, out_ref) <= tol)
        rec("train", name, time_ms(train_of(fwd)) if ok_t else None, ok_t, err_dl, "train",
            dg_rel_err=dg_e, bitwise=bitwise_equal(o, out_ref))
        rec("bwd_autograd", name, time_ms(bwd_of(fwd)) if ok_t else None, ok_t, err_dl,
            "bwd_recompute" if name == "fused" else "bwd")
        del grads, o
    del base, lora, grad, bl, ll, gg, inner_ref, out_ref, impls, dl_r
    log(f"compose {key} done")


def tile_sweep(copy_gbps) -> list[dict]:
    """A few tile shapes of the fused kernels at 8192x8192 bf16 (the constants' evidence)."""
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    base, lora, g, grad = suite_compose_torch(8192, 8192, torch.bfloat16, gen)
    _, inner = kc.compose_fwd(base, lora, g, SCALE, write_inner=True)
    default = get_config().compose_tiles
    rows = []
    n = base.numel()
    for tile in (2048, 4096, 8192, 16384):
        for warps in (4, 8):
            with override(compose_tiles=dataclasses.replace(default, fwd_tile_elems=tile, fwd_num_warps=warps)):
                t = time_ms(lambda: kc.compose_fwd(base, lora, g, SCALE))
            nb = compose_bytes("fwd", n, 2, 8192)
            rows.append({"kernel": "fwd", "tile_elems": tile, "num_warps": warps, **t.as_dict(),
                         "pct_copy": 100 * nb / (t.ms * 1e-3) / 1e9 / copy_gbps})
    for mode in ("inner", "recompute"):
        for bm in (32, 64, 128):
            for bn in (64, 128, 256):
                for warps in (4, 8):
                    tiles = dataclasses.replace(default, bwd_block_m=bm, bwd_max_block_n=bn, bwd_num_warps=warps)
                    with override(compose_tiles=tiles):
                        if mode == "inner":
                            t = time_ms(lambda: kc.compose_bwd(grad, inner, g, SCALE))
                        else:
                            t = time_ms(lambda: kc.compose_bwd(grad, None, g, SCALE, base=base, lora=lora))
                    kind = "bwd" if mode == "inner" else "bwd_recompute"
                    nb = compose_bytes(kind, n, 2, 8192, bwd_block_m=bm)
                    rows.append({"kernel": kind, "block_m": bm, "block_n": bn, "num_warps": warps,
                                 **t.as_dict(), "pct_copy": 100 * nb / (t.ms * 1e-3) / 1e9 / copy_gbps})
    return rows
