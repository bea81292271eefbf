"""The tail of the factored row norm in one Triton launch.

From fp32 ``U = W A^T``, ``G = A A^T`` and ``base_sq = rowsum(W*W)``: ``cross = rowsum(B*U)``,
``ba = rowsum((B G) * B)``, the assembly ``sqrt_rn(base + 2s cross + s^2 ba)`` without contraction,
the cancellation guard (``kappa``, the bound ``rel`` of lemma 4', the float64 recompute of the rows
it flags) and, for the layer, the denominator of ``g = m / den`` with one device flag.  ``B G`` is an
fp32 dot, or (``OpConfig.tail_bg = "tensor_core"``) bf16 pieces of the tiles of ``B`` and ``G`` made in
registers (:func:`_split3`) and multiplied on tensor cores (:func:`_piece_dot`).  Within
:func:`~dora_num.numerics.bounds.factored_norm_bound` of the exact norm.  The kernel's arithmetic,
its blocks and its flag in full: docs/operator.md, "The norm's tail kernel".

References: tiles (``OpConfig.norm_tail_tiles``) from the sweep in ``data/gpu/tile_sweep.csv``
(``dora-num record tiles``, its ``norm_tail`` rows); bounds: lemma 4 (the terms), lemma 4' (the
guard's ``rel``) and lemma 5' (the float64 recompute) of docs/bounds.md; the guard's cost in
``data/gpu/guard_cost.csv``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...numerics.norm_posterior import KERNEL_FIELDS, PosteriorConstants
from ...numerics.split_products import BG_PIECES, TAIL_BG_EXACT_MIN
from ...numerics.standard_model import U64, gamma, up32
from ..config import OpConfig, get_config
from ..validation import FORMAT_NAMES
from ._common import fusion_opts, launcher, mul_rn, mul_rn64, new_buffer, row_block
from .norm_assembly import assemble

# the order in which the kernel loads the constants (numerics.norm_posterior.KERNEL_FIELDS), then
# the two float64 constants of the recompute
_ORDER = ("ts", "s2", "na_add", "na_mul", "na_up", "k_up", "r_eta", "cb1", "cb2", "gb", "gc4", "gc1", "tc", "gcr",
          "ga", "ga1", "gar", "eta", "q_s2", "q_u2", "q_u3", "q_eta", "lift", "floor", "lo", "up1", "u", "tg", "rc",
          "rab", "na_res", "na_up2", "tc_inv", "tg_inv2", "na_add_inv2", "rc_inv", "rab_inv", "na_res_inv")
assert _ORDER == KERNEL_FIELDS, "the kernel's constant layout must follow PosteriorConstants"
_EXACT_MIN = tl.constexpr(TAIL_BG_EXACT_MIN)  # fp32 values of B below it may not be held by three bf16 pieces


@triton.jit
def _c(gc, i: tl.constexpr):
    """Constant ``i`` of the guard's constants (a tuple of fp32 numbers, kernel arguments)."""
    return tl.cast(gc[i], tl.float32)


