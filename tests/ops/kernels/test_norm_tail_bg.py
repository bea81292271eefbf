"""The norm tail's ``B G`` on tensor cores (``OpConfig.tail_bg = "tensor_core"``;
:mod:`dora_num.ops.kernels.norm_tail`, docs/bounds.md "The tail's B G on tensor cores").

On the CPU the kernel runs under the Triton interpreter, whose bf16 ``tl.dot`` is not an
arithmetic one (its operands' bits are misread), so there the same pieces enter an IEEE fp32
dot (exact products of 8-bit significands, fp32 accumulation): an instance of the model the
bound charges.  What the CPU checks: the in-register split against the exact emulation of
:func:`dora_num.ops.products.split_pieces` bit for bit over every binade and the edges of
fp32; the assembly and the guard bitwise on exact sums; the norm within lemma 4's bound for
this product model over the domain classes of tests/numerics/test_bounds_domain.py (exact
ground truth in rationals, none of it from the code under test), and the guard's ``rel``
above the actual error there; a bound not vacuous where the pieces matter; rows of an fp32 B
that the pieces may not hold uncertified.  On CUDA (``gpu``) the same checks run on the
tensor cores.
"""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import mpmath
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
from dora_num.numerics.formulas import norm_assembly, scale_constants
from dora_num.numerics.norm_bounds import factored_norm_bound, posterior_constants
from dora_num.numerics.split_products import split_pieces_np, tail_bg_pairs, tail_bg_uncertified_rows
from dora_num.ops.config import get_config, override
from dora_num.ops.guard import CANCELLATION_REL
from dora_num.ops.kernels.norm_tail import _split3, norm_tail
from dora_num.ops.norm import _products, factored_row_norm, tail_kernel
from dora_num.ops.validation import FORMAT_NAMES

from numerics._exact_ref import exact_row_norm_sq, norm_within
from numerics.test_bounds_domain import NORM_CASES, _rows, _t
from .helpers import (DEVICES, assert_bitwise, assert_tail_bitwise_lemma_4_prime, exact_tail_inputs,
                      exact_tail_terms)
from .test_norm_tail import _one_hot_tail_inputs



