"""Notebook 02, the paper's failing configuration: an approximate division, an approximate sqrt and FMA
contraction inside one fused DoRA kernel, in a deep stack, measured by the cosine of the final logits.

A study-only kernel (:func:`fused_dora_forward`; production kernels are untouched) forms, per layer, ``w =
sqrt(base_sq + 2s cross + s^2 ba)`` (:func:`~dora_num.ops.kernels.norm_assembly.assemble`), ``g = m / w`` and the
production compose, with three switches and nothing else changing between the :data:`VARIANTS`: the division
(``tl.math.div_rn``, or ``/``: PTX ``div.full.f32``), the sqrt (``tl.sqrt_rn``, or ``tl.sqrt``) and contraction
(``enable_fp_fusion``).  The stack (:func:`make_stack`, :func:`run_stack`) and the float64 reference
(:func:`~dora_num.oracles.dora_linear_ref64`); the cosine deficit's bound ``1 - cos <= eps^2 / (2 - eps^2)``
(:func:`cosine_deficit_bound`).  The design, the prediction written before the GPU measured it, and what the
first H100 run confirmed and refuted: docs/methods.md, "studies/fma/deep_stack.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch.nn import functional as Fn

from ...numerics.formats import ulp_distance
from ...numerics.formulas import scale_constants
from ...ops.config import get_config
from ...ops.kernels.norm_assembly import assemble
from ...ops.layer import DoRALinear
from ...ops.magnitude import default_eps
from ...ops.terms import factored_terms
from ...oracles import dora_linear_ref64

# name: (division, sqrt, contraction) of the study kernel; nothing else differs between them
VARIANTS = {"kernel_rn": ("rn", "rn", False), "div_approx": ("approx", "rn", False),
            "sqrt_approx": ("rn", "approx", False), "fma": ("rn", "rn", True), "paper": ("approx", "approx", True)}
PATHS = ("production", "g_pm2ulp", "peft_bf16", *VARIANTS)
# the kernel variants that approximate something (division, sqrt, contraction): the paper's suspects
APPROX_VARIANTS = tuple(k for k, v in VARIANTS.items() if v != ("rn", "rn", False))
RMS_EPS = 1e-6


@triton.jit
def _round(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype``; ``RNE_BF16``: to bf16 by integer round-to-nearest-even (finite ``x``),
    which is what the GPU's conversion does and the interpreter's truncating one does not (docs/platform.md)."""
    if RNE_BF16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + (((b >> 16) & 1) + 0x7FFF)) & -65536  # -65536: the mask 0xFFFF0000 as an int32
        x = b.to(tl.float32, bitcast=True)  # a bf16 value now: the cast below is exact
    return x.to(dtype)