@triton.jit
def _posterior(base, cross, ba, lora_abs, b_abs, two_s, s_sq, ts, s2, cb1, cb2, gb, gc4, gc1, tc, gcr, ga, ga1, gar,
               eta, q_s2, q_u2, q_u3, q_eta, lift, floor, lo, up1, u, tg, rc, rab, SPLIT: tl.constexpr,
               RN: tl.constexpr):
    """``(kappa, rel)`` of :func:`dora_num.numerics.norm_bounds.posterior_from_terms`: the same
    fp32 operations in the same order (every product :func:`~dora_num.ops.kernels._common.mul_rn`, so
    never contracted whoever compiles the kernel; correctly rounded sqrt and division), on the constants
    of :func:`~dora_num.numerics.norm_bounds.posterior_constants`."""
    ab = tl.abs(base)
    aba = tl.abs(ba)
    Qh = mul_rn(s_sq, ba, RN) + (mul_rn(two_s, cross, RN) + base)
    tcr = tl.abs(mul_rn(ts, cross, RN))
    mag = ab + tcr + mul_rn(s_sq, aba, RN)
    b_up = mul_rn(ab + cb1, cb2, RN)
    e_b = mul_rn(b_up, gb, RN) + cb1
    if SPLIT:
        sb = tl.sqrt_rn(b_up)
        e_c = mul_rn(mul_rn(sb, lora_abs, RN), gc4, RN) + mul_rn(mul_rn(sb, b_abs, RN), rc, RN) \
            + mul_rn(mul_rn(b_abs, gc1, RN), tc, RN) + gcr
        e_a = mul_rn(mul_rn(lora_abs, lora_abs, RN), ga, RN) + mul_rn(mul_rn(b_abs, lora_abs, RN), rab, RN) \
            + mul_rn(mul_rn(mul_rn(b_abs, b_abs, RN), ga1, RN), tg, RN) \
            + mul_rn(mul_rn(b_abs + 1.0, gar, RN), eta, RN)
    else:
        e_c = mul_rn(mul_rn(tl.sqrt_rn(b_up), lora_abs, RN), gc4, RN) + mul_rn(mul_rn(b_abs, gc1, RN), tc, RN) + gcr
        e_a = mul_rn(mul_rn(lora_abs, lora_abs, RN), ga, RN) + mul_rn(mul_rn(mul_rn(b_abs, b_abs, RN), ga1, RN), tg, RN) \
            + mul_rn(mul_rn(b_abs + 1.0, gar, RN), eta, RN)
    dQ = e_b + mul_rn(e_c, ts, RN) + mul_rn(e_a, s2, RN) + mul_rn(aba, q_s2, RN) + mul_rn(aba, eta, RN) \
        + mul_rn(ab + mul_rn(s_sq, aba, RN), q_u2, RN) + mul_rn(tcr, q_u3, RN) + q_eta
    dQ = mul_rn(dQ, lift, RN) + floor
    Q_lo = mul_rn(Qh - dQ, lo, RN)
    ok = (tl.abs(dQ) < float("inf")) & (tl.abs(Qh) < float("inf")) & (Q_lo > 0.0)
    q = tl.math.div_rn(dQ, tl.where(ok, Q_lo, 1.0))
    rel = tl.where(ok, mul_rn(mul_rn(mul_rn(q, 0.5, RN), up1, RN) + u, lift, RN), float("inf"))
    pos = (tl.abs(Qh) < float("inf")) & (Qh > 0.0)
    kappa = tl.where(pos, tl.math.div_rn(mag, tl.where(pos, Qh, 1.0)), float("inf"))
    kappa = tl.where(mag == 0.0, 1.0, kappa)
    return kappa, rel, mag


