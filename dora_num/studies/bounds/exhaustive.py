r"""Exhaustive compose checks: every (base, lora) pair of a 16-bit format on the GPU, of fp8 on the CPU.

Question (notebooks 01 and 03): at the values of ``g`` and ``s`` that matter, how often is
the compose correctly rounded, how far off can it be, and does the a-priori bound
(:func:`dora_num.numerics.bounds.compose_bound`) hold on the *whole* input space, not a sample?

Configurations (:func:`configurations`): ``g`` exactly 1; ``1 +- k`` fp32 ulps (k = 1, 2, 3);
each side of the collapse edges ``1 + eps/2`` and ``1 - eps/4`` of bf16 and fp16 (the
fp32 numbers just inside, at, and just outside: where ``fl_fmt(g)`` stops being 1); realistic
``g - 1`` of +-1e-5, +-1e-3, +-1e-2.  ``s`` in {1, 0.5, 2/sqrt(7)} (the last an rsLoRA
scale, rounded to fp32: inexact, so ``g*s`` has up to 48 bits).  Formulas: stable and naive;
arithmetics: the contract (fp32, one final rounding) and per-op (eager bf16/fp16).

The method in full: docs/methods.md, studies/bounds/exhaustive.py.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pandas as pd

from ...numerics.formats import FORMATS, from_bits, get_format, round_to
from ...numerics.formulas import scale_constants
from ...numerics.standard_model import SAFE
from . import exhaustive_kernels as K
from .datasets import COMPOSE_GPU

S_VALUES = (("1", 1.0), ("0.5", 0.5), ("rslora_2/sqrt(7)", 2 / math.sqrt(7)))
REALISTIC_GM1 = (1e-5, -1e-5, 1e-3, -1e-3, 1e-2, -1e-2)
FORMULAS = ("compose_stable", "compose_naive")
ARITHS = ("fp32", "per_op")
RESULT_FILE = COMPOSE_GPU.filename("results")


def _f32(x: float) -> float:
    return float(np.float32(x))


def _next32(x: float, toward: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(toward)))


def g_values(edge_formats=("bf16", "fp16")) -> list[tuple[str, float]]:
    """``(label, g)`` pairs (fp32 values), ordered by ``g``."""
    out = [("exactly_1", 1.0)]
    for k in (1, 2, 3):
        out += [(f"1+{k}ulp32", 1.0 + k * 2.0**-23), (f"1-{k}ulp32", 1.0 - k * 2.0**-24)]
    for f in edge_formats:
        fm = FORMATS[f]
        for side, edge in (("above", 1.0 + fm.spacing_above_one / 2), ("below", 1.0 - fm.spacing_below_one / 2)):
            out += [(f"{f}_edge_{side}_inside", _next32(edge, 1.0)), (f"{f}_edge_{side}", edge),
                    (f"{f}_edge_{side}_outside", _next32(edge, 2.0 if side == "above" else 0.0))]
    out += [(f"1{d:+.0e}", _f32(1.0 + d)) for d in REALISTIC_GM1]
    seen, uniq = set(), []
    for lab, g in sorted(out, key=lambda t: t[1]):
        if g not in seen:
            seen.add(g)
            uniq.append((lab, g))
    return uniq


def _priority(g_label: str) -> int:
    """Launch order, so that a run stopped by its time budget has the values that matter most."""
    for i, key in enumerate(("exactly_1", "edge", "ulp32", "1+1e-03", "1-1e-03")):
        if key in g_label:
            return i
    return 5


def configurations(formats=("bf16", "fp16"), edge_formats=("bf16", "fp16")) -> list[dict]:
    """Every (format, g, s) launch of the exhaustive check, in launch order (:func:`_priority`,
    then s, then format: both formats advance together)."""
    cfgs = [{"format": f, "g_label": gl, "g": g, "s_label": sl, "s": scale_constants(s)[0], "_order": (
        _priority(gl), si, fi)} for fi, f in enumerate(formats) for gl, g in g_values(edge_formats)
        for si, (sl, s) in enumerate(S_VALUES)]
    cfgs.sort(key=lambda c: c.pop("_order"))
    return cfgs


# --------------------------------------------------------------------------
# Host constants of one launch
# --------------------------------------------------------------------------

def _exact_f64(q: Fraction, what: str) -> float:
    v = float(q)
    if Fraction(v) != q:
        raise ValueError(f"{what} = {q} is not exactly representable in float64")
    return v


def bound_constants(fmt, arith: str, g: float, s: float) -> dict[str, float]:
    """The scalar parts of :func:`~dora_num.numerics.bounds.compose_bound` for one arithmetic
    (``fp32``: the contract; ``per_op``), evaluated as ``_compose_parts`` evaluates them (its
    :func:`~dora_num.numerics.bounds.working_arithmetic`, the same expressions in float64 on one-element arrays, so the factors
    that depend on ``g`` alone are bit for bit the ones it multiplies the per-element terms by).
    The kernel's transcription (:func:`.exhaustive_kernels._bound`) combines them with those terms."""
    from ...numerics.bounds import working_arithmetic

    fmt = get_format(fmt)
    if fmt.bits != 16:
        raise ValueError(f"the 16-bit kernel takes bf16 or fp16, got {fmt.name}")
    if arith not in ARITHS:
        raise ValueError(f"arith must be fp32 or per_op, got {arith!r}")
    w, us, eta, out, fma = working_arithmetic(fmt, arith)
    if fma or (arith == "fp32") != (out is not None):
        raise ValueError(f"{arith}: the kernel transcribes the unfused variants with one final rounding to {fmt.name}")
    u = w.u
    g_arr = np.array([g], dtype=np.float64)
    gp_arr = round_to(g_arr, fmt) if arith == "per_op" else g_arr
    ag = np.abs(gp_arr)
    k = ((gp_arr < 0.5) | (gp_arr > 2.0)).astype(np.float64)
    one = lambda a: float(a[0])  # noqa: E731
    return {"gp": one(gp_arr), "dg": one(np.abs(gp_arr - g_arr)), "u": u, "us": us, "eta": eta, "wmax": w.max,
            "c_p": one((1 + us) ** k * (1 + u) - 1), "c_t": (1 + us) * (1 + u) - 1,
            "c_e": one((ag * (1 + u) + 2) * eta), "u1sq": (1 + u) ** 2, "u1cu": (1 + u) ** 3,
            "pw2": (1.0 + u) ** 2 - 1.0, "uo": out.u if out else 0.0, "omax": out.max if out else math.inf,
            "omin_half": out.min_subnormal / 2 if out else 0.0}