@triton.jit
def _fused_dora_fwd_kernel(base_ptr, lora_ptr, bsq_ptr, cross_ptr, ba_ptr, m_ptr, out_ptr, g_ptr, n_rows, n_cols,
                           s, two_s, s_sq, eps, DIV_RN: tl.constexpr, SQRT: tl.constexpr, WRITE_G: tl.constexpr,
                           RNE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    bsq = tl.load(bsq_ptr + cols, mask=col_mask, other=1.0)
    cross = tl.load(cross_ptr + cols, mask=col_mask, other=0.0)
    ba = tl.load(ba_ptr + cols, mask=col_mask, other=0.0)
    m = tl.load(m_ptr + cols, mask=col_mask, other=1.0)
    w = assemble(bsq, cross, ba, two_s, s_sq, SQRT)  # SQRT 0: tl.sqrt (approx), 1: tl.sqrt_rn
    den = tl.where(w == 0.0, eps, w)
    if DIV_RN:
        g = tl.math.div_rn(m, den)
    else:
        g = m / den  # fp32 "/": PTX div.full.f32 on CUDA
    if WRITE_G:
        if pid_m == 0:
            tl.store(g_ptr + cols, g, mask=col_mask)
    base = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    lora = tl.load(lora_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # the production compose (ops/kernels/compose.py, ADD_BASE): delta rounded, then base + delta rounded
    gm1 = g - 1.0
    sl = s * lora
    t = g[None, :] * sl
    prod = gm1[None, :] * base
    out = _round(prod + t, out_ptr.dtype.element_ty, RNE_BF16)
    out = _round(base + out.to(tl.float32), out_ptr.dtype.element_ty, RNE_BF16)
    tl.store(out_ptr + offsets, out, mask=mask)


def fused_dora_forward(base: torch.Tensor, lora: torch.Tensor, terms: tuple, m: torch.Tensor, scale: float,
                       variant: str, *, return_kernel: bool = False):
    """``(y, g)`` of one layer by the study kernel: ``base`` and ``lora`` ``[T, N]`` (bf16 or fp32),
    ``terms`` the fp32 ``(base_sq, cross, ba)`` ``[N]`` of the factored norm, ``m`` fp32 ``[N]``; ``y`` in
    ``base``'s dtype, ``g`` fp32.  ``variant``: a key of :data:`VARIANTS`.  Under the interpreter the bf16
    roundings are done by integer arithmetic (:func:`_round`), so that ``y`` is the GPU's bit for bit."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if base.dim() != 2 or lora.shape != base.shape or lora.dtype != base.dtype or lora.device != base.device \
            or base.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"base and lora must be [T, N] bf16 or fp32, of one dtype and device, got "
                         f"{tuple(base.shape)} {base.dtype} and {tuple(lora.shape)} {lora.dtype}")
    n = base.shape[1]
    for name, t in zip(("base_sq", "cross", "ba", "m"), (*terms, m)):
        if t.dtype != torch.float32 or tuple(t.shape) != (n,) or t.device != base.device:
            raise ValueError(f"{name} must be float32 [{n}] on {base.device}, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    div, sqrt, fusion = VARIANTS[variant]
    s, two_s, s_sq = scale_constants(scale)
    base, lora = base.contiguous(), lora.contiguous()
    out = torch.empty_like(base)
    g = torch.empty(n, dtype=torch.float32, device=base.device)
    big = get_config().interpret  # the interpreter pays per program
    bm = min(64, triton.next_power_of_2(max(base.shape[0], 1))) if big else 32
    bn = min(512, triton.next_power_of_2(n)) if big else 128
    kern = _fused_dora_fwd_kernel[(triton.cdiv(base.shape[0], bm), triton.cdiv(n, bn))](
        base, lora, *(t.contiguous() for t in terms), m.contiguous(), out, g, base.shape[0], n, s, two_s, s_sq,
        default_eps(torch.float32), DIV_RN=div == "rn", SQRT=int(sqrt == "rn"), WRITE_G=True,
        RNE_BF16=big and base.dtype == torch.bfloat16, BLOCK_M=bm,
        BLOCK_N=bn, num_warps=4, enable_fp_fusion=fusion)
    return (out, g, kern) if return_kernel else (out, g)


def ptx_counts(kernel) -> dict[str, int]:
    """The instructions the variants switch, counted in a compiled kernel's PTX (empty under the interpreter)."""
    ptx = kernel.asm.get("ptx", "") if kernel is not None and hasattr(kernel, "asm") else ""
    return {k.replace(".", "_"): ptx.count(k) for k in ("div.full.f32", "div.rn.f32", "sqrt.approx", "sqrt.rn",
                                                         "fma.rn.f32")}


# --------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class StackShape:
    layers: int = 48
    hidden: int = 2048
    rank: int = 16
    vocab: int = 8192
    tokens: int = 256
    alpha: float = 32.0
    depths: tuple = (32, 48)  # where the logits are read
    update_ratio: float = 0.02  # |s (BA)_j| / |W_j|, about
    g_std: float = 0.0015  # the paper's adapter: g - 1 has this spread
    one_every: int = 8  # rows j with j % one_every == 0 sit exactly at g = 1


FULL = StackShape()
SMOKE = StackShape(layers=4, hidden=64, rank=4, vocab=128, tokens=8, alpha=8.0, depths=(2, 4))


@dataclass
class Stack:
    shape: StackShape
    layers: list  # DoRALinear per block (bf16 W, A, B; fp32 m)
    norm_w: list  # bf16 [hidden] per block, and the final one last
    Wv: torch.Tensor  # bf16 [vocab, hidden]
    x0: torch.Tensor  # bf16 [tokens, hidden]

    @property
    def scale(self) -> float:
        return self.layers[0].scale


def make_stack(shape: StackShape, seed: int, device) -> Stack:
    """Seeded parameters on ``device``: ``W ~ N(0, 1/d)``, ``A ~ N(0, 1/d)``, ``B`` scaled to
    ``shape.update_ratio``, all rounded to bf16; ``m`` fp32 with ``g - 1 ~ N(0, g_std^2)`` against the float64
    norm, and ``m`` = the production norm on every ``one_every``-th row (``g == 1`` exactly there)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    d, r = shape.hidden, shape.rank

    def randn(*size, std):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * std).bfloat16()

    layers, norm_w = [], []
    for _ in range(shape.layers):
        lin = torch.nn.Linear(d, d, bias=False, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(randn(d, d, std=1 / math.sqrt(d)))
        s = shape.alpha / r
        A, B = randn(r, d, std=1 / math.sqrt(d)), randn(d, r, std=shape.update_ratio / (s * math.sqrt(r)))
        w64 = torch.linalg.vector_norm(lin.weight.double() + scale_constants(s)[0] * (B.double() @ A.double()), dim=1)
        z = torch.randn(d, generator=gen, device=device, dtype=torch.float64)
        layer = DoRALinear(lin, r, shape.alpha, lora_A=A, lora_B=B, magnitude=(w64 * (1 + shape.g_std * z)).float())
        with torch.no_grad():
            ones = torch.arange(0, d, shape.one_every, device=device)
            layer.magnitude[ones] = layer.weight_norm()[ones]
        layers.append(layer)
        norm_w.append(1 + randn(d, std=0.05).float())
    norm_w.append(1 + randn(d, std=0.05).float())
    norm_w = [w.bfloat16() for w in norm_w]
    return Stack(shape, layers, norm_w, randn(shape.vocab, d, std=1 / math.sqrt(d)),
                 randn(shape.tokens, d, std=1.0))


def rms_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Llama-style RMSNorm: in fp32 (float64 for a float64 ``h``), rounded to ``h``'s dtype, times ``w``."""
    hf = h if h.dtype == torch.float64 else h.float()
    hn = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return hn.to(h.dtype) * w.to(h.dtype)


def run_stack(stack: Stack, layer_fn, dtype) -> dict[int, torch.Tensor]:
    """Logits ``[tokens, vocab]`` at each depth of ``stack.shape.depths``: ``h += gelu(layer_fn(l, rmsnorm(h)))``
    in ``dtype`` (every op rounds to it), then ``rmsnorm(h) Wv^T``."""
    h = stack.x0.to(dtype)
    out = {}
    with torch.no_grad():
        for l in range(stack.shape.layers):
            h = h + Fn.gelu(layer_fn(l, rms_norm(h, stack.norm_w[l])), approximate="tanh")
            if l + 1 in stack.shape.depths:
                out[l + 1] = Fn.linear(rms_norm(h, stack.norm_w[-1]), stack.Wv.to(dtype))
    return out


def peft_bf16_layer(layer: DoRALinear, x: torch.Tensor):
    """``(y, g)``: PEFT's DoRA forward with everything in bf16 (a bf16 model whose adapters stay bf16, PEFT's
    ``autocast_adapter_dtype=False``): the dense norm of ``W + s BA``, ``g = m / norm`` and
    ``(g - 1) base + g lora s``, each op rounded to bf16 (``m`` too)."""
    W, A, B, s = layer.base.weight, layer.lora_A.bfloat16(), layer.lora_B.bfloat16(), layer.scale
    g = layer.magnitude.bfloat16() / torch.linalg.norm(W + s * (B @ A), dim=1)
    base = Fn.linear(x, W)
    return base + ((g - 1) * base + g * Fn.linear(Fn.linear(x, A), B) * s), g


def pm2ulp(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``g`` moved 2 fp32 ulps up or down, a random sign per row: the largest error of ``div.full.f32``."""
    sign = torch.randint(0, 2, g.shape, generator=gen, device=g.device).bool()
    to = torch.where(sign, torch.full_like(g, math.inf), torch.full_like(g, -math.inf))
    return torch.nextafter(torch.nextafter(g, to), to)


def cosine_deficit(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``1 - cos(a_i, b_i)`` per row, in float64 as ``|a^ - b^|^2 / 2`` (unit vectors: no cancellation)."""
    a, b = a.double(), b.double()
    a = a / torch.linalg.vector_norm(a, dim=-1, keepdim=True)
    b = b / torch.linalg.vector_norm(b, dim=-1, keepdim=True)
    return (a - b).pow(2).sum(-1) / 2


def cosine_deficit_bound(eps):
    """The largest ``1 - cos(y, y + e)`` over ``|e| <= eps |y|``, ``eps < 1``: ``1 - sqrt(1 - eps^2)``, written
    without cancellation; at most ``eps^2 / (2 - eps^2)`` (module docstring)."""
    eps = np.asarray(eps, dtype=np.float64)
    return eps**2 / (1 + np.sqrt(1 - eps**2))


def _g_stats(gs: list, g_prod: list, ones) -> dict:
    d = np.abs(np.concatenate([ulp_distance(p.double().cpu().numpy(), g.double().cpu().numpy(), "fp32")
                               for g, p in zip(gs, g_prod)]))
    at1 = torch.cat([g[ones].float() == 1.0 for g in gs])
    return {"g_frac_differ_vs_production": float((d > 0).mean()), "g_max_ulp_vs_production": int(d.max()),
            "g_frac_exactly_one_in_g1_rows": float(at1.double().mean())}


def measure(stack: Stack, seed: int) -> list[dict]:
    """One row per depth and path (:data:`PATHS`): the logits against float64 (``1 - cos`` per token: max and
    median; relative error, whole and worst token) and against production; ``g`` against production's."""
    L, dev = stack.shape.layers, stack.x0.device
    ref64 = [(ly.base.weight.double(), ly.lora_A.double(), ly.lora_B.double(), ly.magnitude.double())
             for ly in stack.layers]
    ref = run_stack(stack, lambda l, x: dora_linear_ref64(x, ref64[l][0], None, *ref64[l][1:], stack.scale),
                    torch.float64)
    g_prod = [ly.magnitude_scale().detach() for ly in stack.layers]
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    g_2ulp = [pm2ulp(g, gen) for g in g_prod]
    terms = [factored_terms(ly.base.weight, ly.lora_A, ly.lora_B, ly.scale)[:3] for ly in stack.layers]
    gs = {"production": g_prod, "g_pm2ulp": g_2ulp}
    kinds = {"production": ("rn", "rn", False), "g_pm2ulp": ("2ulp", "rn", False), "peft_bf16": ("bf16", "bf16", False)}
    logits, ptx = {}, {}

    def kernel_layer(name):
        def f(l, x):
            ly = stack.layers[l]
            base, lora = Fn.linear(x, ly.base.weight), Fn.linear(Fn.linear(x, ly.lora_A), ly.lora_B)
            y, g, kern = fused_dora_forward(base, lora, terms[l], ly.magnitude.detach(), ly.scale, name,
                                            return_kernel=True)
            gs[name][l], ptx[name] = g, ptx_counts(kern)
            return y
        return f

    def peft_layer(l, x):
        y, gs["peft_bf16"][l] = peft_bf16_layer(stack.layers[l], x)
        return y

    logits["production"] = run_stack(stack, lambda l, x: stack.layers[l](x), torch.bfloat16)
    logits["g_pm2ulp"] = run_stack(stack, lambda l, x: stack.layers[l](x, g=g_2ulp[l]), torch.bfloat16)
    gs["peft_bf16"] = [None] * L
    logits["peft_bf16"] = run_stack(stack, peft_layer, torch.bfloat16)
    for name in VARIANTS:
        gs[name] = [None] * L
        logits[name] = run_stack(stack, kernel_layer(name), torch.bfloat16)
    ones = torch.arange(0, stack.shape.hidden, stack.shape.one_every, device=dev)
    rows = []
    for depth in stack.shape.depths:
        r64 = ref[depth]
        for name in PATHS:
            y = logits[name][depth]
            c = cosine_deficit(y, r64)
            rel = torch.linalg.vector_norm(y.double() - r64, dim=-1) / torch.linalg.vector_norm(r64, dim=-1)
            div, sqrt, fusion = VARIANTS[name] if name in VARIANTS else kinds[name]
            rows.append({"seed": seed, "depth": depth, "path": name, "division": div, "sqrt": sqrt,
                         "contraction": fusion, "one_minus_cos_max": float(c.max()),
                         "one_minus_cos_median": float(c.median()),
                         "rel_err": float(torch.linalg.vector_norm(y.double() - r64) / torch.linalg.vector_norm(r64)),
                         "rel_err_max_token": float(rel.max()),
                         "one_minus_cos_max_vs_production": float(cosine_deficit(y, logits["production"][depth]).max()),
                         "frac_logits_bitwise_production": float((y == logits["production"][depth]).double().mean()),
                         **_g_stats(gs[name][:depth], g_prod[:depth], ones),
                         **{f"ptx_{k}": v for k, v in ptx.get(name, {}).items()}})
    return rows


def summary(df) -> "pd.DataFrame":
    """Per path and depth over the recorded seeds: the worst token's ``1 - cos`` against float64 (the largest
    over seeds), that over production's (``vs_production_ratio``: 1 = no worse than production), the largest
    ``1 - cos`` against production itself, and the cosine the paper would report (``1 -`` the worst deficit);
    ``paper_gap``: how far the worst deficit is from the paper's 0.991 (``0.009 / deficit``)."""
    import pandas as pd

    g = df.groupby(["depth", "path"], sort=False)
    out = g.agg(seeds=("seed", "nunique"), one_minus_cos_max=("one_minus_cos_max", "max"),
                vs_production_max=("one_minus_cos_max_vs_production", "max"),
                g_exactly_one_at_g1=("g_frac_exactly_one_in_g1_rows", "min")).reset_index()
    prod = out[out.path == "production"].set_index("depth").one_minus_cos_max
    out["vs_production_ratio"] = out.one_minus_cos_max / out.depth.map(prod)
    out["cosine_min"] = 1.0 - out.one_minus_cos_max
    out["paper_gap"] = PAPER_DEFICIT / out.one_minus_cos_max
    return pd.DataFrame(out)


PAPER_DEFICIT = 1.0 - 0.991  # the paper's worst final-logit cosine (docs/paper.md), as a deficit
