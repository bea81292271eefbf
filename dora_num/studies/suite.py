"""``dora-num gpu-suite --out DIR``: every GPU measurement of the project, one process.

Sections (each writes a tidy CSV under DIR; ``device.json`` holds the device,
versions, git sha and the copy bandwidth every percentage is taken against):

- ``copy``: device-to-device copy bandwidth (bytes read + written).
- ``tiles``: a small tile sweep of the fused compose kernels at 8192x8192 bf16.
- ``compose``: compose forward (inference), backward and training (forward
  writing inner + backward) for eager, ``torch.compile(dynamic=False)`` and the
  fused kernels, over tokens x d_out and bf16/fp16/fp32.  The fused outputs are
  checked bitwise against the eager reference (dg against fp64 within its bound)
  before they are timed; a failed check is recorded and the config not timed.
- ``norm``: row-norm time, peak extra memory and error vs fp64 for the PEFT-style
  dense norm in the weight dtype, the dense fp32 norm, and the factored norm
  without and with the cached ``base_sq`` (the paper's Table 1 shapes).
- ``layer``: ``DoRALinear`` vs PEFT's DoRA layer (default settings: fp32 adapters;
  and bf16 adapters), forward and forward+backward time and peak memory.
- ``fma``: norm-assembly variants (contraction on/off x tl.sqrt / tl.sqrt_rn /
  PTX sqrt.rn.f32) and compose variants (contraction on/off): bitwise agreement
  with the torch reference, ULP histograms, PTX instruction counts, and a seeded
  sample (``fma_sqrt_sample.npz``) for bit-for-bit CPU emulation (issue 6).

:func:`ingest` copies a suite folder into ``data/gpu/`` through the provenance
helper, with the GPU's device description from ``device.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from ..ops.config import get_config, override

DEFAULT_TOKENS = (512, 2048, 8192, 16384)
DEFAULT_DOUT = (512, 4096, 8192, 28672)
TARGET_SHAPES = ((8192, 8192), (16384, 8192))
NORM_SHAPES = ((4096, 4096, 384), (8192, 8192, 384), (8192, 8192, 512), (8192, 28672, 384))
LAYER_SHAPES = ((4096, 4096, 384, 4096), (8192, 8192, 384, 2048), (8192, 8192, 512, 2048))
SEED = 20261129
SCALE = 0.5  # compose benchmarks (speed does not depend on it)
# FMA/sqrt study: rsLoRA alpha=192, r=384 (the paper's configuration).  Not a power
# of two, so 2s*cross and s^2*ba are inexact and contraction can change results
# (with s = 0.5 both products are exact and an FMA cannot differ from mul+add).
FMA_SCALE = 192 / math.sqrt(384)


def _log(msg: str) -> None:
    print(f"[gpu-suite {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_csv(rows: list[dict], path: Path) -> None:
    import pandas as pd

    pd.DataFrame(rows).to_csv(path, index=False, lineterminator="\n")
    _log(f"wrote {path.name} ({len(rows)} rows)")


# --------------------------------------------------------------------------
# device
# --------------------------------------------------------------------------

def device_description(git_sha: str | None) -> dict:
    import torch
    import triton

    from ..repro.provenance import device_info, versions

    info = device_info()
    p = torch.cuda.get_device_properties(0)
    info.update(sm_count=p.multi_processor_count, total_memory=p.total_memory)
    return {"device": info, "versions": {**versions(), "triton_runtime": triton.__version__,
                                         "torch_cuda": torch.version.cuda},
            "git_sha": git_sha, "python": platform.python_version(), "argv": sys.argv,
            "dg_final_in_kernel": get_config().dg_stage2_in_kernel}


# --------------------------------------------------------------------------
# compose
# --------------------------------------------------------------------------

def _compose_inputs(tokens, d_out, dtype, gen):
    import torch

    base = torch.randn(tokens, d_out, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
    lora = torch.randn(tokens, d_out, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
    g = 1.0 + 1e-3 * torch.randn(d_out, device="cuda", dtype=torch.float32, generator=gen)
    grad = torch.randn(tokens, d_out, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
    return base, lora, g, grad


def _autograd_expr(base, lora, g, s):
    """The reference expression in plain torch ops (what eager autograd and torch.compile see)."""
    return ((g - 1.0) * base.float() + g * (s * lora.float())).to(base.dtype)


def _dg_ref64(inner, grad):
    import torch

    d = torch.zeros(grad.shape[-1], dtype=torch.float64, device=grad.device)
    step = max(1, (1 << 27) // grad.shape[-1])
    for i in range(0, grad.shape[0], step):
        d += (inner[i:i + step].double() * grad[i:i + step].double()).sum(0)
    return d


# Gate for the baselines (eager autograd, torch.compile), which need not follow the
# contract's operation order: a correct fp32-op implementation differs from the
# reference by at most one rounding of the output, so max|err|/max|ref| <= 2u of
# the activation dtype (u = 2^-8 bf16, 2^-11 fp16; 2^-23 fp32 allows a few fp32 roundings).
BASELINE_TOL = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-21}


def bench_compose(tokens_list, dout_list, dtypes, copy_gbps, compile_dtypes_shapes=None, rows=None,
                  checkpoint: Path | None = None) -> list[dict]:
    import torch

    torch._dynamo.config.cache_size_limit = 4096
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 4096
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 1 << 16
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
                    import traceback

                    traceback.print_exc()
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "d_out": d_out,
                                 "op": "error", "impl": repr(e)[:300], "check_ok": False})
                torch.cuda.empty_cache()
                if checkpoint is not None:
                    _write_csv(rows, checkpoint)
    return rows


def _compose_config(rows, dtype, tokens, d_out, b, tol, s, gen, copy_gbps, compile_dtypes_shapes):
    import torch

    from ..ops import reference as ref
    from ..ops.compose import ComposeFunction
    from ..ops.kernels import compose as kc
    from .bench import bitwise_equal, compose_bytes, max_rel_err, time_ms

    do_compile = compile_dtypes_shapes is None or (dtype, tokens, d_out) in compile_dtypes_shapes
    base, lora, g, grad = _compose_inputs(tokens, d_out, dtype, gen)
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
        cf = torch.compile(lambda b_, l_, g_: _autograd_expr(b_, l_, g_, s), dynamic=False)
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
    dg64 = _dg_ref64(inner_ref, grad)
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
        "eager_autograd": lambda b_, l_, g_: _autograd_expr(b_, l_, g_, s),
        "eager": lambda b_, l_, g_: ComposeFunction.apply(b_, l_, g_, s, False),
        "fused": lambda b_, l_, g_: ComposeFunction.apply(b_, l_, g_, s, True),
        "fused_inner": fused_inner,
    }
    if do_compile:
        impls["compile"] = torch.compile(lambda b_, l_, g_: _autograd_expr(b_, l_, g_, s), dynamic=False)
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
    _log(f"compose {key} done")


def tile_sweep(copy_gbps) -> list[dict]:
    """A few tile shapes of the fused kernels at 8192x8192 bf16 (the constants' evidence)."""
    import torch

    from ..ops.kernels import compose as kc
    from .bench import compose_bytes, time_ms

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    base, lora, g, grad = _compose_inputs(8192, 8192, torch.bfloat16, gen)
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


# --------------------------------------------------------------------------
# norms
# --------------------------------------------------------------------------

def _peft_style_norm(W, A, B, s):
    """PEFT's DoRA weight norm: ``||W + s*(B@A)||_row`` in the weight dtype (no fp32)."""
    import torch

    with torch.no_grad():
        return torch.linalg.norm(W + s * (B @ A), dim=1).to(W.dtype)


def _torch_tail_norm(W, A, B, s, base_sq):
    """The cached factored norm with the torch tail: the same-run A/B of the tail kernel."""
    from ..ops.norm import factored_row_norm
    from .bench import host_path

    with host_path("torch"):
        return factored_row_norm(W, A, B, s, base_sq=base_sq)


def bench_norms(shapes, w_dtypes) -> list[dict]:
    import torch

    from ..ops.norm import base_row_norm_sq, dense_row_norm, factored_row_norm
    from .bench import max_rel_err, peak_extra_bytes, time_ms

    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    rows = []
    for d_out, d_in, r in shapes:
        for wd in w_dtypes:
            W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).to(wd)
            A = (torch.randn(r, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).to(wd)
            B = (1e-2 * torch.randn(d_out, r, device="cuda", generator=gen) / math.sqrt(r)).to(wd)
            s = 192 / math.sqrt(r)
            ref = torch.linalg.vector_norm(W.double() + s * (B.double() @ A.double()), dim=1)
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
            _log(f"norm {d_out}x{d_in} r={r} {wd} done")
    return rows


# --------------------------------------------------------------------------
# layer vs PEFT
# --------------------------------------------------------------------------

def _peft_layer(lin, r, alpha, autocast_adapter_dtype):
    import torch
    from peft import LoraConfig, get_peft_model

    class Holder(torch.nn.Module):
        def __init__(self, proj):
            super().__init__()
            self.proj = proj

        def forward(self, x):
            return self.proj(x)

    cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=True, use_dora=True, target_modules=["proj"],
                     lora_dropout=0.0)
    return get_peft_model(Holder(lin), cfg, autocast_adapter_dtype=autocast_adapter_dtype)


