"""The GPU suite's ``norm`` section (notebook 05): row-norm time, peak extra memory and
error against fp64 for the PEFT-style dense norm in the weight dtype, the dense fp32
norm, and the factored norm without and with the cached ``base_sq`` (the paper's
Table 1 shapes), plus the cached norm on its torch tail (the same-run A/B of the
tail kernel)."""

from __future__ import annotations

import math

import torch

from ...ops.norm import base_row_norm_sq, dense_row_norm, factored_row_norm
from ...oracles import row_norm_ref64
from .. import inputs
from ..bench import host_path, log, max_rel_err, peak_extra_bytes, time_ms

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
