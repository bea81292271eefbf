"""Triton kernel of the fp32 sqrt census (the GPU half of :mod:`.census`).

One program classifies ``BLOCK`` consecutive fp32 bit patterns: it takes the result of the
implementation under test (``MODE``: 0 ``tl.sqrt``, 1 ``tl.sqrt_rn``, 2 inline PTX
``sqrt.rn.f32``, 3 a result computed outside, e.g. by ``torch.sqrt`` on CUDA, read from
``r_ptr``), computes the correctly rounded root by the integer method of :mod:`.census`
(int64 arithmetic; the float64 root of the exact integer ``N`` is a starting guess, certified
by ``q^2 <= N < (q+1)^2``), and writes ``(dist << 11) | code`` per input, exactly as
:func:`.census.classify` does (tests: bit for bit under ``TRITON_INTERPRET=1``).  An input
whose integer certificate fails (never expected) gets the reserved code :data:`UNCERTIFIED`.

Launched with ``enable_fp_fusion=False`` (no contraction in the float64 guess; it would not
matter, the certificate decides).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import census as C

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MODES = {"tl.sqrt": 0, "tl.sqrt_rn": 1, "ptx sqrt.rn.f32": 2, "external": 3}
UNCERTIFIED = 2047


@triton.jit
def _sqrt_census_kernel(out_ptr, r_ptr, start, MODE: tl.constexpr, BLOCK: tl.constexpr):
    local = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    b = start + local  # the fp32 pattern, in [0, 2^32)
    x = b.to(tl.int32).to(tl.float32, bitcast=True)
    if MODE == 0:
        r = tl.sqrt(x)
    elif MODE == 1:
        r = tl.sqrt_rn(x)
    elif MODE == 2:
        r = tl.inline_asm_elementwise("sqrt.rn.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        r = tl.load(r_ptr + local)
    o = r.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    # input class (census.INPUT_CLASSES): 0 negative, 1 zero, 2 subnormal, 3 normal, 4 infinite, 5 not a number
    neg = b >= 0x80000000
    ef = (b >> 23) & 0xFF
    fr = b & 0x7FFFFF
    cls = tl.where(ef == 0, 2, 3)
    cls = tl.where(neg, 0, cls)
    cls = tl.where((b & 0x7FFFFFFF) == 0, 1, cls)
    cls = tl.where(ef == 0xFF, tl.where(fr != 0, 5, 4), cls)
    pos_fin = (cls == 2) | (cls == 3)
    # integer reference (positive finite inputs; others get harmless values)
    M = tl.where(ef == 0, fr, fr | 0x800000)
    M = tl.where(pos_fin, M, 0x800000)
    E = tl.where(ef == 0, -149, ef - 150)
    mb = M.to(tl.float64).to(tl.int64, bitcast=True)
    lz = 24 - (((mb >> 52) & 0x7FF) - 1022)  # 24 - bit_length(M): exact, M < 2^24
    M = M << lz
    E = E - lz
    odd = E & 1
    N = M << (24 - odd)
    q = tl.sqrt(N.to(tl.float64)).to(tl.int64)
    q2 = q * q
    q = q - (q2 > N).to(tl.int64) + (q2 + 2 * q + 1 <= N).to(tl.int64)
    q2 = q * q
    rem = N - q2
    cert = (rem >= 0) & (rem <= 2 * q)
    rr = q + (rem > q).to(tl.int64)
    h = (E - 24 + odd) >> 1
    ref_pos = ((h + 150) << 23) + rr - (1 << 23)
    keep = (cls == 1) | ((cls == 4) & (~neg))
    ref = tl.where(pos_fin, ref_pos, tl.where(keep, b, 0x7FC00000))
    parity = tl.where(pos_fin, (E + 23) & 1, 0)
    pos = tl.where(pos_fin, (rem * 32) // (2 * q + 1), 0)
    # classification (census.classify)
    o_nan = (((o >> 23) & 0xFF) == 0xFF) & ((o & 0x7FFFFF) != 0)
    o_posf = (o > 0) & (o < 0x7F800000)
    CAP: tl.constexpr = (1 << 20) - 1
    dist = tl.where(pos_fin & o_posf, tl.abs(o - ref), tl.where(pos_fin, CAP, 0))
    want_nan = (cls == 0) | (cls == 5) | ((cls == 4) & neg)
    ok_special = tl.where(want_nan, o_nan, o == ref)
    res = tl.where(pos_fin, tl.where(dist == 0, 0, tl.where(dist == 1, 1, 2)), tl.where(ok_special, 0, 2))
    dist = tl.where(pos_fin, dist, tl.where(ok_special, 0, CAP))
    code = ((cls * 3 + res) * 2 + parity) * 32 + pos
    code = tl.where(pos_fin & (~cert), 2047, code)
    v = (tl.minimum(dist, CAP) << 11) | code
    tl.store(out_ptr + local, v.to(tl.int32))


def census_values(start: int, n: int, mode: str, r: torch.Tensor | None = None, *, device="cpu",
                  return_kernel: bool = False):
    """``(dist << 11) | code`` (int32 ``[n]``) for fp32 patterns ``[start, start + n)``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if mode == "ptx sqrt.rn.f32" and INTERPRET:
        raise NotImplementedError("inline PTX cannot run under TRITON_INTERPRET=1")
    if (mode == "external") != (r is not None):
        raise ValueError("r (the implementation's results) is given exactly when mode='external'")
    block = 1 << 16 if (INTERPRET or str(device) == "cpu") else 1024
    if n % block or start < 0 or start + n > 1 << 32:
        raise ValueError(f"n = {n} must be a multiple of {block} and [start, start+n) within 2^32")
    out = torch.empty(n, dtype=torch.int32, device=device)
    rr = r if r is not None else out
    kern = _sqrt_census_kernel[(n // block,)](out, rr, start, MODE=MODES[mode], BLOCK=block, num_warps=4,
                                              enable_fp_fusion=False)
    return (out, kern) if return_kernel else out


def input_patterns(start: int, n: int, device) -> torch.Tensor:
    """fp32 tensor of the patterns ``[start, start + n)`` (for implementations outside Triton)."""
    return torch.arange(start, start + n, dtype=torch.int64, device=device).to(torch.int32).view(torch.float32)


def tables(values: torch.Tensor, chunk: int, impl: str):
    """The census tables of :func:`.census.chunk_tables` from device values (bincount on the device)."""
    import numpy as np
    import pandas as pd

    code = (values & 2047).long()
    if bool((code == UNCERTIFIED).any()):
        raise ArithmeticError(f"{impl}: the integer reference was not certified for some inputs of chunk {chunk}")
    dist = (values >> 11).long()
    cnt = torch.bincount(code, minlength=C.N_CODES).cpu().numpy()
    cr = code // (2 * C.N_POS_BINS)
    cc = np.bincount(np.arange(cnt.size) // (2 * C.N_POS_BINS), weights=cnt,
                     minlength=len(C.INPUT_CLASSES) * 3).astype(np.int64)
    mx = np.zeros(cc.size, dtype=np.int64)
    for k in np.flatnonzero(cc):  # a masked max per class present (scatter_reduce would serialise on atomics)
        mx[k] = int(torch.where(cr == int(k), dist, 0).amax())
    nz = np.flatnonzero(cnt)
    counts = pd.DataFrame({"implementation": impl, "code": nz, "count": cnt[nz]})
    per = pd.DataFrame([{"chunk": chunk, "implementation": impl, "input_class": C.INPUT_CLASSES[k // 3],
                         "result": C.RESULTS[k % 3], "count": int(cc[k]), "max_ulp": int(mx[k])}
                        for k in np.flatnonzero(cc)])
    return counts, per


def ptx_sqrt_counts(kernel) -> dict[str, int]:
    ptx = kernel.asm["ptx"] if kernel is not None else ""
    return {k: ptx.count(k) for k in ("sqrt.approx.ftz.f32", "sqrt.approx.f32", "sqrt.rn.f32", "sqrt.rn.f64")}