def launch_constants(fmt, g: float, s: float) -> tuple[np.ndarray, np.ndarray]:
    """``(fp64 constants, fp32 scalars)`` of one launch, each exactness claim of the kernel's
    proof (docs/bounds.md) checked here with ``Fraction``."""
    fmt = get_format(fmt)
    if _f32(g) != g or scale_constants(s)[0] != s:
        raise ValueError(f"g and s must be fp32 values (s rounded by scale_constants), got {g!r}, {s!r}")
    if not 0.5 <= g <= 2.0:
        raise ValueError(f"g = {g} outside [0.5, 2]: g - 1 would not be exact in fp32 (Sterbenz)")
    gm1 = _exact_f64(Fraction(g) - 1, "g - 1")
    C = _exact_f64(Fraction(g) * Fraction(s), "g * s")
    ch = _f32(C)
    cl = _exact_f64(Fraction(C) - Fraction(ch), "g*s - RN24(g*s)")
    if abs(Fraction(cl)) > abs(Fraction(ch)) * Fraction(1, 2**24) or Fraction(cl).denominator > 2**200:
        raise ValueError("split of g*s is not as the kernel's proof assumes")
    consts = [g, gm1, ch, cl, s, SAFE, 1.0 + 2.0**-50]  # K.CONST_NAMES
    for arith in ARITHS:
        c = bound_constants(fmt, arith, g, s)
        consts += [c[n] for n in K.ARITH_CONSTS]
    gp = float(round_to(np.array([g]), fmt)[0])
    gm1p = float(round_to(np.array([_f32(np.float32(gp) - np.float32(1.0))]), fmt)[0])
    return np.array(consts, dtype=np.float64), np.array([g, s, gp, gm1p], dtype=np.float32)


# --------------------------------------------------------------------------
# One launch
# --------------------------------------------------------------------------