@triton.jit
def _split_kernel(x_ptr, p_ptr, n, PIECES: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    p1, p2, p3 = _split3(tl.load(x_ptr + i, mask=mask, other=0.0), PIECES)
    tl.store(p_ptr + i, p1, mask=mask)
    tl.store(p_ptr + n + i, p2, mask=mask)
    tl.store(p_ptr + 2 * n + i, p3, mask=mask)


def _edge_values() -> np.ndarray:
    """fp32 values over every binade (random significands), ties of the bf16 rounding (odd and even),
    values that round up a binade or to infinity, subnormals, signed zeros."""
    rng = np.random.default_rng(3)
    e = np.arange(-149, 128)
    sig = rng.integers(0, 2**23, e.size)
    vals = [np.ldexp(1 + sig / 2.0**23, e).astype(np.float32)]
    for lo in (0x7FFF, 0x8000, 0x8001, 0x18000, 0xFFFF):  # the low 16 bits: below, at, above a tie; tie to even
        bits = (rng.integers(0x00000001, 0x7F7F0000, 256).astype(np.uint32) & 0xFFFF0000) | lo
        vals.append(bits.view(np.float32))
    vals.append(np.array([0.0, -0.0, 3.4028235e38, 3.39e38, 1e-45, 2.0**-126, 2.0**-133, 1.5 * 2.0**-133,
                          2.0**-110, 2.0**-111 * 1.2345], dtype=np.float32))
    out = np.concatenate(vals)
    out = np.concatenate([out, -out])
    return out[np.isfinite(out)].astype(np.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_register_split_is_the_greedy_bf16_split_bit_for_bit(device, pieces):
    """``_split3``'s pieces are those of :func:`split_pieces_np` (``RN_bf16`` of each residual, ties to
    even, subnormals and the overflow to infinity of values above bf16's largest) on every value."""
    x = _edge_values()
    want, _ = split_pieces_np(x.astype(np.float64), "bf16", 3)
    xt = torch.from_numpy(x).to(device)
    out = torch.empty(3 * x.size, dtype=torch.float32, device=device)
    _split_kernel[(triton.cdiv(x.size, 256),)](xt, out, x.size, PIECES=pieces, BLOCK=256)
    got = out.view(3, -1).cpu().double().numpy()
    with np.errstate(invalid="ignore"):
        for q in range(3):
            ref = want[q] if q < pieces else np.zeros_like(x, dtype=np.float64)
            same = (got[q] == ref) | (np.isnan(got[q]) & np.isnan(ref))
            assert same.all(), (q, x[~same][:5], got[q][~same][:5], ref[~same][:5])
    # the values three pieces hold exactly: every fp32 value of at least 2^-110 (and the bf16-overflowing
    # ones excepted, whose first piece is infinite)
    if pieces == 3:
        held = (np.abs(x) >= 2.0**-110) & (np.abs(x) < (2 - 2.0**-8) * 2.0**127)
        assert (got.sum(axis=0)[held] == x[held]).all()


@pytest.mark.parametrize("device,d_out,r", [pytest.param(d.values[0], n, r, id=f"{d.id}-{n}x{r}", marks=d.marks)
                                            for d in DEVICES for n, r in ((3, 7), (63, 40), (100, 65))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_tensor_core_tail_bitwise_on_exact_sums(device, d_out, r, dtype):
    """Small integers: every piece product and sum is exact in any order, so the tensor-core ``B G`` is
    the exact one and the assembly bitwise torch's; on one-hot rows of B (the guard's row magnitudes
    exact too) the guard's ``kappa`` and ``rel`` are bitwise ``posterior_from_terms`` on the constants
    made for this tail (``tail_bg``); constants made for the other tail are refused."""
    fmt = FORMAT_NAMES[dtype]
    U, B, G, base = exact_tail_inputs(d_out, r, dtype, device=device)
    with override(tail_bg="tensor_core") as cfg:
        t = norm_tail(U, B, G, base, 1.0, 0.25, config=cfg)
    cross, ba = exact_tail_terms(U, B, G)
    assert_bitwise(t.wnorm, norm_assembly(TorchFP32CorrectSqrt, base, cross, ba, 1.0, 0.25))
    U, B, G, base = _one_hot_tail_inputs(d_out, r, device)
    B = B.to(dtype)
    C = posterior_constants(1.0, 0.25, d_in=300, r=r, tensor_core_products=True, tail_bg=fmt)
    with override(tail_bg="tensor_core") as cfg:
        t = norm_tail(U, B, G, base, 1.0, 0.25, guard=C, rel_max=CANCELLATION_REL, config=cfg)
        with pytest.raises(ValueError, match="tail_bg=None"):
            norm_tail(U, B, G, base, 1.0, 0.25, guard=posterior_constants(1.0, 0.25, d_in=300, r=r),
                      rel_max=CANCELLATION_REL, config=cfg)
    assert_tail_bitwise_lemma_4_prime(t, U, B, G, base, C)
    assert C.ga > posterior_constants(1.0, 0.25, d_in=300, r=r, tensor_core_products=True).ga  # it charges more
    with pytest.raises(ValueError, match=f"tail_bg='{fmt}'"):
        norm_tail(U, B, G, base, 1.0, 0.25, guard=C, rel_max=CANCELLATION_REL)  # the default config: the fp32 dot


def _bare_tc(W, A, B, s, device):
    with override(norm_tail="triton", tail_bg="tensor_core"):
        return factored_row_norm(W.to(device), A.to(device), B.to(device), s, on_cancellation="off", check=False)


def _domain_cases():
    out = []
    for d in DEVICES:
        for c in NORM_CASES:
            for b_dtype in (torch.float32, torch.bfloat16, torch.float16):
                if b_dtype == torch.float16 and c in ("underflow_squares", "subnormal_entries", "products_underflow"):
                    continue  # B of 1e-24 or 1e22: beyond fp16, the class would not be what it says
                out.append(pytest.param(d.values[0], c, b_dtype, id=f"{d.id}-{c}-{FORMAT_NAMES[b_dtype]}", marks=d.marks))
    return out


@pytest.mark.parametrize("device,case,b_dtype", _domain_cases())
def test_tensor_core_tail_within_lemma_4_over_the_domain(device, case, b_dtype, record):
    """The bare factored norm with the tensor-core tail is within ``factored_norm_bound(tail_bg=B's format)``
    of the exact norm (rationals) on every row of each domain class, with B in fp32, bf16 and fp16 (B's
    values rounded to it, the bound and the exact norm of the rounded values), or has no finite bound where
    it overflows; never NaN.  (fp32 W: U and G are IEEE fp32 products on either device, the model the bound
    is evaluated for.)"""
    rng = np.random.default_rng([5, NORM_CASES.index(case)])
    W, A, B, s = _rows(case, rng)
    Bd = _t(B).to(b_dtype)
    B = Bd.double().numpy()
    assert np.isfinite(B).all()
    q = exact_row_norm_sq(W, A, B, s)
    bound = factored_norm_bound(W, A, B, s, tail_bg=FORMAT_NAMES[b_dtype])
    assert not np.isnan(bound).any()
    worst, n_inf = 0.0, 0
    for j in range(W.shape[0]):
        w = float(_bare_tc(_t(W[j:j + 1]), _t(A), Bd[j:j + 1], s, device)[0])
        if not math.isfinite(w) or math.isinf(bound[j]):
            assert math.isinf(bound[j]), (case, j, w)
            n_inf += 1
            continue
        assert norm_within(w, bound[j], q[j]), (case, j, w, bound[j])
        with mpmath.workdps(60):
            ex = mpmath.sqrt(mpmath.mpf(q[j].numerator) / q[j].denominator)
            worst = max(worst, float(abs(mpmath.mpf(w) - ex) / bound[j]) if bound[j] > 0 else 0.0)
    record("tail_bg_bounds", case=f"{case} {FORMAT_NAMES[b_dtype]}", ratio_err_over_bound=worst, n_rows=W.shape[0],
           n_no_bound=n_inf)
    if case != "near_overflow":
        assert n_inf == 0


def test_tensor_core_tail_bound_is_not_vacuous_and_one_piece_would_break_it(record):
    """W = 0, so the norm is ``|s| sqrt(ba)`` and ``ba``'s error is all there is: ``B G`` from B's first piece
    alone (B rounded to bf16, what a tensor-core product of a cast B would give) is far outside the bound on
    every row, so the bound charges what the pieces keep.  (The interpreter's accumulation rounds to
    nearest, the bound charges truncation in any order: the measured error over the bound is recorded, not
    held to a floor; the emulated truncating accumulator of tests/ops/test_split_products.py reaches 0.32 of
    the same kind of bound.)"""
    rng = np.random.default_rng(11)
    d, r, rows = 256, 48, 64
    A = np.abs(rng.standard_normal((r, d))).astype(np.float32) / 16  # positive factors: no cancellation in B A,
    B = rng.uniform(0.5, 1.0, (rows, r)).astype(np.float32)  # so the bound's magnitudes are the norm's own;
    B = (split_pieces_np(B, "bf16", 1)[0][0] + rng.uniform(0.1, 0.4, B.shape) * 2.0**-9).astype(np.float32)
    # B's values 0.1-0.4 of a bf16 unit above the bf16 grid: its first piece alone is low in every entry
    W = np.zeros((rows, d), dtype=np.float32)
    q = exact_row_norm_sq(W, A, B, 1.0)
    bound = factored_norm_bound(W, A, B, 1.0, tail_bg="fp32")
    w = _bare_tc(torch.from_numpy(W), torch.from_numpy(A), torch.from_numpy(B), 1.0, "cpu").double().numpy()
    with mpmath.workdps(40):
        ex = np.array([float(mpmath.sqrt(mpmath.mpf(x.numerator) / x.denominator)) for x in q])
    assert all(norm_within(float(w[j]), bound[j], q[j]) for j in range(rows))
    one_piece = B.astype(np.float64)
    one_piece = split_pieces_np(one_piece, "bf16", 1)[0][0]
    wrong = np.linalg.norm(one_piece @ A.astype(np.float64), axis=1)
    assert (np.abs(wrong - ex) > 4 * bound).all()
    record("tail_bg_tightness", case="positive factors, W = 0",
           ratio_err_over_bound=float((np.abs(w - ex) / bound).max()),
           one_piece_over_bound=float((np.abs(wrong - ex) / bound).min()))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_the_pieces_may_not_hold_are_not_certified(device):
    """An fp32 B row with an entry in (0, 2^-110) gets ``rel = inf`` on this tail (its pieces may leave up to
    2^-134 of it, which lemma 4' has no per-row term for) and is recomputed in float64; the fp32 dot and
    a bf16 B certify the same rows."""
    rng = np.random.default_rng(4)
    d, r, rows = 64, 16, 8
    W = torch.from_numpy(rng.standard_normal((rows, d)).astype(np.float32) / 8).to(device)
    A = torch.from_numpy(rng.standard_normal((r, d)).astype(np.float32) / 8).to(device)
    B = torch.from_numpy(rng.standard_normal((rows, r)).astype(np.float32) * 1e-2).to(device)
    B[1, 3], B[5, 0] = 1e-35, -3e-36
    tiny = torch.from_numpy(tail_bg_uncertified_rows(B.cpu().numpy()))
    assert tiny.tolist() == [i in (1, 5) for i in range(rows)]
    exact = np.sqrt([float(x) for x in exact_row_norm_sq(W.cpu().double().numpy(), A.cpu().double().numpy(),
                                                            B.cpu().double().numpy(), 0.5)])
    for tail_bg, dtype in (("tensor_core", torch.float32), ("fma", torch.float32), ("tensor_core", torch.bfloat16)):
        with override(norm_tail="triton", tail_bg=tail_bg):
            cfg = get_config()
            base = (W.double() ** 2).sum(1).float()
            t = tail_kernel(W, A, B.to(dtype), _products(W, A, None, cfg), base, scale_constants(0.5), cfg)
        expect_inf = tiny if (tail_bg, dtype) == ("tensor_core", torch.float32) else torch.zeros(rows, dtype=torch.bool)
        assert (torch.isinf(t.rel.cpu()) == expect_inf).all(), (tail_bg, dtype, t.rel)
        if dtype == torch.float32:  # the returned norm within its stated bound (rel_out: lemma 5' where recomputed)
            w, rel_out = t.wnorm.cpu().double().numpy(), t.rel_out.cpu().double().numpy()
            assert np.isfinite(rel_out).all() and (np.abs(w - exact) <= rel_out * exact * (1 + 1e-12)).all()
            if tail_bg == "tensor_core":
                assert (rel_out[tiny.numpy()] <= 2.0**-23).all()  # recomputed in float64, rounded once to fp32


@pytest.mark.parametrize("case", [c for c in NORM_CASES if c != "near_overflow"])
def test_tensor_core_tail_guard_rel_bounds_the_actual_error(case):
    """Lemma 4' with this tail's constants: wherever the kernel's ``rel`` is finite it bounds the bare factored
    value's relative error against the exact norm (rationals)."""
    rng = np.random.default_rng([6, NORM_CASES.index(case)])
    W, A, B, s = _rows(case, rng)
    q = exact_row_norm_sq(W, A, B, s)
    Wt, At, Bt = _t(W), _t(A), _t(B)
    with override(norm_tail="triton", tail_bg="tensor_core"):
        cfg = get_config()
        base = (Wt * Wt).sum(1)
        t = tail_kernel(Wt, At, Bt, _products(Wt, At, None, cfg), base, scale_constants(s), cfg, guard=True)
        bare = factored_row_norm(Wt, At, Bt, s, base_sq=base, on_cancellation="off", check=False)
    checked = 0
    for j in range(W.shape[0]):
        rj, wj = float(t.rel[j]), float(bare[j])
        if math.isinf(rj):
            continue
        checked += 1
        assert (Fr(wj) / (1 + Fr(rj))) ** 2 <= q[j], (case, j, wj, rj)
        if rj < 1:
            assert q[j] <= (Fr(wj) / (1 - Fr(rj))) ** 2, (case, j, wj, rj)
    if case == "realistic":
        assert checked == W.shape[0]


def test_pairs_the_kernel_sums():
    """The kernel's piece products (the order of its dots) are ``tail_bg_pairs``: all of B's pieces against all
    of G's up to ``p + q <= 4``."""
    assert tail_bg_pairs("fp32") == (((1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (3, 1)), ((2, 3), (3, 2), (3, 3)))
    assert tail_bg_pairs("fp16") == (((1, 1), (1, 2), (1, 3), (2, 1), (2, 2)), ((2, 3),))
    assert tail_bg_pairs("bf16") == (((1, 1), (1, 2), (1, 3)), ())


@pytest.mark.parametrize("device", DEVICES)
def test_the_residual_of_gs_pieces_is_charged_and_nearly_reached(device):
    """A Gram entry that G's three bf16 pieces cannot hold: ``A = [15, 2] 2^-67`` gives ``G = 229 2^-134``, a tie
    on bf16's subnormal grid, so the pieces keep ``228 2^-134`` and leave ``sigma = 2^-134``; with ``B = 2^50``
    (bf16) and ``W = 0`` the norm is ``sqrt(B G B)``, off by 1/458 relative.  The guard's ``rel`` (the ``sigma`` of
    ``tg``) bounds it and is within 2% of it: without that term no bound holds (a hostile review's case).  G's
    first piece, ``114 2^-133``, is subnormal in bf16: on CUDA this also holds the tensor core to keeping
    subnormal bf16 inputs, which the model assumes (one that flushed them would lose the whole norm here)."""
    W = torch.zeros(1, 2, device=device)
    A = torch.tensor([[15.0, 2.0]], device=device) * 2.0**-67
    B = torch.tensor([[2.0**50]], device=device, dtype=torch.bfloat16)
    with override(norm_tail="triton", tail_bg="tensor_core"):
        cfg = get_config()
        prod = _products(W, A, None, cfg)
        assert float(prod.G[0, 0]) == 229 * 2.0**-134
        t = tail_kernel(W, A, B, prod, torch.zeros(1, device=device), scale_constants(1.0), cfg)
    exact = math.sqrt(229) * 2.0**-67 * 2.0**50
    err = abs(float(t.wnorm[0]) - exact) / exact
    rel = float(t.rel[0])
    assert abs(err - (1 - math.sqrt(228 / 229))) < 1e-6  # the piece's residual, nothing else
    assert 0.98 * rel < err <= rel