def _PreviousHostPath(layer):
    """``layer`` on its previous host path: the norm's torch tail, the output add separate."""
    import torch

    class PreviousHostPath(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            from .bench import host_path

            with host_path("torch", fold=False):
                return self.inner(x)

    return PreviousHostPath(layer)


# Rounds of the layer timings (interleaved across implementations).  DoRALinear's
# forward+backward is bound by the host at these shapes (1.8 ms per step against 0.71 ms
# of GPU work at 4096->4096 on the H200, git 6f3caa2), the host's speed varies ~2x between
# machine sessions, and single-shot ratios against PEFT moved between 1.4x and 2.3x
# across runs of the same code: hence rounds, and the previous host path in each.
LAYER_ROUNDS = 5


def bench_layers(shapes, profile_to: Path | None = None) -> list[dict]:
    import copy

    import torch

    from ..ops.layer import DoRALinear
    from .bench import max_rel_err, peak_extra_bytes, time_ms

    gen = torch.Generator(device="cuda").manual_seed(SEED + 2)
    rows = []
    dt = torch.bfloat16
    for d_in, d_out, r, tokens in shapes:
        alpha = 192.0
        lin = torch.nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=dt)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(d_out, d_in, device="cuda", generator=gen) / math.sqrt(d_in))
        ours = DoRALinear(copy.deepcopy(lin), r, alpha, use_rslora=True)
        with torch.no_grad():
            # ||sBA|| ~ 5% of ||W|| per row (realistic); N(0, 1e-2) gave 1.1 ||W||, where the factored
            # norm's cancellation guard cannot certify rank 384 and recomputes every row (ops/guard.py)
            ours.lora_B.copy_((5e-4 * torch.randn(d_out, r, device="cuda", generator=gen)).to(dt))
            ours.magnitude.copy_(ours.weight_norm() * (1 + 1e-3 * torch.randn(d_out, device="cuda", generator=gen)))
        x = torch.randn(tokens, d_in, device="cuda", generator=gen).to(dt)
        D = torch.randn(tokens, d_out, device="cuda", generator=gen).to(dt)
        # fp64 reference of the layer output
        W64, A64, B64 = lin.weight.double(), ours.lora_A.double(), ours.lora_B.double()
        s = ours.scale
        wn = torch.linalg.vector_norm(W64 + s * B64 @ A64, dim=1)
        g64 = ours.magnitude.double() / wn
        x64 = x.double()
        y_ref = x64 @ W64.T + (g64 - 1) * (x64 @ W64.T) + g64 * s * (x64 @ A64.T @ B64.T)
        del W64, A64, B64, wn, x64
        # the same layer on its previous host path (the norm's torch tail, the output add as a
        # separate op), timed in the same rounds: the A/B of this path's two changes
        layers = {"dora_num": ours, "dora_num_prev_host_path": _PreviousHostPath(copy.deepcopy(ours))}
        for name, autocast in (("peft_default", True), ("peft_bf16_adapters", False)):
            pm = _peft_layer(copy.deepcopy(lin), r, alpha, autocast)
            mod = pm.base_model.model.proj
            with torch.no_grad():
                mod.lora_A["default"].weight.copy_(ours.lora_A)
                mod.lora_B["default"].weight.copy_(ours.lora_B)
                mod.lora_magnitude_vector["default"].weight.copy_(ours.magnitude)
            layers[name] = pm
        prepared = {}
        for name, layer in layers.items():
            xr = x.detach().requires_grad_(True)

            def fwd_inf(layer=layer):
                with torch.no_grad():
                    return layer(x)

            def fwd_bwd(layer=layer, xr=xr):
                y = layer(xr)
                y.backward(D)
                return y

            peak_f, y = peak_extra_bytes(fwd_inf)
            err = max_rel_err(y.double(), y_ref)
            del y
            layer.zero_grad(set_to_none=True)
            peak_fb, y = peak_extra_bytes(fwd_bwd)
            del y
            layer.zero_grad(set_to_none=True)
            xr.grad = None
            prepared[name] = (fwd_inf, fwd_bwd, layer, xr, err, peak_f, peak_fb)
            if profile_to is not None and (d_in, d_out, r, tokens) == tuple(shapes[0]):
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        fwd_bwd()
                    torch.cuda.synchronize()
                with open(profile_to, "a") as fh:
                    fh.write(f"== {name} {d_in}->{d_out} r={r} T={tokens}: 3 x forward+backward ==\n")
                    fh.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n")
                layer.zero_grad(set_to_none=True)
                xr.grad = None
        # Timing: LAYER_ROUNDS rounds, the implementations interleaved in each, so a
        # drift of the host's speed within the run hits all of them alike; each
        # configuration reports its median round (and every round's median).
        rounds = {name: {"fwd": [], "fwd_bwd": []} for name in prepared}
        for _ in range(LAYER_ROUNDS):
            for name, (fwd_inf, fwd_bwd, layer, xr, *_) in prepared.items():
                rounds[name]["fwd"].append(time_ms(fwd_inf))
                rounds[name]["fwd_bwd"].append(time_ms(fwd_bwd))
                layer.zero_grad(set_to_none=True)
                xr.grad = None
        for name, (*_, err, peak_f, peak_fb) in prepared.items():
            base = {"impl": name, "d_in": d_in, "d_out": d_out, "rank": r, "tokens": tokens,
                    "rel_err_fp64": err}
            for mode, peak in (("fwd", peak_f), ("fwd_bwd", peak_fb)):
                ts = sorted(rounds[name][mode], key=lambda t: t.ms)
                rows.append({**base, "mode": mode, "peak_extra_bytes": peak, **ts[len(ts) // 2].as_dict(),
                             "rounds_ms": ";".join(f"{t.ms:.4f}" for t in rounds[name][mode])})
        del layers, ours, lin, x, D, y_ref, prepared
        torch.cuda.empty_cache()
        _log(f"layer {d_in}->{d_out} r={r} T={tokens} done")
    return rows


# --------------------------------------------------------------------------
# FMA / sqrt variants (issue 6)
# --------------------------------------------------------------------------

def fma_inputs(n: int, seed: int = SEED, scale: float = FMA_SCALE):
    """Seeded norm-assembly inputs (numpy PCG64: the CPU can regenerate them bit for bit).

    Realistic rows (``||sBA|| << ||W||``: cross and ba small against base_sq), and
    one in eight rows adversarial (the cross term cancels most of base_sq).
    """
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    base_sq = np.exp(rng.normal(0.0, 1.0, n)) * 100.0
    cross = base_sq * rng.normal(0.0, 1e-2, n)
    ba = base_sq * np.abs(rng.normal(0.0, 1.0, n)) * 1e-4
    adv = rng.random(n) < 0.125
    two_s = 2 * scale
    cross[adv] = -(base_sq[adv] / two_s) * (1.0 - 10.0 ** rng.uniform(-6, -1, int(adv.sum())))
    return base_sq.astype(np.float32), cross.astype(np.float32), ba.astype(np.float32)


def compose_fma_inputs(rows: int, cols: int, seed: int = SEED + 3):
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    base = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    lora = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    g = (1.0 + 1e-3 * rng.normal(0, 1, cols)).astype(np.float32)
    return base, lora, g


def _diff_record(save: dict, name: str, out, ref_out, sample: int) -> None:
    """Store where ``out`` differs from ``ref_out`` in its first ``sample`` elements:
    flat indices (int32) and the variant's bit patterns (so a CPU emulation can be
    compared bit for bit without storing every output)."""
    import numpy as np

    import torch

    bits = {2: np.uint16, 4: np.uint32}[out.element_size()]
    ints = {2: torch.int16, 4: torch.int32}[out.element_size()]
    o = out.reshape(-1)[:sample].contiguous().view(ints).cpu().numpy().view(bits)
    r = ref_out.reshape(-1)[:sample].contiguous().view(ints).cpu().numpy().view(bits)
    idx = np.nonzero(o != r)[0].astype(np.int32)
    save[f"{name}__idx"] = idx
    save[f"{name}__bits"] = o[idx]


def bench_fma(out_dir: Path, n: int = 1 << 22, sample: int = 1 << 18) -> list[dict]:
    """Variants vs the torch reference on ``n`` seeded inputs; ``fma_sqrt_sample.npz``
    holds, for the first ``sample`` inputs, where each variant differs (indices +
    bits) and the sha256 of the reference's bytes.  The inputs are regenerated bit
    for bit on any machine by :func:`fma_inputs` / :func:`compose_fma_inputs`; the
    first 2^16 are stored as well, for a self-contained spot check.  ``sample`` is
    2^18: the file is ~2.4 MB (2^20 made 5.4 MB, a third of the repo's data budget);
    the agreement rates in the CSV are over all ``n``."""
    import hashlib

    import numpy as np
    import torch

    from ..numerics.arithmetic import TorchFP32
    from ..numerics.formulas import norm_assembly, scale_constants
    from ..ops import reference as ref
    from ..ops.kernels import compose as kc
    from ..ops.kernels.norm_assembly import SQRT_VARIANTS, norm_assembly_triton, ptx_instruction_counts
    from .bench import bitwise_agreement, ulp_histogram

    s, two_s, s_sq = scale_constants(FMA_SCALE)
    spot = min(sample, 1 << 16)
    b_np, c_np, a_np = fma_inputs(n)
    b, c, a = (torch.from_numpy(v).cuda() for v in (b_np, c_np, a_np))
    ref_out = norm_assembly(TorchFP32, b, c, a, two_s, s_sq)  # torch.sqrt on CUDA: correctly rounded
    rows = []
    save = {"meta_norm_seed": np.int64(SEED), "meta_norm_n": np.int64(n), "meta_sample": np.int64(sample),
            "meta_scale": np.float32(s),
            "norm_base_sq": b_np[:spot], "norm_cross": c_np[:spot], "norm_ba": a_np[:spot],
            "norm_ref_spot": ref_out[:spot].cpu().numpy(),
            "norm_ref_sha256": np.bytes_(hashlib.sha256(ref_out[:sample].cpu().numpy().tobytes()).hexdigest())}
    for fusion in (False, True):
        for sq in SQRT_VARIANTS:
            out, kern = norm_assembly_triton(b, c, a, two_s, s_sq, fp_fusion=fusion, sqrt=sq, return_kernel=True)
            name = f"norm_fusion{'On' if fusion else 'Off'}_{sq}"
            rows.append({"op": "norm_assembly", "variant": name, "fp_fusion": fusion, "sqrt": sq, "n": n,
                         "agreement": bitwise_agreement(out, ref_out), "production": (not fusion and sq == "rn"),
                         **{f"ulp_{k}": v for k, v in ulp_histogram(out, ref_out).items()},
                         **{f"ptx_{k}": v for k, v in ptx_instruction_counts(kern).items()}})
            _diff_record(save, name, out, ref_out, sample)
    rows_c, cols_c = 2048, 2048  # 4M elements for the rates
    base_np, lora_np, g_np = compose_fma_inputs(rows_c, cols_c)
    save["meta_compose_seed"] = np.int64(SEED + 3)
    save["meta_compose_shape"] = np.array([rows_c, cols_c], dtype=np.int64)
    save["compose_g"] = g_np
    save["compose_base_spot"] = base_np.reshape(-1)[:spot]
    save["compose_lora_spot"] = lora_np.reshape(-1)[:spot]
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.from_numpy(base_np).cuda().to(dtype)
        lora = torch.from_numpy(lora_np).cuda().to(dtype)
        g = torch.from_numpy(g_np).cuda()
        want = ref.compose_stable_ref(base, lora, g, s)
        dn = str(dtype).removeprefix("torch.")
        want_bits = want.reshape(-1)[:sample].contiguous().view({2: torch.int16, 4: torch.int32}[want.element_size()])
        save[f"compose_ref_{dn}_sha256"] = np.bytes_(hashlib.sha256(want_bits.cpu().numpy().tobytes()).hexdigest())
        for fusion in (False, True):
            out, _, kern = kc.compose_fwd(base, lora, g, s, fp_fusion=fusion, return_kernel=True)
            name = f"compose_{dn}_fusion{'On' if fusion else 'Off'}"
            rows.append({"op": "compose", "variant": name, "fp_fusion": fusion, "sqrt": "", "n": out.numel(),
                         "dtype": dn, "agreement": bitwise_agreement(out, want), "production": not fusion,
                         **{f"ulp_{k}": v for k, v in ulp_histogram(out, want).items()},
                         **{f"ptx_{k}": v for k, v in ptx_instruction_counts(kern).items()}})
            _diff_record(save, name, out, want, sample)
    np.savez_compressed(out_dir / "fma_sqrt_sample.npz", **save)
    return rows


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

def run_suite(out: Path, *, sections: tuple[str, ...], smoke: bool = False, git_sha: str | None = None) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu-suite needs a CUDA GPU (this machine has none)")
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    desc = device_description(git_sha)
    from .bench import copy_bandwidth

    copy = copy_bandwidth(256 * 2**20 if smoke else 2 * 2**30)
    desc["copy"] = copy
    desc["smoke"] = smoke
    desc["sections"] = list(sections)
    copy_gbps = copy["gbps"]
    _log(f"copy bandwidth {copy_gbps:.0f} GB/s")
    (out / "device.json").write_text(json.dumps(desc, indent=2, default=str) + "\n")
    import traceback

    def section(name, fn):
        if name not in sections:
            return
        try:
            fn()
        except Exception:  # noqa: BLE001 - one GPU run: record the failure, go on with the rest
            traceback.print_exc()
            desc.setdefault("failed_sections", []).append(name)

    section("fma", lambda: _write_csv(bench_fma(out, n=1 << (16 if smoke else 22), sample=1 << (12 if smoke else 18)),
                                      out / "fma_sqrt.csv"))
    if not smoke:
        section("tiles", lambda: _write_csv(tile_sweep(copy_gbps), out / "tile_sweep.csv"))
    section("norm", lambda: _write_csv(bench_norms(((1024, 1024, 64),) if smoke else NORM_SHAPES,
                                                   (torch.bfloat16, torch.float32)), out / "norm_bench.csv"))
    section("layer", lambda: _write_csv(bench_layers(((1024, 1024, 64, 512),) if smoke else LAYER_SHAPES,
                                                     profile_to=out / "layer_profile.txt"),
                                        out / "layer_bench.csv"))

    def compose_section():
        ck = out / "compose_bench.csv"
        if smoke:
            bench_compose((512,), (512, 4096), (torch.bfloat16,), copy_gbps, checkpoint=ck)
            return
        bench_compose(DEFAULT_TOKENS, DEFAULT_DOUT, (torch.bfloat16, torch.float16, torch.float32), copy_gbps,
                      None, checkpoint=ck)

    section("compose", compose_section)
    desc["wall_s"] = time.time() - t0
    (out / "device.json").write_text(json.dumps(desc, indent=2, default=str) + "\n")
    _log(f"done in {desc['wall_s']:.0f} s")


SECTIONS = ("fma", "tiles", "compose", "norm", "layer")


def ingest(src: Path, dest: Path | None = None, only: tuple[str, ...] | None = None) -> list[Path]:
    """Copy a suite folder's files into ``data/gpu/`` with provenance sidecars.

    The device description and git sha come from the suite's ``device.json``
    (the GPU run), not from this machine.
    """
    from ..repro.paths import data_dir
    from ..repro.provenance import write_artifact

    src = Path(src)
    desc = json.loads((src / "device.json").read_text())
    dest = Path(dest) if dest is not None else data_dir("gpu")
    written = []
    for f in sorted(p for p in src.iterdir() if p.is_file() and (only is None or p.name in only)):
        written.append(write_artifact(
            dest / f.name, f.read_bytes(), device=desc["device"], producer="dora_num.studies.suite",
            params={"sections": desc.get("sections"), "smoke": desc.get("smoke")}, seed=SEED,
            extra={"gpu_git_sha": desc.get("git_sha"), "gpu_versions": desc.get("versions"),
                   "copy_gbps": desc.get("copy", {}).get("gbps")}))
    return written


def _cmd(args) -> int:
    if args.ingest:
        for p in ingest(Path(args.ingest), Path(args.out) if args.out else None):
            print(p)
        return 0
    if not args.out:
        print("gpu-suite: --out DIR is required", file=sys.stderr)
        return 2
    sha = args.git_sha or os.environ.get("DORA_NUM_GIT_SHA")
    if sha is None:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = None
    run_suite(Path(args.out), sections=tuple(args.only or SECTIONS), smoke=args.smoke, git_sha=sha)
    return 0


def register(sub) -> None:
    """Add ``gpu-suite`` to the CLI's subparsers."""
    p = sub.add_parser("gpu-suite", help="all GPU measurements in one process (copy bandwidth, compose, "
                                         "norms, layer vs PEFT, FMA/sqrt variants)")
    p.add_argument("--out", help="output folder for the raw CSV/JSON/NPZ files")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a quick check of the suite itself)")
    p.add_argument("--git-sha", help="git sha of the code (when the GPU copy has no .git)")
    p.add_argument("--ingest", metavar="SUITE_DIR",
                   help="instead of measuring: copy SUITE_DIR into data/gpu/ (or --out) with provenance")
    p.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dora-num gpu-suite")
    sub = ap.add_subparsers(dest="command", required=True)
    register(sub)
    args = ap.parse_args(["gpu-suite", *(argv or [])])
    return args.func(args)