def launch(fmt, g: float, s: float, *, start: int = 0, n: int = 1 << 32, device="cpu",
           tile: int | None = None, iters: int | None = None, write_out: bool = False):
    """Run the kernel over pair indices ``[start, start + n)``; returns ``(stats, out)``:
    ``stats`` int64 ``[4, N_STAT]`` summed over programs (keys: max); ``out`` is None, or with
    ``write_out`` ``(patterns int32 [n, 5], float64 [n, 9]: bounds, ulp bounds, kappa_c)``
    (docs/bounds.md, the exhaustive check)."""
    import torch

    fmt = get_format(fmt)
    interp = K.INTERPRET or str(device) == "cpu"
    # GPU: 256 pairs per tile, 8 warps (one pair per thread).  ptxas for sm_90a (triton 3.7.1, on the CPU):
    # 255 registers, 16 (bf16) / 20 (fp16) bytes spilled, 1242 SASS instructions per pair and variant set
    # in the loop (bf16); without the ulp form and kappa_c it was 254 registers, no spill, 968
    # instructions.  1024 x 8 warps spilled 128 bytes.  Not timed on the GPU yet.
    tile = tile or (4096 if interp else 256)
    iters = iters or (1 if interp else 256)
    per = tile * iters
    if iters > 511:
        raise ValueError(f"iters = {iters} > 511 would overflow the kernel's 9-bit per-lane counters")
    if n % per or start % tile or start + n > 1 << 32:
        raise ValueError(f"n = {n} must be a multiple of tile*iters = {per}, start of tile, within 2^32")
    consts, f32s = launch_constants(fmt, g, s)
    c64 = torch.from_numpy(consts).to(device)
    c32 = torch.from_numpy(f32s).to(device)
    progs = n // per
    stats = torch.zeros(progs, 4, K.N_STAT, dtype=torch.int64, device=device)
    if write_out:
        out = torch.full((n, 5), -1, dtype=torch.int32, device=device)
        outf = torch.full((n, K.N_OUTF), math.nan, dtype=torch.float64, device=device)
    else:
        out = torch.empty(1, dtype=torch.int32, device=device)
        outf = torch.empty(1, dtype=torch.float64, device=device)
    kw = {} if interp else {"num_warps": 8}
    K._compose_exhaustive_kernel[(progs,)](c64, c32, stats, out, outf, start, FMT=K.FMT_CODES[fmt.name], TILE=tile,
                                           ITERS=iters, WRITE_OUT=write_out, NS=K.N_STAT, NC=len(K.CONST_NAMES),
                                           NA=len(K.ARITH_CONSTS), NOUTF=K.N_OUTF, enable_fp_fusion=False, **kw)
    tot = stats.sum(0)
    tot[:, -2:] = stats[:, :, -2:].amax(0)
    return tot.cpu().numpy(), ((out.cpu().numpy(), outf.cpu().numpy()) if write_out else None)


def stats_rows(cfg: dict, stats: np.ndarray, n: int, **extra) -> list[dict]:
    """Tidy rows (one per formula x arithmetic) from a launch's statistics."""
    rows = []
    for v, (formula, arith) in enumerate(K.VARIANTS):
        st = dict(zip(K.STAT_NAMES, (int(x) for x in stats[v])))
        finite = sum(st[c] for c in K.CLASSES[:10])
        kd, kr = st.pop("key_dist"), st.pop("key_ratio")
        row = {**{k: cfg[k] for k in ("format", "g_label", "g", "s_label", "s")}, "g_minus_1": cfg["g"] - 1.0,
               "formula": formula, "arith": arith, "n_pairs": n, "n_measured": finite,
               **{k: v_ for k, v_ in st.items() if not k.startswith("unused")},
               "frac_correctly_rounded": st["ulp_0"] / finite if finite else math.nan,
               "frac_within_1ulp": (st["ulp_0"] + st["ulp_1"]) / finite if finite else math.nan,
               "max_ulp": (kd >> 32) if kd >= 0 else -1,
               "worst_ulp_base_bits": ((kd & 0xFFFFFFFF) >> 16) if kd >= 0 else -1,
               "worst_ulp_lora_bits": (kd & 0xFFFF) if kd >= 0 else -1,
               "max_err_over_bound": float(np.array([kr >> 32], dtype=np.int32).view(np.float32)[0]) if kr >= 0 else math.nan,
               "worst_ratio_base_bits": ((kr & 0xFFFFFFFF) >> 16) if kr >= 0 else -1,
               "worst_ratio_lora_bits": (kr & 0xFFFF) if kr >= 0 else -1, **extra}
        rows.append(row)
    return rows