@triton.jit
def _bf16_part(x):
    """``RN_bf16(x)`` as an fp32 tensor: the bit pattern rounded to its top 16 bits, ties to even (bf16 and fp32
    share the exponent range, so this is the correctly rounded bf16 value, subnormals and the overflow to
    infinity included); integer operations only, so every backend (the interpreter too) gives these bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split3(x, PIECES: tl.constexpr):
    """The greedy bf16 split ``x = P1 + P2 + P3 (+ what is left)`` of :func:`dora_num.ops.products.split_pieces`
    (``P_q = RN_bf16(R_{q-1})``, ``R_q = R_{q-1} - P_q``: each subtraction exact), as fp32 tensors holding bf16
    values; pieces past ``PIECES`` are zero."""
    p1 = _bf16_part(x)
    if PIECES == 1:
        return p1, tl.zeros_like(x), tl.zeros_like(x)
    r1 = x - p1
    p2 = _bf16_part(r1)
    if PIECES == 2:
        return p1, p2, tl.zeros_like(x)
    return p1, p2, _bf16_part(r1 - p2)


@triton.jit
def _piece_dot(b, g, acc, BF16_DOT: tl.constexpr):
    """``acc + b @ g`` for fp32 tiles holding bf16 values: exact products, fp32 accumulation; on tensor cores
    (``BF16_DOT``: the operands cast to bf16, exactly) or as an IEEE fp32 dot (the interpreter)."""
    if BF16_DOT:
        return tl.dot(b.to(tl.bfloat16), g.to(tl.bfloat16), acc, out_dtype=tl.float32)
    return tl.dot(b, g, acc, input_precision="ieee")


@triton.jit
def _lsb_exp(x):
    """Per element of a float64 tensor the exponent of its lowest set bit (``_NO_BITS`` for zeros), as
    :func:`dora_num.ops.guard._lsb_exponent`."""
    bits = x.to(tl.int64, bitcast=True)
    field = (bits >> 52) & 0x7FF
    sig = (bits & 0xFFFFFFFFFFFFF) | tl.where(field > 0, 0x10000000000000, 0)
    low = (sig & (-sig)).to(tl.float64)  # a power of two <= 2^52: exact
    tz = ((low.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023
    e = tl.where(field > 0, field - 1075, -1074) + tz
    return tl.where(x == 0.0, 1 << 20, e)


@triton.jit
def _pow2(q):
    """``2^q`` as float64 for int64 ``q``, clamped to [-1022, 960] (above, 2^53 times it stays finite:
    a "no constraint" that never overflows)."""
    qq = tl.minimum(tl.maximum(q, -1022), 960)
    return ((qq + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _f64(c: tl.constexpr):
    """The float64 constant ``c`` exactly: a Python float that fits fp32's normal range becomes an fp32 constant in
    Triton (``1 + 2^-30`` would be 1) unless it meets a float64 operand, which a ``mul_rn64`` argument does not."""
    return tl.full([], c, tl.float64)


@triton.jit
def _recompute_rows(need, rows, w_ptr, a_ptr, b_ptr, stride_wm, stride_wk, stride_ar, stride_ak, d_in, r, s, g_r,
                    g_d, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, RN: tl.constexpr):
    """``(w64, rel64)`` for the rows ``need`` of this program (zeros elsewhere): lemma 5', the
    arithmetic of :func:`dora_num.ops.guard.dense_rows_fp64` in float64, every element that float64 forms
    exactly charged nothing (the lowest set bits of B's row, A's column, W and s decide it)."""
    rows64 = rows.to(tl.int64)
    s64 = tl.cast(s, tl.float64)
    as64 = tl.abs(s64)
    q_s = _lsb_exp(tl.zeros([BLOCK_M], dtype=tl.float64) + s64)
    lim = _f64(9007199254740992.0 * (1.0 - 2.0**-40))  # 2^53, less the evaluation's few roundings
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float64)
    esq = tl.zeros([BLOCK_M], dtype=tl.float64)
    for c0 in range(0, d_in, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cmask = cols < d_in
        wv = tl.load(w_ptr + rows64[:, None] * stride_wm + cols[None, :] * stride_wk,
                     mask=need[:, None] & cmask[None, :], other=0.0).to(tl.float64)
        bav = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float64)
        bam = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float64)
        qB = tl.full([BLOCK_M], 1 << 20, tl.int64)
        qA = tl.full([BLOCK_D], 1 << 20, tl.int64)
        for k in range(0, r):
            bk = tl.load(b_ptr + rows64 * r + k, mask=need, other=0.0).to(tl.float64)
            ak = tl.load(a_ptr + k * stride_ar + cols * stride_ak, mask=cmask, other=0.0).to(tl.float64)
            prod = mul_rn64(bk[:, None], ak[None, :], RN)  # exact products; the sum rounds (any order: lemma 5')
            bav += prod
            bam += tl.abs(prod)  # |b a| = |b| |a|, exactly
            qB = tl.minimum(qB, _lsb_exp(bk))
            qA = tl.minimum(qA, _lsb_exp(ak))
        x = wv + mul_rn64(s64, bav, RN)
        sumsq += tl.sum(mul_rn64(x, x, RN), axis=1)
        q = tl.minimum(qB[:, None] + qA[None, :], 1 << 20)
        q_sx = tl.minimum(q + q_s[:, None], 1 << 20)
        sbam = mul_rn64(as64, bam, RN)
        exact = (bam < mul_rn64(lim, _pow2(q), RN)) & (sbam < mul_rn64(lim, _pow2(q_sx), RN)) \
            & (tl.abs(wv) + sbam < mul_rn64(lim, _pow2(tl.minimum(_lsb_exp(wv), q_sx)), RN))
        e = tl.where(exact, 0.0, mul_rn64(g_r, tl.abs(wv) + sbam, RN))
        esq += tl.sum(mul_rn64(e, e, RN), axis=1)
    w64 = tl.sqrt(sumsq)  # float64: sqrt.rn.f64
    en = mul_rn64(tl.sqrt(esq), _f64(1.0 + 2.0**-30), RN)
    rnd = tl.where(w64 >= 2.0**-126, mul_rn64(_f64(2.0**-24), w64, RN), tl.where(w64 > 0.0, 2.0**-150, 0.0))
    gw = mul_rn64(g_d, w64, RN)
    E = mul_rn64(en + gw + rnd, _f64(1.0 + 2.0**-40), RN)
    lo = mul_rn64(w64 - en - gw, _f64(1.0 - 2.0**-40), RN)
    rel = tl.where(lo > 0.0, E / tl.where(lo > 0.0, lo, 1.0), float("inf"))
    rel = tl.where((E == 0.0) & (w64 == 0.0), 0.0, rel)  # an exactly zero row: exact
    return w64, rel


@triton.jit
def _norm_tail_kernel(u_ptr, b_ptr, gram_ptr, base_ptr, m_ptr, wnorm_ptr, den_ptr, flag_ptr, aux_ptr,
                      zrow_ptr, acc_ptr, inv_ptr, w_ptr, a_ptr, stride_wm, stride_wk, stride_ar, stride_ak,
                      d_out, d_in, r, two_s, s_sq, s, eps, rel_max,
                      c0, c1, c2, c3, c4, c5, c6, c7, c8, c9,
                      c10, c11, c12, c13, c14, c15, c16, c17, c18, c19,
                      c20, c21, c22, c23, c24, c25, c26, c27, c28, c29,
                      c30, c31, c32, c33, c34, c35, c36, c37, c38, c39,
                      HAS_M: tl.constexpr, GUARD: tl.constexpr, HAS_Z: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_INV: tl.constexpr, RECOMPUTE: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, TC_BG: tl.constexpr = False,
                      B_PIECES: tl.constexpr = 3, BF16_DOT: tl.constexpr = True, RN: tl.constexpr = False):
    # the guard's constants arrive as 40 scalars, not one tuple: Inductor passes a wrapped kernel's non-tensor
    # arguments one by one (as sizes), which a tuple is not.  Inductor types a float argument float64 where
    # Triton's launcher types it float32: each is cast to float32 here (every value passed is an fp32 number, or
    # eps, which both round to nearest), so both launches compute with the same values
    two_s, s_sq, s = tl.cast(two_s, tl.float32), tl.cast(s_sq, tl.float32), tl.cast(s, tl.float32)
    eps, rel_max = tl.cast(eps, tl.float32), tl.cast(rel_max, tl.float32)
    gc = (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13,
          c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27,
          c28, c29, c30, c31, c32, c33, c34, c35, c36, c37, c38, c39)
    if GUARD:  # the constants of posterior_constants (KERNEL_FIELDS order)
        ts, s2 = _c(gc, 0), _c(gc, 1)
        na_add, na_mul, na_up, k_up, r_eta = _c(gc, 2), _c(gc, 3), _c(gc, 4), _c(gc, 5), _c(gc, 6)
        cb1, cb2, gb = _c(gc, 7), _c(gc, 8), _c(gc, 9)
        gc4, gc1, tc, gcr = _c(gc, 10), _c(gc, 11), _c(gc, 12), _c(gc, 13)
        ga, ga1, gar, eta = _c(gc, 14), _c(gc, 15), _c(gc, 16), _c(gc, 17)
        q_s2, q_u2, q_u3, q_eta = _c(gc, 18), _c(gc, 19), _c(gc, 20), _c(gc, 21)
        lift, floor, lo, up1, u = _c(gc, 22), _c(gc, 23), _c(gc, 24), _c(gc, 25), _c(gc, 26)
        tg, rc, rab, na_res, na_up2 = _c(gc, 27), _c(gc, 28), _c(gc, 29), _c(gc, 30), _c(gc, 31)
        if HAS_INV:  # fp16 split pieces: the parts that scale with the split's inv (runtime_constants)
            inv = tl.load(inv_ptr).to(tl.float32)
            tc = tc + (mul_rn(_c(gc, 32), inv, RN) + 2.0**-149)
            tg = tg + (mul_rn(mul_rn(_c(gc, 33), inv, RN) + 2.0**-149, inv, RN) + 2.0**-149)
            na_add = na_add + (mul_rn(mul_rn(_c(gc, 34), inv, RN) + 2.0**-149, inv, RN) + 2.0**-149)
            rc = mul_rn(_c(gc, 35), inv, RN) + 2.0**-149
            rab = mul_rn(_c(gc, 36), inv, RN) + 2.0**-149
            na_res = mul_rn(_c(gc, 37), inv, RN) + 2.0**-149
    rows, row_mask = row_block(d_out, BLOCK_M)
    row_off = rows.to(tl.int64)[:, None] * r
    cross = tl.zeros([BLOCK_M], dtype=tl.float32)
    ba = tl.zeros([BLOCK_M], dtype=tl.float32)
    lora_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    babs_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_tiny = tl.zeros([BLOCK_M], dtype=tl.int32)  # TC_BG, fp32 B: entries in (0, 2^-110), which 3 pieces may not hold
    for n0 in range(0, r, BLOCK_R):
        cols = n0 + tl.arange(0, BLOCK_R)
        col_mask = cols < r
        mask = row_mask[:, None] & col_mask[None, :]
        b_n = tl.load(b_ptr + row_off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u_n = tl.load(u_ptr + row_off + cols[None, :], mask=mask, other=0.0)
        cross += tl.sum(mul_rn(b_n, u_n, RN), axis=1)
        if GUARD:  # ||A_k|| from the diagonal of G (lora_row_magnitudes), then the two row sums
            g_nn = tl.load(gram_ptr + cols * r + cols, mask=col_mask, other=0.0)
            n_a = mul_rn(tl.sqrt_rn(mul_rn(tl.maximum(g_nn, 0.0) + na_add, na_mul, RN)), na_up, RN)
            if SPLIT:
                n_a = mul_rn(n_a + na_res, na_up2, RN)
            a_n = tl.abs(b_n)
            lora_acc += tl.sum(mul_rn(a_n, n_a[None, :], RN), axis=1)
            babs_acc += tl.sum(a_n, axis=1)
            if TC_BG and B_PIECES == 3:
                n_tiny += tl.sum(((a_n > 0.0) & (a_n < _EXACT_MIN)).to(tl.int32), axis=1)
        bg = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, r, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < r
            b_k = tl.load(b_ptr + row_off + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                          other=0.0).to(tl.float32)
            g_k = tl.load(gram_ptr + ks[:, None] * r + cols[None, :], mask=k_mask[:, None] & col_mask[None, :],
                          other=0.0)
            if TC_BG:  # B G on tensor cores: the piece products PB_p PG_q with p + q <= 4 (tail_bg_pairs' order)
                b1, b2, b3 = _split3(b_k, B_PIECES)
                g1, g2, g3 = _split3(g_k, 3)
                bg = _piece_dot(b1, g1, bg, BF16_DOT)
                bg = _piece_dot(b1, g2, bg, BF16_DOT)
                bg = _piece_dot(b1, g3, bg, BF16_DOT)
                if B_PIECES >= 2:
                    bg = _piece_dot(b2, g1, bg, BF16_DOT)
                    bg = _piece_dot(b2, g2, bg, BF16_DOT)
                if B_PIECES == 3:
                    bg = _piece_dot(b3, g1, bg, BF16_DOT)
            else:
                bg = tl.dot(b_k, g_k, bg, input_precision="ieee")
        ba += tl.sum(mul_rn(bg, b_n, RN), axis=1)
    base = tl.load(base_ptr + rows, mask=row_mask, other=0.0)
    w = assemble(base, cross, ba, two_s, s_sq, 1, RN)
    if GUARD:
        lora_abs = mul_rn(lora_acc, k_up, RN) + r_eta
        b_abs = mul_rn(babs_acc, k_up, RN)
        kappa, rel, mag = _posterior(base, cross, ba, lora_abs, b_abs, two_s, s_sq, ts, s2, cb1, cb2, gb, gc4, gc1,
                                     tc, gcr, ga, ga1, gar, eta, q_s2, q_u2, q_u3, q_eta, lift, floor, lo, up1, u,
                                     tg, rc, rab, SPLIT, RN)
        if TC_BG and B_PIECES == 3:  # a row the pieces may not hold: not certified (recomputed in float64)
            rel = tl.where(n_tiny > 0, float("inf"), rel)
        if HAS_Z:  # W's row exactly zero and B's too: Q^ = Q = 0 exactly, which the terms alone cannot tell
            z = tl.load(zrow_ptr + rows, mask=row_mask, other=0).to(tl.int32)
            rel = tl.where((z != 0) & (b_abs == 0.0), 0.0, rel)
        flagged = row_mask & (rel > rel_max)
        rel_out = rel
        unresolved = tl.zeros([BLOCK_M], dtype=tl.int1)
        if RECOMPUTE:
            # a non-finite factored value has rel = inf: recomputed too, since fp32 intermediates may overflow
            # where the norm fits (non-finite inputs stay non-finite in float64, and are reported)
            need = flagged
            if tl.max(need.to(tl.int32), axis=0) > 0:  # program-uniform: the fast path pays this test only
                g_r, g_d = tl.cast(gc[38], tl.float64), tl.cast(gc[39], tl.float64)
                w64, rel64 = _recompute_rows(need, rows, w_ptr, a_ptr, b_ptr, stride_wm, stride_wk, stride_ar,
                                             stride_ak, d_in, r, s, g_r, g_d, BLOCK_M, BLOCK_D, RN)
                w = tl.where(need, w64.to(tl.float32), w)
                rel64 = mul_rn64(rel64, _f64(1.0 + 2.0**-23), RN)
                rel_out = tl.where(need, rel64.to(tl.float32), rel_out)  # rounded: still a bound
                unresolved = need & (rel64 > rel_max)
                q64 = mul_rn64(w64, w64, RN)  # kappa from the fp32 terms' magnitude and the float64 norm
                k64 = tl.where(q64 > 0.0, mag.to(tl.float64) / tl.where(q64 > 0.0, q64, 1.0),
                               tl.where(mag == 0.0, 1.0, float("inf")))
                k64 = tl.maximum(k64, 1.0)  # kappa >= 1 (fp32 terms that underflowed to 0 give mag = 0)
                kappa = tl.where(need, k64.to(tl.float32), kappa)
        tl.store(aux_ptr + rows, kappa, mask=row_mask)
        tl.store(aux_ptr + d_out + rows, rel, mask=row_mask)
        tl.store(aux_ptr + 2 * d_out + rows, rel_out, mask=row_mask)
    tl.store(wnorm_ptr + rows, w, mask=row_mask)
    finite = tl.abs(w) < float("inf")  # False for NaN too
    if HAS_M:
        den = tl.where(w == 0.0, eps, w)  # eps guards zero rows only (NaN propagates)
        tl.store(den_ptr + rows, den, mask=row_mask)
        m = tl.load(m_ptr + rows, mask=row_mask, other=1.0).to(tl.float32)
        g = tl.math.div_rn(m, den)
        finite = finite & (tl.abs(g) < float("inf"))
    code = tl.where(finite, 0, 3)
    if GUARD:
        code = tl.maximum(code, tl.where(unresolved, 2, tl.where(flagged, 1, 0)))
        count = tl.sum(tl.where(flagged, 1, 0), axis=0)
    else:
        count = 0
    if HAS_M or GUARD:
        flag = tl.max(tl.where(row_mask, code, 0), axis=0) + 4 * count
        tl.store(flag_ptr + tl.program_id(0), flag)  # one slot per program: no zero-fill, no atomics
        if HAS_ACC:  # the caller's running flag (integer atomics: the result does not depend on their order)
            tl.atomic_max(acc_ptr, tl.cast(tl.max(tl.where(row_mask, code, 0), axis=0), tl.int64))
            tl.atomic_add(acc_ptr + 1, tl.cast(count, tl.int64))
            if tl.program_id(0) == 0:
                tl.atomic_add(acc_ptr + 2, tl.cast(1, tl.int64))


class TailResult(NamedTuple):
    """What :func:`norm_tail` returns (fields None where not asked for)."""

    wnorm: torch.Tensor  # fp32 [d_out]; with the guard and recompute: flagged rows recomputed in float64
    den: torch.Tensor | None  # with m: the denominator of g (wnorm, or eps where wnorm == 0)
    flag: torch.Tensor | None  # with m or guard: int32 [programs], 4 * flagged rows + the largest FLAG_* code
    aux: torch.Tensor | None  # with guard: fp32 [3, d_out], rows kappa, rel, rel_out (the properties below)

    @property
    def kappa(self):
        """The assembly's condition from the fp32 terms (recomputed rows: their magnitude over the
        float64 norm squared)."""
        return None if self.aux is None else self.aux[0]

    @property
    def rel(self):
        """Lemma 4': the guaranteed relative error bound of the factored value of each row."""
        return None if self.aux is None else self.aux[1]

    @property
    def rel_out(self):
        """The guaranteed relative error bound of the returned ``wnorm``: ``rel``, or on recomputed
        rows lemma 5' (rounded to fp32)."""
        return None if self.aux is None else self.aux[2]


