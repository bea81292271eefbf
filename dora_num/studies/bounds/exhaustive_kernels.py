r"""Triton kernel of the exhaustive 16-bit compose check: every (base, lora) pair at one (g, s).

One launch covers ``n`` consecutive pair indices ``idx`` (``base = bits(idx >> 16)``,
``lora = bits(idx & 0xFFFF)`` in bf16 or fp16) and evaluates, per element, the four computed
results (stable / naive compose x fp32 contract / per-op arithmetic), the exact result
``X = (g - 1) base + g s lora`` rounded once to the format (three exact fp64 products and
TwoSums: no fp64 number lies between ``X`` and the rounded sum ``H``), and each variant's
a-priori bound (:func:`dora_num.numerics.bounds.compose_bound`, transcribed op for op and held
to it bit for bit by the tests); the statistics are reduced per program without atomics.
Decode, integer rounding, the proof of the exact reference and the statistics: docs/bounds.md,
"The exhaustive 16-bit compose check".
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

FMT_CODES = {"bf16": 0, "fp16": 1}
VARIANTS = (("compose_stable", "fp32"), ("compose_naive", "fp32"), ("compose_stable", "per_op"),
            ("compose_naive", "per_op"))
DIST_EDGES = (0, 1, 2, 4, 8, 16, 64, 256, 4096)  # class k < 9: distance in (EDGES[k-1], EDGES[k]]; 9: beyond
CLASSES = ("ulp_0", "ulp_1", "ulp_2", "ulp_3_4", "ulp_5_8", "ulp_9_16", "ulp_17_64", "ulp_65_256",
           "ulp_257_4096", "ulp_gt_4096", "overflow_agree", "overflow_mismatch", "spurious_nonfinite",
           "input_nonfinite", "unused_14", "unused_15")
N_HIST = 16
FLAG_NAMES = ("violations", "bound_inf", "ratio_ge_half")  # 10-bit fields of one int32 per lane
ULP_NAMES = ("ulp_bound_violations", "ulp_bound_le_1", "ulp_bound_attained", "kappa_le_one_ulp",
             "kappa_le_one_ulp_over_1ulp")  # 10-bit fields of one int64 per lane
STAT_NAMES = CLASSES + FLAG_NAMES + ULP_NAMES + ("key_dist", "key_ratio")  # the two keys last (max, not sum)
N_STAT = len(STAT_NAMES)  # per variant
# fp64 constants per launch (exhaustive.launch_constants / bound_constants)
CONST_NAMES = ("g", "gm1", "ch", "cl", "s", "safe", "err_up")  # then ARITH_CONSTS for fp32, then for per_op
ARITH_CONSTS = ("gp", "dg", "u", "us", "eta", "wmax", "c_p", "c_t", "c_e", "u1sq", "u1cu", "pw2", "uo", "omax",
                "omin_half")
N_CONST = len(CONST_NAMES) + 2 * len(ARITH_CONSTS)
N_OUTF = 9  # write_out: 4 bounds, 4 ulp bounds, kappa_c


@triton.jit
def _decode(bits, FMT: tl.constexpr):
    """16-bit pattern (int32 in [0, 2^16)) -> its exact fp32 value."""
    if FMT == 0:
        x = (bits << 16).to(tl.float32, bitcast=True)
    else:
        x = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _unpack(bits, W: tl.constexpr, F: tl.constexpr):
    """The fields of a ``W``-bit IEEE binary pattern with ``F`` fraction bits (integers of its
    width): sign bit, exponent field, fraction field, and the finite value's ``M`` and ``e``
    with ``|v| = M 2^(e - F)`` (``e`` the source's emin for its subnormals)."""
    BIAS: tl.constexpr = (1 << (W - F - 2)) - 1
    sign = (bits >> (W - 1)) & 1
    ab = bits & ((1 << (W - 1)) - 1)
    ef = ab >> F
    fr = ab & ((1 << F) - 1)
    M = tl.where(ef == 0, fr, fr | (1 << F))
    e = tl.where(ef == 0, 1 - BIAS, ef - BIAS)
    return sign, ef, fr, M, e


@triton.jit
def _quantize(M, e, F: tl.constexpr, KMAX: tl.constexpr, FMT: tl.constexpr):
    """The finite ``|v| = M 2^(e - F)`` (``e = floor(log2 |v|)``, or the source's emin for its
    subnormals) on the format's grid (docs/bounds.md, the exhaustive check, "Rounding to the format"): its quantum
    exponent ``qe``, the kept significand ``keep = M >> k``, the dropped bits ``rem`` and half
    of their weight ``half``; at most ``KMAX`` bits are dropped (beyond, everything rounds to 0
    alike).  Integers of ``M``'s width."""
    P: tl.constexpr = 8 if FMT == 0 else 11
    EMIN: tl.constexpr = -126 if FMT == 0 else -14
    qe = tl.maximum(e, EMIN) - P + 1
    k = tl.minimum(qe - (e - F), KMAX)
    one = tl.full(k.shape, 1, M.dtype)
    keep = M >> k
    rem = M & ((one << k) - 1)
    half = one << (k - 1)
    return qe, keep, rem, half


@triton.jit
def _pattern(qe, keep, up, FMT: tl.constexpr):
    """The format's magnitude pattern of ``keep`` (rounded up by one where ``up``) at quantum
    exponent ``qe``, for every binade at once; at or beyond infinity's pattern: infinity."""
    P: tl.constexpr = 8 if FMT == 0 else 11
    EMIN: tl.constexpr = -126 if FMT == 0 else -14
    EXPB: tl.constexpr = 8 if FMT == 0 else 5
    INF: tl.constexpr = ((1 << EXPB) - 1) << (P - 1)
    mag = ((qe - (EMIN - P + 1)) << (P - 1)) + keep + up.to(keep.dtype)
    return tl.minimum(mag, INF)


@triton.jit
def _round_f32(x, FMT: tl.constexpr):
    """fp32 -> nearest-even pattern of the format (int32; overflow -> inf, NaN -> NaN)."""
    P: tl.constexpr = 8 if FMT == 0 else 11
    EXPB: tl.constexpr = 8 if FMT == 0 else 5
    INF: tl.constexpr = ((1 << EXPB) - 1) << (P - 1)
    sign, ef, fr, M, e = _unpack(x.to(tl.int32, bitcast=True), 32, 23)  # v = M * 2^(e - 23)
    qe, keep, rem, half = _quantize(M, e, 23, 25, FMT)  # k >= 24 - P
    up = (rem > half) | ((rem == half) & ((keep & 1) == 1))
    mag = _pattern(qe, keep, up, FMT)
    mag = tl.where(ef == 255, tl.where(fr != 0, INF | (1 << (P - 2)), INF), mag)
    return (sign << 15) | mag


@triton.jit
def _round_f64(h, rho, FMT: tl.constexpr):
    """Nearest-even pattern of the format for the exact value ``X = h + (X - h)`` where
    ``sign(rho) = sign(X - h)`` and no fp64 number lies strictly between ``X`` and ``h``
    (docs/bounds.md, the exhaustive check).  ``h`` finite fp64."""
    sign, ef, fr, M, e = _unpack(h.to(tl.int64, bitcast=True), 64, 52)  # h = M * 2^(e - 52)
    qe, keep, rem, half = _quantize(M, e, 52, 54, FMT)
    away = tl.where(sign == 1, rho < 0, rho > 0)  # X lies beyond h, away from zero
    toward = tl.where(sign == 1, rho > 0, rho < 0)
    up = (rem > half) | ((rem == half) & (away | ((~toward) & ((keep & 1) == 1))))
    mag = _pattern(qe, keep, up, FMT)
    return ((sign << 15) | mag).to(tl.int32)


@triton.jit
def _two_sum(a, b):
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


@triton.jit
def _ordinal(bits):
    mag = bits & 0x7FFF
    return tl.where((bits >> 15) != 0, -mag, mag)


@triton.jit
def _bound(b, L, aL, ab, Xt, cptr, BASE: tl.constexpr, NAIVE: tl.constexpr, PER_OP: tl.constexpr,
           FMT: tl.constexpr):
    """:func:`dora_num.numerics.bounds.compose_bound` and :func:`~dora_num.numerics.bounds.compose_ulp_bound`
    of one (formula, arithmetic) (constants at ``cptr + BASE``), transcribed operation for
    operation from ``_compose_parts`` (same association, float64).  ``Xt = |X|`` with the given ``g``.  Returns
    ``(bound, ulp_bound)``."""
    P: tl.constexpr = 8 if FMT == 0 else 11
    EMIN: tl.constexpr = -126 if FMT == 0 else -14
    safe = tl.load(cptr + 5)
    gp = tl.load(cptr + BASE + 0)
    dg = tl.load(cptr + BASE + 1)
    u = tl.load(cptr + BASE + 2)
    us = tl.load(cptr + BASE + 3)
    eta = tl.load(cptr + BASE + 4)
    wmax = tl.load(cptr + BASE + 5)
    c_p = tl.load(cptr + BASE + 6)  # stable: ((1 + us)^k (1 + u) - 1), the factor of A
    c_t = tl.load(cptr + BASE + 7)  # stable: (1 + us)(1 + u) - 1, the factor of T
    c_e = tl.load(cptr + BASE + 8)  # stable: (|g'|(1 + u) + 2) eta
    u1sq = tl.load(cptr + BASE + 9)  # (1 + u) ** 2 and ** 3 as the host's pow computes them
    u1cu = tl.load(cptr + BASE + 10)
    pw2 = tl.load(cptr + BASE + 11)  # (1 + u) ** 2 - 1
    ag = tl.abs(gp)
    gm1 = gp - 1.0
    A = tl.abs(gm1 * b)
    T = ag * aL
    X = tl.abs(gm1 * b + gp * L) + (4 * 2.0**-53) * (A + T)
    u1 = 1.0 + u
    m1 = aL * (1.0 + us) + eta
    if NAIVE:
        Lb = tl.abs(L + b)
        E_pre = ag * (pw2 * Lb + u1sq * (us * aL + eta)) + eta
        m2 = (aL + ab) * u1sq + eta
        m3 = ag * (aL + ab) * u1cu + 2.0 * eta
    else:
        E_pre = c_p * A + c_t * T + c_e
        m2 = T * u1sq + 2.0 * eta
        m3 = A * u1sq + eta
    m4 = X + E_pre
    over = (m1 * u1 >= wmax) | (m2 * u1 >= wmax) | (m3 * u1 >= wmax) | (m4 * u1 >= wmax)
    E_w = E_pre + u * (X + E_pre)
    if PER_OP:
        E = E_w  # the last operation rounds to the format itself
        E_last = E_pre
    else:
        uo = tl.load(cptr + BASE + 12)
        omax = tl.load(cptr + BASE + 13)
        omin_half = tl.load(cptr + BASE + 14)
        over = over | ((X + E_w) * (1.0 + uo) >= omax)
        E = E_w + uo * (X + E_w) + omin_half
        E_last = E_w  # the fp32 result is what the final rounding to the format receives
    dgL = dg * tl.abs(L + b)
    B = tl.where(over, float("inf"), (E + dgL) * safe)
    # ulp form: 1 + floor(E_last / q), q the format's quantum at max(|X| - E_last, 0)
    E_last = (E_last + dgL) * safe
    low = tl.maximum(Xt - E_last, 0.0)
    e = ((low.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023  # floor(log2 low); < EMIN for 0, subnormals
    qe = tl.maximum(e, EMIN) - P + 1
    inv_q = ((1023 - qe) << 52).to(tl.float64, bitcast=True)  # 2^-qe (qe in [-133, 1024 - P]: normal)
    r = E_last * inv_q  # = E_last / q exactly
    r_floor = tl.where(r < 4503599627370496.0, r.to(tl.int64).to(tl.float64), r)  # floor: r >= 0
    U = tl.where(over, float("inf"), 1.0 + r_floor)
    return B, U


@triton.jit
def _stats(c_bits, ref_bits, in_fin, H, rho, B, U, well, err_up, idx, FMT: tl.constexpr):
    P: tl.constexpr = 8 if FMT == 0 else 11
    EXPB: tl.constexpr = 8 if FMT == 0 else 5
    INF: tl.constexpr = ((1 << EXPB) - 1) << (P - 1)
    c_fin = (c_bits & 0x7FFF) < INF
    r_fin = (ref_bits & 0x7FFF) < INF
    both = in_fin & c_fin & r_fin
    dist = tl.abs(_ordinal(c_bits) - _ordinal(ref_bits))
    cls = tl.where(dist == 0, 0, tl.where(dist == 1, 1, tl.where(dist == 2, 2, tl.where(dist <= 4, 3, tl.where(
        dist <= 8, 4, tl.where(dist <= 16, 5, tl.where(dist <= 64, 6, tl.where(dist <= 256, 7, tl.where(
            dist <= 4096, 8, 9)))))))))
    same_inf = c_bits == ref_bits
    cls = tl.where(r_fin, tl.where(c_fin, cls, 12), tl.where(same_inf, 10, 11))
    cls = tl.where(in_fin, cls, 13)
    c = _decode(c_bits, FMT).to(tl.float64)  # exact
    err = (tl.abs(c - H) + tl.abs(rho)) * err_up
    bfin = B < float("inf")
    viol = in_fin & bfin & ((~c_fin) | (~r_fin) | (err > B))
    binf = both & (~bfin)
    half = both & bfin & (err >= 0.5 * B)
    ratio = tl.where(both & bfin, err / B, 0.0).to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
    kd = tl.where(both, (dist.to(tl.int64) << 32) | idx, -1)
    kr = tl.where(both & bfin, (ratio << 32) | idx, -1)
    # per-element increments of the per-lane accumulators (reduced once per program, in _store):
    # classes 0..6 / 7..13 as 9-bit fields of two int64, the three flags as 10-bit fields of an int32
    sh = ((cls % 7) * 9).to(tl.int64)
    one = tl.full(sh.shape, 1, tl.int64)
    p0 = tl.where(cls < 7, one << sh, 0)
    p1 = tl.where(cls >= 7, one << sh, 0)
    fl = viol.to(tl.int32) + (binf.to(tl.int32) << 10) + (half.to(tl.int32) << 20)
    # the ulp form and the claim of lemma 1 (ULP_NAMES), 10-bit fields of an int64
    ufin = U < float("inf")
    dist64 = dist.to(tl.float64)
    uviol = in_fin & ufin & ((~c_fin) | (~r_fin) | (dist64 > U))
    ule1 = both & (U <= 1.0)
    uatt = both & ufin & (dist64 == U)
    kdom = both & well
    kover = kdom & (dist > 1)
    fu = (uviol.to(tl.int64) + (ule1.to(tl.int64) << 10) + (uatt.to(tl.int64) << 20) + (kdom.to(tl.int64) << 30)
          + (kover.to(tl.int64) << 40))
    return p0, p1, fl, fu, kd, kr


@triton.jit
def _store(base, P0, P1, S, SU, KD, KR):
    """Reduce one variant's per-lane accumulators and store its N_STAT int64 at ``base``
    (layout :data:`STAT_NAMES`)."""
    lane16 = tl.arange(0, 16)
    h = tl.zeros([16], dtype=tl.int64)
    for j in tl.static_range(14):
        f = P0 if j < 7 else P1
        h = tl.where(lane16 == j, tl.sum((f >> (9 * (j % 7))) & 511, 0), h)
    tl.store(base + lane16, h)
    tl.store(base + 16, tl.sum((S & 1023).to(tl.int64), 0))
    tl.store(base + 17, tl.sum(((S >> 10) & 1023).to(tl.int64), 0))
    tl.store(base + 18, tl.sum(((S >> 20) & 1023).to(tl.int64), 0))
    for j in tl.static_range(5):
        tl.store(base + 19 + j, tl.sum((SU >> (10 * j)) & 1023, 0))
    tl.store(base + 24, tl.max(KD, 0))
    tl.store(base + 25, tl.max(KR, 0))


@triton.jit
def _compose_exhaustive_kernel(const_ptr, f32_ptr, stat_ptr, out_ptr, outf_ptr, start,
                               FMT: tl.constexpr, TILE: tl.constexpr, ITERS: tl.constexpr,
                               WRITE_OUT: tl.constexpr, NS: tl.constexpr, NC: tl.constexpr, NA: tl.constexpr,
                               NOUTF: tl.constexpr):
    """Program ``pid`` covers pair indices ``start + pid*ITERS*TILE + [0, ITERS*TILE)``.

    ``f32_ptr``: ``[g, s, gp, gm1p]`` fp32 (``gp = fl_fmt(g)``, ``gm1p = fl_fmt(fl32(gp - 1))``);
    ``const_ptr``: fp64 constants (:data:`CONST_NAMES` then :data:`ARITH_CONSTS` for fp32 and
    per_op); ``stat_ptr``: int64 ``[programs, 4, N_STAT]``; with ``WRITE_OUT`` (tests),
    ``out_ptr`` int32 ``[n, 5]`` patterns (4 variants, then the exact result) and ``outf_ptr``
    fp64 ``[n, NOUTF]``: the bounds of the 4 variants, their ulp bounds, ``kappa_c``.
    ``NS`` = :data:`N_STAT`, ``NC`` = ``len(CONST_NAMES)``, ``NA`` = ``len(ARITH_CONSTS)``.
    """
    EXPB: tl.constexpr = 8 if FMT == 0 else 5
    P: tl.constexpr = 8 if FMT == 0 else 11
    EXPMASK: tl.constexpr = ((1 << EXPB) - 1) << (P - 1)
    ONE_ULP_KAPPA: tl.constexpr = 16384.0 if FMT == 0 else 2048.0  # one_ulp_condition: 2^(22 - p)
    pid = tl.program_id(0)
    g32 = tl.load(f32_ptr + 0)
    s32 = tl.load(f32_ptr + 1)
    gp32 = tl.load(f32_ptr + 2)
    gm1p32 = tl.load(f32_ptr + 3)
    gm1_64 = tl.load(const_ptr + 1)
    ch = tl.load(const_ptr + 2)
    cl = tl.load(const_ptr + 3)
    s64 = tl.load(const_ptr + 4)
    g64 = tl.load(const_ptr + 0)
    err_up = tl.load(const_ptr + 6)
    # per-lane accumulators (ITERS <= 511 keeps every 9-bit field from overflowing)
    z64 = tl.zeros([TILE], dtype=tl.int64)
    z32 = tl.zeros([TILE], dtype=tl.int32)
    m64 = tl.full([TILE], -1, dtype=tl.int64)
    A0, A1, AS, AU, AD, AR = z64, z64, z32, z64, m64, m64
    B0, B1, BS, BU, BD, BR = z64, z64, z32, z64, m64, m64
    C0, C1, CS, CU, CD, CR = z64, z64, z32, z64, m64, m64
    D0, D1, DS, DU, DD, DR = z64, z64, z32, z64, m64, m64
    for it in range(ITERS):
        local = (pid.to(tl.int64) * ITERS + it) * TILE + tl.arange(0, TILE)
        idx = start + local
        bbits = ((idx >> 16) & 0xFFFF).to(tl.int32)
        lbits = (idx & 0xFFFF).to(tl.int32)
        in_fin = ((bbits & EXPMASK) != EXPMASK) & ((lbits & EXPMASK) != EXPMASK)
        b = _decode(bbits, FMT)
        lo = _decode(lbits, FMT)
        # --- computed, fp32 contract
        sl = s32 * lo
        t = g32 * sl
        gm1 = g32 - 1.0
        st32 = _round_f32(gm1 * b + t, FMT)
        inner = sl + b
        nv32 = _round_f32(g32 * inner - b, FMT)
        # --- computed, per op (fp32 op, then rounded to the format)
        slp = _decode(_round_f32(s32 * lo, FMT), FMT)
        tp = _decode(_round_f32(gp32 * slp, FMT), FMT)
        pp = _decode(_round_f32(gm1p32 * b, FMT), FMT)
        stp = _round_f32(pp + tp, FMT)
        innp = _decode(_round_f32(slp + b, FMT), FMT)
        Pp = _decode(_round_f32(gp32 * innp, FMT), FMT)
        nvp = _round_f32(Pp - b, FMT)
        # --- exact
        b64 = b.to(tl.float64)
        l64 = lo.to(tl.float64)
        T1 = gm1_64 * b64
        P1 = ch * l64
        P2 = cl * l64
        hh, l1 = _two_sum(T1, P1)
        mm, l2 = _two_sum(l1, P2)
        H, Lr = _two_sum(hh, mm)
        rho = Lr + l2
        H = tl.where(in_fin, H, 0.0)
        rho = tl.where(in_fin, rho, 0.0)
        ref = _round_f64(H, rho, FMT)
        # --- bounds, ulp bounds and the condition kappa_c of the sum (compose_condition)
        L = s64 * l64
        aL = tl.abs(L)
        ab = tl.abs(b64)
        Ac = tl.abs(gm1_64 * b64)
        Tc = tl.abs(g64 * L)
        Xt = tl.abs(gm1_64 * b64 + g64 * L)
        kappa = tl.where(Ac + Tc == 0.0, 1.0, (Ac + Tc) / Xt)
        well = kappa <= ONE_ULP_KAPPA
        B_st32, U_st32 = _bound(b64, L, aL, ab, Xt, const_ptr, NC, False, False, FMT)
        B_nv32, U_nv32 = _bound(b64, L, aL, ab, Xt, const_ptr, NC, True, False, FMT)
        B_stp, U_stp = _bound(b64, L, aL, ab, Xt, const_ptr, NC + NA, False, True, FMT)
        B_nvp, U_nvp = _bound(b64, L, aL, ab, Xt, const_ptr, NC + NA, True, True, FMT)
        if WRITE_OUT:
            o = out_ptr + local * 5
            tl.store(o + 0, st32)
            tl.store(o + 1, nv32)
            tl.store(o + 2, stp)
            tl.store(o + 3, nvp)
            tl.store(o + 4, ref)
            of = outf_ptr + local * NOUTF
            tl.store(of + 0, B_st32)
            tl.store(of + 1, B_nv32)
            tl.store(of + 2, B_stp)
            tl.store(of + 3, B_nvp)
            tl.store(of + 4, U_st32)
            tl.store(of + 5, U_nv32)
            tl.store(of + 6, U_stp)
            tl.store(of + 7, U_nvp)
            tl.store(of + 8, kappa)
        p0, p1, fl, fu, kd, kr = _stats(st32, ref, in_fin, H, rho, B_st32, U_st32, well, err_up, idx, FMT)
        A0, A1, AS, AU, AD, AR = A0 + p0, A1 + p1, AS + fl, AU + fu, tl.maximum(AD, kd), tl.maximum(AR, kr)
        p0, p1, fl, fu, kd, kr = _stats(nv32, ref, in_fin, H, rho, B_nv32, U_nv32, well, err_up, idx, FMT)
        B0, B1, BS, BU, BD, BR = B0 + p0, B1 + p1, BS + fl, BU + fu, tl.maximum(BD, kd), tl.maximum(BR, kr)
        p0, p1, fl, fu, kd, kr = _stats(stp, ref, in_fin, H, rho, B_stp, U_stp, well, err_up, idx, FMT)
        C0, C1, CS, CU, CD, CR = C0 + p0, C1 + p1, CS + fl, CU + fu, tl.maximum(CD, kd), tl.maximum(CR, kr)
        p0, p1, fl, fu, kd, kr = _stats(nvp, ref, in_fin, H, rho, B_nvp, U_nvp, well, err_up, idx, FMT)
        D0, D1, DS, DU, DD, DR = D0 + p0, D1 + p1, DS + fl, DU + fu, tl.maximum(DD, kd), tl.maximum(DR, kr)
    # layout [4 variants][N_STAT] (STAT_NAMES)
    base = stat_ptr + pid.to(tl.int64) * (4 * NS)
    _store(base + 0 * NS, A0, A1, AS, AU, AD, AR)
    _store(base + 1 * NS, B0, B1, BS, BU, BD, BR)
    _store(base + 2 * NS, C0, C1, CS, CU, CD, CR)
    _store(base + 3 * NS, D0, D1, DS, DU, DD, DR)