# --------------------------------------------------------------------------
# fp8 on the CPU (the same quantities, from the package's numpy functions)
# --------------------------------------------------------------------------

def all_values(fmt) -> tuple[np.ndarray, np.ndarray]:
    """``(bits, values)`` of every pattern of a format of at most 16 bits (4, 6 and 8 included;
    values float64 from :func:`~dora_num.numerics.formats.from_bits`, NaN kept)."""
    fmt = get_format(fmt)
    if fmt.bits > 16:
        raise ValueError(f"{fmt.name} has 2^{fmt.bits} patterns: too many to enumerate")
    bits = np.arange(1 << fmt.bits, dtype=np.int64).astype(fmt.uint_dtype)
    return bits, from_bits(bits, fmt)


def exact_terms(b, l_, g: float, s: float) -> tuple[np.ndarray, np.ndarray]:
    """``(H, rho)`` with ``X = (g-1) b + g s l``, ``H`` within no fp64 number of ``X`` and
    ``sign(rho) = sign(X - H)``: the kernel's error-free sequence in numpy (its proof:
    :mod:`.exhaustive_kernels`)."""
    from ...numerics.formats import two_sum

    consts, _ = launch_constants("bf16", g, s)
    gm1, ch, cl = consts[1], consts[2], consts[3]
    b, l_ = np.asarray(b, dtype=np.float64), np.asarray(l_, dtype=np.float64)
    h, l1 = two_sum(gm1 * b, ch * l_)
    m, l2 = two_sum(l1, cl * l_)
    H, L = two_sum(h, m)
    return H, L + l2


def err_upper(c, H, rho) -> np.ndarray:
    """An upper bound on ``|c - X|`` (as the kernel computes it)."""
    with np.errstate(invalid="ignore"):
        return (np.abs(np.asarray(c, dtype=np.float64) - H) + np.abs(rho)) * (1.0 + 2.0**-50)