def norm_tail(U: torch.Tensor, B: torch.Tensor, G: torch.Tensor, base_sq: torch.Tensor,
              two_s: float, s_sq: float, *, m: torch.Tensor | None = None, eps: float | None = None,
              guard: PosteriorConstants | None = None, rel_max: float | None = None,
              zero_rows: torch.Tensor | None = None, recompute: tuple | None = None,
              inv: torch.Tensor | None = None, acc: torch.Tensor | None = None,
              config: OpConfig | None = None, traced: bool = False) -> TailResult:
    """:class:`TailResult` ``(wnorm, den, flag, aux)``: fp32 ``[d_out]`` row norms; with ``m`` the
    denominator ``den`` of ``g = m / den`` (``wnorm``, or ``eps`` where ``wnorm == 0``: eps guards
    zero rows only); with ``guard`` (the constants of
    :func:`~dora_num.numerics.norm_bounds.posterior_constants` for these ``two_s``, ``s_sq``,
    ``d_in``, ``r`` and product model; ``inv``: the split's run-time scale, a 0-dim fp32 tensor,
    where the constants need it) the per-row condition ``kappa`` and guaranteed relative error
    bound ``rel`` of lemma 4' (docs/bounds.md) in ``aux``; ``zero_rows`` (bool ``[d_out]``, with
    ``guard``): rows of W known to be exactly zero, whose ``rel`` is 0 where B's row is zero too
    (the norm is then exactly 0); ``recompute = (W, A, s)`` (with ``guard``; ``s`` the fp32
    scale of :func:`~dora_num.numerics.formulas.scale_constants`): rows with ``rel > rel_max``
    (and a finite factored value) are recomputed in float64 from ``W`` and ``A`` in the kernel
    (module docstring), their bound in ``aux[2]`` (``rel_out``).

    ``flag`` (with ``m`` or ``guard``): an int32 device tensor with one entry per program
    (``ceil(d_out / block_m)``), each ``4 n + c``: ``n`` the rows of the program the guard flagged
    (recomputed, with ``recompute``) and ``c`` the largest code of its rows,
    :data:`~dora_num.ops.guard.FLAG_NONFINITE` (3) where ``wnorm`` or ``m / den`` is not finite, else
    :data:`~dora_num.ops.guard.FLAG_UNRESOLVED` (2) where a recomputed row still has ``rel_out >
    rel_max``, else :data:`~dora_num.ops.guard.FLAG_CANCELLATION` (1) where a row was flagged, else
    :data:`~dora_num.ops.guard.FLAG_OK` (0) (:func:`dora_num.ops.guard.decode`).

    ``acc`` (int64 ``[3]``, optional): a running flag the kernel updates with integer atomics
    (whose order does not change the result): the largest code, the rows flagged, the calls, since
    it was last reset (how a compiled layer keeps its flag: :func:`dora_num.ops.finite.check_flags`).

    ``U`` fp32 ``[d_out, r]``, ``B`` ``[d_out, r]`` (fp32, bf16 or fp16), ``G`` fp32
    ``[r, r]``, ``base_sq`` and ``m`` ``[d_out]`` (``m`` fp32, bf16 or fp16), ``W`` ``[d_out, d_in]``
    and ``A`` ``[r, d_in]`` (fp32, bf16 or fp16, any strides), all on one device; ``two_s``,
    ``s_sq`` from :func:`~dora_num.numerics.formulas.scale_constants`.  No value checks (the flag
    is the check).  ``config`` (default :func:`~dora_num.ops.config.get_config`): the tiles
    (``norm_tail_tiles``, whose ``block_m`` is the program count's divisor), ``poison`` and ``tail_bg``
    (``"tensor_core"``: ``B G`` from bf16 pieces of ``B`` and ``G`` on tensor cores, the piece products of
    :func:`~dora_num.numerics.split_products.tail_bg_pairs`; the guard's constants must be made for it,
    ``guard.tail_bg`` B's format; under the interpreter the same pieces in an IEEE fp32 dot).  ``traced``: the
    body of a ``triton_op`` that Inductor traces (:mod:`dora_num.ops.weight_norm`): the checks above run once,
    while tracing, and Inductor's code launches the kernel (compiled with contraction on, which its ``mul_rn``
    makes harmless: tests/ops/kernels/test_sm90.py).
    """
    d_out, r = B.shape
    floats = (torch.float32, torch.bfloat16, torch.float16)
    specs = [("U", U, (d_out, r), (torch.float32,)),
             ("B", B, (d_out, r), floats),
             ("G", G, (r, r), (torch.float32,)),
             ("base_sq", base_sq, (d_out,), (torch.float32,))]
    if m is not None:
        specs.append(("m", m, (d_out,), floats))
    if zero_rows is not None:
        specs.append(("zero_rows", zero_rows, (d_out,), (torch.bool,)))
    if recompute is not None:
        W, A, s = recompute
        specs += [("W", W, (d_out, W.shape[1] if W.dim() == 2 else -1), floats),
                  ("A", A, (r, W.shape[1] if W.dim() == 2 else -1), floats)]
    if inv is not None:
        specs.append(("inv", inv, (), (torch.float32,)))
    if acc is not None:
        specs.append(("acc", acc, (3,), (torch.int64,)))
    for name, t, shape, dtypes in specs:
        if t.dtype not in dtypes or tuple(t.shape) != shape or t.device != B.device:
            raise ValueError(f"norm_tail: {name} must be {shape} of {dtypes} on {B.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if m is not None and eps is None:
        raise ValueError("norm_tail: eps is required with m")
    if guard is not None:
        if rel_max is None:
            raise ValueError("norm_tail: rel_max is required with guard")
        if (guard.two_s, guard.s_sq) != (float(two_s), float(s_sq)):
            raise ValueError("norm_tail: guard constants were made for other two_s, s_sq")
        if guard.inv_runtime and inv is None:
            raise ValueError("norm_tail: these guard constants (fp16 split pieces) need the split's inv")
    elif recompute is not None:
        raise ValueError("norm_tail: recompute needs guard")
    cfg = get_config() if config is None else config
    tc_bg = cfg.tail_bg == "tensor_core"
    if guard is not None and guard.tail_bg != (FORMAT_NAMES[B.dtype] if tc_bg else None):
        how = f"on tensor cores from {FORMAT_NAMES[B.dtype]} B" if tc_bg else "as an fp32 dot"
        raise ValueError(f"norm_tail: the guard constants were made for tail_bg={guard.tail_bg!r}, but this launch "
                         f"forms B G {how}")
    tiles = cfg.norm_tail_tiles
    dev = B.device
    U, B, G, base_sq = (t if t.is_contiguous() else t.contiguous() for t in (U, B, G, base_sq))
    if m is not None and not m.is_contiguous():
        m = m.contiguous()
    wnorm = new_buffer((d_out,), torch.float32, dev, cfg.poison)
    den = new_buffer((d_out,), torch.float32, dev, cfg.poison) if m is not None else None
    n_programs = triton.cdiv(d_out, tiles.block_m)
    flag = new_buffer((n_programs,), torch.int32, dev, cfg.poison) if m is not None or guard is not None else None
    aux = new_buffer((3, d_out), torch.float32, dev, cfg.poison) if guard is not None else None
    if d_out:
        block_r = max(16, min(tiles.block_r, triton.next_power_of_2(r)))
        block_k = max(16, min(tiles.block_k, triton.next_power_of_2(r)))
        if recompute is not None:
            d_in = W.shape[1]
            sw, sa = W.stride(), A.stride()
        else:
            W = A = U
            d_in, s, sw, sa = 0, 0.0, (0, 0), (0, 0)
        # a pointer the kernel does not use points at an input (U), never at an output: Inductor's analysis of
        # what a wrapped kernel writes then has no output aliased by an unused argument
        launcher(_norm_tail_kernel, traced)[(n_programs,)](
            U, B, G, base_sq, m if m is not None else U,
            wnorm, den if den is not None else U, flag if flag is not None else U,
            aux if aux is not None else U, zero_rows if zero_rows is not None else U,
            acc if acc is not None else U, inv if inv is not None else U, W, A, sw[0], sw[1], sa[0], sa[1],
            d_out, d_in, r, float(two_s), float(s_sq), float(s), float(eps if eps is not None else 0.0),
            float(rel_max if rel_max is not None else 0.0), *_constants(guard, d_in),
            HAS_M=m is not None, GUARD=guard is not None, HAS_Z=zero_rows is not None and guard is not None,
            SPLIT=guard is not None and guard.split, HAS_INV=guard is not None and guard.inv_runtime,
            RECOMPUTE=recompute is not None, HAS_ACC=acc is not None, BLOCK_M=tiles.block_m,
            BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_D=tiles.block_d, TC_BG=tc_bg,
            B_PIECES=BG_PIECES[FORMAT_NAMES[B.dtype]], BF16_DOT=not cfg.interpret, RN=not cfg.interpret,
            num_warps=tiles.num_warps, **fusion_opts(False, traced),
        )
    return TailResult(wnorm, den, flag, aux)


def _constants(guard: PosteriorConstants | None, d_in: int) -> tuple:
    """The guard's constants as kernel arguments: the fp32 numbers of
    :data:`~dora_num.numerics.norm_posterior.KERNEL_FIELDS`, then ``gamma_{r+1}`` and ``gamma_{d_in+2}``
    of the float64 recompute (lemma 5', as :func:`dora_num.ops.guard.dense_rows_fp64`; ``r`` from
    ``guard.r_eta``) rounded up to fp32 (still bounds).  Scalars, not a device tensor: a launch then
    needs no host-to-device copy and no cached device state (CUDA-graph capture, torch.compile)."""
    return _constants_cached(guard, int(d_in))


@functools.lru_cache(maxsize=256)
def _constants_cached(guard, d_in: int) -> tuple:
    if guard is None:
        return (0.0,) * (len(_ORDER) + 2)
    r = round(guard.r_eta / 2.0**-149)
    return tuple(float(getattr(guard, f)) for f in _ORDER) + (up32(float(gamma(r + 1, U64))),
                                                              up32(float(gamma(d_in + 2, U64))))