def cpu_exhaustive(fmt, g: float, s: float, g_label: str = "", s_label: str = "", *, base_bits=None) -> list[dict]:
    """Every (base, lora) pair of ``fmt`` (or ``base`` restricted to ``base_bits``) at one (g, s):
    rows as :func:`stats_rows`, computed with ``emulate`` / ``compose_exact`` / ``compose_bound`` /
    ``compose_ulp_bound`` / ``compose_condition``."""
    from ...numerics.bounds import compose_bound, compose_condition, compose_ulp_bound, one_ulp_condition
    from ...numerics.emulate import emulate
    from ...numerics.formats import ulp_distance
    from ...numerics.ground_truth import compose_exact

    fmt = get_format(fmt)
    bits, vals = all_values(fmt)
    bsel = bits if base_bits is None else np.asarray(base_bits, dtype=fmt.uint_dtype)
    bb, lb = np.meshgrid(bsel.astype(np.int64), bits.astype(np.int64), indexing="ij")
    bv, lv = vals[bb.ravel()], vals[lb.ravel()]
    shift = fmt.bits
    idx = (bb.ravel() << shift) | lb.ravel()
    fin = np.isfinite(bv) & np.isfinite(lv)
    b, l_, ix = bv[fin], lv[fin], idx[fin]
    gg = np.full(b.shape, g)
    ref = compose_exact(b, l_, gg, s, fmt).rounded
    H, rho = exact_terms(b, l_, g, s)
    rows = []
    cfg = {"format": fmt.name, "g_label": g_label, "g": g, "s_label": s_label, "s": scale_constants(s)[0]}
    eager = eager_variants(fmt, bb.ravel()[fin], lb.ravel()[fin], g, s) if fmt.bits == 16 else None
    well = compose_condition(b, l_, gg, s) <= one_ulp_condition(fmt)
    for formula, arith in K.VARIANTS:
        if eager is None:
            c = emulate(formula, {"base": b, "lora": l_, "g": gg, "s": s}, fmt, arith)
        else:
            c = eager[(formula, arith)].view(fmt.np_dtype).astype(np.float64)
        B = compose_bound(formula, b, l_, gg, s, fmt, arith)
        U = compose_ulp_bound(formula, b, l_, gg, s, fmt, arith)
        r_fin, c_fin = np.isfinite(ref), np.isfinite(c)
        both = r_fin & c_fin
        d = np.full(b.shape, -1, dtype=np.int64)
        d[both] = np.abs(ulp_distance(ref[both], c[both], fmt))
        err = err_upper(c, H, rho)
        hist = {k: int((both & (d > lo_) & (d <= hi_)).sum())
                for k, lo_, hi_ in zip(K.CLASSES[:10], (-1,) + K.DIST_EDGES, K.DIST_EDGES + (np.inf,))}
        agree = ~r_fin & ~c_fin & ((c == ref) | (np.isnan(c) & np.isnan(ref)))
        hist.update(overflow_agree=int(agree.sum()), overflow_mismatch=int((~r_fin & ~agree).sum()),
                    spurious_nonfinite=int((r_fin & ~c_fin).sum()), input_nonfinite=int((~fin).sum()))
        bfin = np.isfinite(B)
        with np.errstate(invalid="ignore"):
            ratio = np.where(both & bfin, err / B, -1.0).astype(np.float32)  # as the kernel packs it
        viol = bfin & (~both | (err > B))
        ufin = np.isfinite(U)
        uviol = ufin & (~both | (d > U))
        kd = int(np.flatnonzero(d == d.max())[-1]) if both.any() else -1  # ties: the largest index, as the kernel
        kr = int(np.flatnonzero(ratio == ratio.max())[-1]) if (ratio >= 0).any() else -1
        n_b = max(int(both.sum()), 1)
        rows.append({**cfg, "g_minus_1": g - 1.0, "formula": formula, "arith": arith, "n_pairs": int(idx.size),
                     "n_measured": int(both.sum()), **hist,
                     "violations": int(viol.sum()), "bound_inf": int((both & ~bfin).sum()),
                     "ratio_ge_half": int((both & bfin & (ratio >= 0.5)).sum()),
                     "ulp_bound_violations": int(uviol.sum()), "ulp_bound_le_1": int((both & (U <= 1)).sum()),
                     "ulp_bound_attained": int((both & ufin & (d == U)).sum()),
                     "kappa_le_one_ulp": int((both & well).sum()),
                     "kappa_le_one_ulp_over_1ulp": int((both & well & (d > 1)).sum()),
                     "frac_correctly_rounded": float((d == 0).sum() / n_b),
                     "frac_within_1ulp": float(((d >= 0) & (d <= 1)).sum() / n_b),
                     "max_ulp": int(d[kd]) if kd >= 0 else -1,
                     "worst_ulp_base_bits": int(ix[kd] >> shift) if kd >= 0 else -1,
                     "worst_ulp_lora_bits": int(ix[kd] & ((1 << shift) - 1)) if kd >= 0 else -1,
                     "max_err_over_bound": float(ratio[kr]) if kr >= 0 else math.nan,
                     "worst_ratio_base_bits": int(ix[kr] >> shift) if kr >= 0 else -1,
                     "worst_ratio_lora_bits": int(ix[kr] & ((1 << shift) - 1)) if kr >= 0 else -1})
    return rows


def fp8_exhaustive(formats=("fp8_e4m3fn", "fp8_e5m2"), *, smoke: bool = False) -> pd.DataFrame:
    """:func:`cpu_exhaustive` over the fp8 configurations (edges of the fp8 formats included)."""
    rows = []
    for f in formats:
        gs = g_values(("bf16", "fp16", f))
        ss = S_VALUES
        if smoke:
            gs, ss = [gs[0], gs[len(gs) // 2]], ss[:1] + ss[2:]
        for gl, g in gs:
            for sl, s in ss:
                rows += cpu_exhaustive(f, g, scale_constants(s)[0], gl, sl)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# The computed variants by eager torch (what the kernel must equal), and re-checks
# --------------------------------------------------------------------------

def eager_variants(fmt, base_bits, lora_bits, g: float, s: float, device="cpu") -> dict[tuple, np.ndarray]:
    """The four computed variants, evaluated by eager torch on 16-bit tensors, as bit patterns
    (uint16): the contract via :mod:`dora_num.ops.reference`, per-op as the formula of
    :mod:`dora_num.numerics.formulas` on ``fmt`` tensors (each op computed in fp32 and rounded,
    a Python scalar operand included), ``g`` held in ``fmt``.  Inputs must be finite."""
    import torch

    from ...numerics import formulas as F
    from ...numerics.arithmetic import TorchFP32
    from ...ops import reference as R

    fmt = get_format(fmt)
    dt = fmt.torch_dtype
    as_t = lambda bits: torch.from_numpy(np.asarray(bits, dtype=np.uint16).view(np.int16).copy()).view(dt).to(device)  # noqa: E731
    base, lora = as_t(base_bits), as_t(lora_bits)
    gt = torch.full(base.shape, g, dtype=torch.float32, device=device)
    bits = lambda t: t.view(torch.int16).cpu().numpy().view(np.uint16)  # noqa: E731
    return {("compose_stable", "fp32"): bits(R.compose_stable(base, lora, gt, s)),
            ("compose_naive", "fp32"): bits(R.compose_naive(base, lora, gt, s)),
            ("compose_stable", "per_op"): bits(F.compose_stable(TorchFP32, base, lora, gt.to(dt), s)),
            ("compose_naive", "per_op"): bits(F.compose_naive(TorchFP32, base, lora, gt.to(dt), s))}


def bitwise_check(fmt, g: float, s: float, start: int, n: int, device="cpu", *, return_bounds: bool = False):
    """Kernel outputs (``write_out``) on pair indices ``[start, start+n)`` against the package,
    over the finite pairs: the four computed variants against eager torch
    (:func:`eager_variants`), the exact result against ``compose_exact``, and, per variant, the
    bound, the ulp bound and ``kappa_c`` against ``compose_bound``, ``compose_ulp_bound`` and
    ``compose_condition``.  Returns mismatch counts (all zero when the kernel is right; keys
    ``formula/arith``, ``exact``, ``bound:formula/arith``, ``ulp_bound:formula/arith``,
    ``kappa``) and ``n_finite`` (and the kernel's float64 outputs ``[n, 9]`` with
    ``return_bounds``).  Bit for bit: NaN never occurs on finite pairs, ``inf`` equals ``inf``."""
    from ...numerics.bounds import compose_bound, compose_condition, compose_ulp_bound
    from ...numerics.ground_truth import compose_exact

    fmt = get_format(fmt)
    _, (out, bounds) = launch(fmt, g, s, start=start, n=n, device=device, write_out=True)
    idx = np.arange(start, start + n, dtype=np.int64)
    bb, lb = (idx >> 16).astype(np.uint16), (idx & 0xFFFF).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        vb, vl = bb.view(fmt.np_dtype).astype(np.float64), lb.view(fmt.np_dtype).astype(np.float64)
    fin = np.isfinite(vb) & np.isfinite(vl)
    got = out.astype(np.int64) & 0xFFFF
    res = {"n_finite": int(fin.sum())}
    for v, ev in zip(K.VARIANTS, eager_variants(fmt, bb[fin], lb[fin], g, s, device).values()):
        res[f"{v[0]}/{v[1]}"] = int((got[fin, K.VARIANTS.index(v)] != ev).sum())
    gg = np.full(int(fin.sum()), g)
    want = compose_exact(vb[fin], vl[fin], gg, s, fmt).rounded
    ref = got[fin, 4].astype(np.uint16).view(fmt.np_dtype).astype(np.float64)
    res["exact"] = int((ref != want).sum())
    bits = lambda a: np.ascontiguousarray(a, dtype=np.float64).view(np.int64)  # noqa: E731
    for v, (formula, arith) in enumerate(K.VARIANTS):
        for key, fn, col in (("bound", compose_bound, v), ("ulp_bound", compose_ulp_bound, 4 + v)):
            w = fn(formula, vb[fin], vl[fin], gg, s, fmt, arith)
            res[f"{key}:{formula}/{arith}"] = int((bits(bounds[fin, col]) != bits(w)).sum())
    res["kappa"] = int((bits(bounds[fin, 8]) != bits(compose_condition(vb[fin], vl[fin], gg, s))).sum())
    return (res, bounds) if return_bounds else res


# --------------------------------------------------------------------------
# The GPU run (one call plans every configuration)
# --------------------------------------------------------------------------

BITWISE_FILE = COMPOSE_GPU.filename("bitwise")

