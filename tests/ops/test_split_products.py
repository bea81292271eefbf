"""The factored norm's products with a 16-bit W and an fp32 A, through a split of A.

Ladder: (1) :func:`dora_num.ops.norm.split_pieces` against its exact emulation
:func:`dora_num.numerics.split_products.split_pieces_np`, bit for bit, over the whole fp32
range (subnormals, values near fp32's max, zeros); (2) the split's residual as the docstring
states it (zero for three bf16 pieces and ``|A| >= 2^-110``); (3) ``U = W A^T`` and
``G = A A^T`` from :func:`~dora_num.ops.norm.split_mm` / :func:`~dora_num.ops.norm.split_gram`
with an emulated tensor core (exact products, fp32 accumulation truncated toward zero, left to
right, subnormals flushed: an accumulator at the edge of the bound's model) against exact values,
within :func:`~dora_num.numerics.split_products.split_u_error` / ``split_gram_error``;
(4) the whole factored norm on those products within
``factored_norm_bound(..., split_pieces=p)``; (5) on the GPU, the production products; (6) the norm tail's
``B G`` from bf16 pieces of both factors (:func:`~dora_num.ops.products.split_bg`), the same ladder.

Exact references: the fp64 products of bf16/fp16 and fp32 values are exact (<= 35 bits);
their fp64 sums carry at most ``gamma64_d`` of the magnitudes, added to every tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dora_num as dn
from dora_num.numerics.bounds import factored_norm_bound
from dora_num.numerics.formulas import norm_assembly, scale_constants
from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
from dora_num.numerics.split_products import (mm_truncating_fp32, split_gram_error, split_pieces_np,
                                              split_residual, split_u_error)
from dora_num.ops.norm import _torch_tail_terms, split_gram, split_mm, split_pieces

U64 = 2.0**-53
FMTS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _gamma64(n):
    return n * U64 / (1 - n * U64)


def _emulated_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(mm_truncating_fp32(a.double().numpy(), b.double().numpy())).float()


def _adapter(regime: str, r: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    A = (torch.rand(r, d, generator=gen) * 2 - 1) / math.sqrt(d)
    if regime == "kaiming":
        return A
    if regime == "wide_exponents":  # every binade from 2^-149 to 2^100, signs mixed
        e = torch.randint(-149, 101, (r, d), generator=gen).float()
        return (torch.sign(A) * torch.ldexp(1 + torch.rand(r, d, generator=gen), e)).float()
    if regime == "tiny":  # fp32 subnormals and the bottom of the normal range
        return A * 2.0**-120
    if regime == "huge":  # near fp32's max but within bf16's (3.39e38)
        return A.sign() * (3.0e38 * (0.5 + 0.5 * torch.rand(r, d, generator=gen)))
    if regime == "zeros_and_ties":
        A[0] = 0.0
        A[1 % r, ::2] = 1 + 2.0**-8  # a bf16 tie (odd lower neighbour)
        A[1 % r, 1::2] = -(1 + 3 * 2.0**-9)
        return A
    raise ValueError(regime)


REGIMES = ["kaiming", "wide_exponents", "tiny", "huge", "zeros_and_ties"]


@pytest.mark.parametrize("pieces", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("regime", REGIMES)
def test_split_pieces_bitwise_as_emulated(regime, dtype, pieces):
    A = _adapter(regime, 5, 97, seed=1)
    P, inv = split_pieces(A, dtype, pieces)
    P_np, inv_np = split_pieces_np(A.numpy(), FMTS[dtype], pieces)
    assert P.shape == (pieces, 5, 97) and P.dtype == dtype
    np.testing.assert_array_equal(P.double().numpy(), P_np)
    assert (1.0 if inv is None else float(inv)) == inv_np


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("regime", REGIMES)
def test_split_kernel_on_cuda_bitwise_as_emulated(regime, dtype, pieces):
    """The split kernel a compiled graph launches on CUDA (:func:`dora_num.ops.kernels.products.split_cuda`):
    the pieces and ``inv`` of the exact emulation, bit for bit, subnormal and tie regimes included."""
    A = _adapter(regime, 5, 97, seed=1)
    P, inv = split_pieces(A.cuda(), dtype, pieces, traced=True)  # launched directly outside a traced graph
    P_np, inv_np = split_pieces_np(A.numpy(), FMTS[dtype], pieces)
    assert P.shape == (pieces, 5, 97) and P.dtype == dtype and P.is_cuda
    np.testing.assert_array_equal(P.double().cpu().numpy(), P_np)
    assert (1.0 if inv is None else float(inv)) == inv_np


@pytest.mark.interpreter
@pytest.mark.parametrize("regime", REGIMES)
def test_split_kernel_under_the_interpreter_as_emulated(regime):
    """The split kernel's steps on the CPU under the interpreter, fp16 pieces (the interpreter truncates casts
    to bf16, so bf16 is held to the emulation on the GPU only)."""
    from dora_num.ops.kernels.products import split_cuda
    from dora_num.ops.products import _FP16_TOP, _K_LIMIT, _pow2

    A = _adapter(regime, 5, 97, seed=1)
    e = torch.frexp(A.abs().amax()).exponent
    scale = _pow2((_FP16_TOP - e).clamp(-_K_LIMIT, _K_LIMIT).to(torch.int32))
    P = split_cuda(A, torch.float16, 3, scale)
    P_np, _ = split_pieces_np(A.numpy(), FMTS[torch.float16], 3)
    np.testing.assert_array_equal(P.double().numpy(), P_np)


def test_three_bf16_pieces_keep_every_fp32_value_above_2_pow_minus_110():
    """The docstring's claim: res = 0 for |A| >= 2^-110 (any fp32 value up to bf16's max),
    <= 2^-134 below; two pieces keep about 17 bits (res <= 2^-17 (1 + 2^-8) |A|)."""
    A = _adapter("wide_exponents", 64, 257, seed=2).numpy()
    res3, *_ = split_residual(A, "bf16", 3)
    big = np.abs(A) >= 2.0**-110
    assert big.sum() > 1000 and (~big).sum() > 100
    assert (res3[big] == 0).all()
    assert (res3[~big] <= 2.0**-134).all()
    res2, *_ = split_residual(A, "bf16", 2)
    assert (res2 <= 2.0**-17 * (1 + 2.0**-8) * np.abs(A) + 2.0**-134).all()
    assert (res2[big] > 0).mean() > 0.9  # two pieces do lose bits of almost every value


@pytest.mark.parametrize("regime", REGIMES + ["full_significands"])
def test_two_fp16_pieces_keep_fp32_values_to_one_unit(regime, regimes):
    """The docstring's claim for two fp16 pieces: ``res <= max(ulp32(A), inv 2^-25)`` (the second
    piece catches all but one fp32 unit of ``A``, or the underflow below fp16's spacing), attained."""
    A = regimes.full_significands(64, 257, torch.Generator().manual_seed(3)).numpy() if regime == "full_significands" else _adapter(regime, 64, 257, seed=3).numpy()
    res, _, _, inv = split_residual(A, "fp16", 2)
    unit = np.spacing(np.abs(A).astype(np.float32)).astype(np.float64)
    assert (res <= np.maximum(unit, inv * 2.0**-25)).all()
    if regime == "full_significands":
        assert (res == unit).any() and 0.1 < (res > 0).mean() < 0.5


def test_two_fp16_pieces_are_exact_on_23_bit_inputs(regimes):
    """Inputs made as the H200 test first made them, ``(rand * 2 - 1) / sqrt(d)`` at ``d = 1024``, are
    multiples of ``2^-28`` below ``2^-5`` (at most 23 significant bits): two fp16 pieces hold them
    exactly, so the two- and three-piece products are the same sum (their measured errors there,
    1.1930e-6 and 1.1939e-6, differed by cuBLAS's accumulation order for ``2r`` and ``3r`` columns);
    with all 24 bits random they are not (the comparison needs such inputs)."""
    gen = torch.Generator().manual_seed(11)
    A23 = ((torch.rand(16, 1024, generator=gen) * 2 - 1) / math.sqrt(1024)).numpy()
    assert (split_residual(A23, "fp16", 2)[0] == 0).all()
    assert (split_residual(regimes.full_significands(16, 1024, torch.Generator().manual_seed(11)).numpy(), "fp16", 2)[0] > 0).any()


@pytest.mark.parametrize("pieces", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("regime", ["kaiming", "wide_exponents", "tiny", "zeros_and_ties"])
def test_split_products_within_bound_on_an_emulated_tensor_core(regime, dtype, pieces):
    d_out, d, r = 24, 130, 6
    gen = torch.Generator().manual_seed(3)
    W = (torch.randn(d_out, d, generator=gen) / math.sqrt(d)).to(dtype)
    if regime == "tiny":
        W = (W.float() * 2.0**-6).to(dtype)
    A = _adapter(regime, r, d, seed=4)
    if dtype == torch.float16 and regime == "wide_exponents":
        A = A.clamp(-2.0**100, 2.0**100)
    W64, A64 = W.double().numpy(), A.double().numpy()
    U = split_mm(W, A, pieces, mm=_emulated_mm).double().numpy()
    U64 = W64 @ A64.T  # exact products; the fp64 sum within gamma64_d of the magnitudes
    mag = np.abs(W64) @ np.abs(A64).T
    tol = split_u_error(W64, A64, pieces, FMTS[dtype]) + _gamma64(d) * mag
    fin = np.isfinite(tol)  # inf: fp32 may overflow (wide_exponents up to 2^100)
    assert fin.mean() > 0.5
    assert np.isfinite(U[fin]).all()
    assert (np.abs(U - U64)[fin] <= tol[fin]).all(), float((np.abs(U - U64)[fin] / tol[fin]).max())
    G = split_gram(A, dtype, pieces, mm=_emulated_mm).double().numpy()
    G64 = A64 @ A64.T
    tolG = split_gram_error(A64, pieces, FMTS[dtype]) + _gamma64(d) * (np.abs(A64) @ np.abs(A64).T)
    fin = np.isfinite(tolG)
    assert fin.any() and np.isfinite(G[fin]).all()
    assert (np.abs(G - G64)[fin] <= tolG[fin]).all(), float((np.abs(G - G64)[fin] / tolG[fin]).max())


def test_split_u_bound_is_not_vacuous():
    """The emulated tensor core's truncation shows: its error is a sizeable fraction of the
    bound's accumulation part, and it exceeds a single rounding of U (so the test above can
    fail)."""
    d_out, d, r = 32, 512, 4
    gen = torch.Generator().manual_seed(5)
    W = (torch.rand(d_out, d, generator=gen) / math.sqrt(d)).bfloat16()  # positive: truncation drifts
    A = torch.rand(r, d, generator=gen) / math.sqrt(d)
    U = split_mm(W, A, 3, mm=_emulated_mm).double().numpy()
    U64 = W.double().numpy() @ A.double().numpy().T
    err = np.abs(U - U64)
    assert (err > 2.0**-24 * np.abs(U64)).mean() > 0.5
    assert (err / split_u_error(W.double().numpy(), A.double().numpy(), 3, "bf16")).max() > 0.05


def _norm_from_split(W, A, B, s, pieces):
    U = split_mm(W, A, pieces, mm=_emulated_mm)
    G = split_gram(A, W.dtype, pieces, mm=_emulated_mm)
    cross, ba = _torch_tail_terms(U, B, G)
    _, two_s, s_sq = scale_constants(s)
    return norm_assembly(TorchFP32CorrectSqrt, dn.base_row_norm_sq(W), cross, ba, two_s, s_sq)


@pytest.mark.parametrize("pieces", [2, 3])
@pytest.mark.parametrize("regime", ["realistic", "random", "cancelling"])
def test_factored_norm_on_split_products_within_bound(regime, pieces):
    """The whole norm (split products on an emulated tensor core, the torch tail, the
    assembly) against the exact fp64 norm, within factored_norm_bound(split_pieces=p) plus the
    fp64 reference's own bound; the regime where the update cancels the row included."""
    from dora_num.oracles import fp32_scale, row_norm_ref64, row_norm_ref64_error_bound

    d_out, d, r = 40, 96, 8
    gen = torch.Generator().manual_seed(6)
    W = (torch.randn(d_out, d, generator=gen) / math.sqrt(d)).bfloat16()
    A = (torch.rand(r, d, generator=gen) * 2 - 1) / math.sqrt(d)
    s = fp32_scale(0.5)
    B = torch.randn(d_out, r, generator=gen) * (1e-2 if regime == "realistic" else 1.0)
    if regime == "cancelling":  # rows 0..3: W_j ~ -s (BA)_j, kept in bf16
        W = W.float()
        W[:4] = (-s * (B[:4].double() @ A.double())).float() + 1e-3 * W[:4]
        W = W.bfloat16()
    w = _norm_from_split(W, A, B, s, pieces).double()
    ref = row_norm_ref64(W.double(), A.double(), B.double(), s)
    tol = torch.from_numpy(factored_norm_bound(W.double().numpy(), A.numpy(), B.numpy(), s,
                                               split_pieces=pieces, split_format="bf16"))
    tol = tol + row_norm_ref64_error_bound(W.double(), A.double(), B.double(), s)
    assert bool(((w - ref).abs() <= tol).all()), float(((w - ref).abs() / tol).max())


def test_two_pieces_measured_against_three():
    """What the third piece buys, measured (the numbers the module docstring cites): at
    realistic adapters the relative error of U from two bf16 pieces is of the order of 2^-17
    where three pieces give the accumulation's error alone."""
    d_out, d, r = 48, 256, 8
    gen = torch.Generator().manual_seed(7)
    W = (torch.randn(d_out, d, generator=gen) / math.sqrt(d)).bfloat16()
    A = (torch.rand(r, d, generator=gen) * 2 - 1) / math.sqrt(d)
    U64 = W.double() @ A.double().T
    mag = W.double().abs() @ A.double().abs().T
    errs = {p: float(((split_mm(W, A, p, mm=_emulated_mm).double() - U64).abs() / mag).max()) for p in (2, 3)}
    assert errs[3] < errs[2]
    assert 2.0**-22 < errs[2] < 2.0**-15, errs


def test_products_past_tc_block_k_are_blocked_and_within_the_blocked_bound():
    """d_in = TC_BLOCK_K + 77: the tensor-core products are two fresh blocks added in sequence, and on the
    truncating emulated accumulator U and G stay within the blocked charge (gamma of tc_additions(d), not
    2 d).  Inputs of few bits (bf16 W = k 2^-4, A = k 2^-16) make the float64 reference exact."""
    from dora_num.numerics.standard_model import TC_BLOCK_K, tc_additions, tc_blocks

    d = TC_BLOCK_K + 77
    assert tc_blocks(d) == [(0, TC_BLOCK_K), (TC_BLOCK_K, d)] and tc_additions(d) == 2 * (TC_BLOCK_K + 2)
    gen = torch.Generator().manual_seed(4)
    W = (torch.randint(-8, 9, (3, d), generator=gen).double() / 16).bfloat16()
    A = torch.randint(-2**15, 2**15, (2, d), generator=gen).float() / 2**16
    U = split_mm(W, A, 3, mm=_emulated_mm)
    G = split_gram(A, torch.bfloat16, 3, mm=_emulated_mm)
    U64, G64 = W.double() @ A.double().T, A.double() @ A.double().T  # exact: multiples of 2^-20 below 2^33
    assert bool(((U.double() - U64).abs() <= torch.from_numpy(split_u_error(W.double().numpy(), A.double().numpy(),
                                                                            3, "bf16"))).all())
    assert bool(((G.double() - G64).abs() <= torch.from_numpy(split_gram_error(A.double().numpy(), 3, "bf16"))).all())


def _rounding_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An emulated accumulator that rounds to nearest: exact products summed left to right in fp32, every
    addition rounded once (TwoSum, then one rounding), as :func:`mm_truncating_fp32` but RN."""
    from dora_num.numerics.formats import round_dd, two_sum

    a, b = a.double().numpy(), b.double().numpy()
    acc = np.zeros((a.shape[0], b.shape[1]))
    for i in range(a.shape[1]):
        hi, lo = two_sum(acc, a[:, i:i + 1] * b[i:i + 1, :])
        acc = round_dd(hi, lo, "fp32")
    return torch.from_numpy(acc).float()


def _pairwise_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An emulated accumulator that sums the exact products pairwise (a balanced tree, ``log2 d`` levels),
    every addition rounded to nearest fp32 once."""
    from dora_num.numerics.formats import round_dd, two_sum

    P = a.double().numpy()[:, :, None] * b.double().numpy()[None, :, :]  # [m, d, n], exact
    while P.shape[1] > 1:
        if P.shape[1] % 2:
            P = np.concatenate([P, np.zeros_like(P[:, :1])], axis=1)
        hi, lo = two_sum(P[:, 0::2], P[:, 1::2])
        P = round_dd(hi, lo, "fp32")
    return torch.from_numpy(P[:, 0]).float()


def bf16_base_errors(d_in: int = 1024, accumulate=_emulated_mm) -> dict:
    """A bf16 base (64 x d_in) with fp32 adapters (r = 16, the update as large as W): the factored norm through
    the split products on an emulated accumulator (``accumulate``: default the truncating one, every
    addition rounded toward zero), the dense fp32 norm, against the float64 norm; and the factored norm's
    largest err / bound (the split model).  docs/bounds.md (lemma 11's remark) quotes these numbers."""
    from dora_num.ops.norm import base_row_norm_sq
    from dora_num.oracles import perturbed_adapter

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(64, d_in, generator=gen) / math.sqrt(d_in)
    A = (torch.rand(16, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)
    B, _ = perturbed_adapter(W, A, 2.0, seed=16, update_ratio=1.0)
    W = W.bfloat16()
    s, two_s, s_sq = scale_constants(2.0)
    P = split_pieces(A, torch.bfloat16, 3)
    U, G = split_mm(W, A, 3, mm=accumulate, split=P), split_gram(A, torch.bfloat16, 3, mm=accumulate, split=P)
    cross, ba = _torch_tail_terms(U, B, G)
    w = norm_assembly(TorchFP32CorrectSqrt, base_row_norm_sq(W), cross, ba, two_s, s_sq).double()
    ref = torch.linalg.vector_norm(W.double() + s * (B.double() @ A.double()), dim=1)  # 1e-13 relative
    dense = dn.dense_row_norm(W, A, B, s).double()
    bound = factored_norm_bound(W.double().numpy(), A.double().numpy(), B.double().numpy(), s, products="split",
                                split_pieces=3)
    rel = (w - ref).abs() / ref
    return {"factored_median": float(rel.median()), "factored_max": float(rel.max()),
            "dense_max": float(((dense - ref).abs() / ref).max()),
            "err_over_bound_max": float(((w - ref).abs().numpy() / bound).max())}


def test_bf16_base_factored_error_is_the_accumulation_depth(record):
    """Why the factored norm on a bf16 base with fp32 adapters errs by ~1e-6 where the dense fp32 norm errs by
    ~1e-7: the split keeps A exactly and every product is exact, but U and G are dot products of length d_in
    whose terms have random signs (|U| ~ sqrt(d) |w||a| against magnitudes d |w||a|), so an accumulator that
    adds them in sequence (a tensor core does, across its blocks of products) errs by ~u sqrt(d) of |U|, more
    when it truncates; the dense norm forms W + sBA elementwise (r-term sums) and sums positive squares.  A
    pairwise tree on the same exact products brings the factored norm to the dense norm's order.  The bound
    (2u per addition on the magnitudes, any order and sign) is far from tight on these inputs."""
    trunc = bf16_base_errors()
    seq = bf16_base_errors(accumulate=_rounding_mm)
    tree = bf16_base_errors(accumulate=_pairwise_mm)
    record("split", case="bf16 base, fp32 adapters, d_in 1024, r 16, rho 1",
           **{f"{n}_{k}": v for n, e in (("rz", trunc), ("rn", seq), ("tree", tree)) for k, v in e.items()})
    assert trunc["factored_median"] > 8 * trunc["dense_max"] and seq["factored_median"] > 4 * seq["dense_max"]
    assert tree["factored_max"] < 4 * tree["dense_max"]  # the depth of the accumulation is the cause
    assert trunc["err_over_bound_max"] <= 1 and trunc["err_over_bound_max"] < 0.02  # within, and far from tight


# ---------------------------------------------------------------------------
# The tail's B G from bf16 pieces of B and G (ops.products.split_bg)
# ---------------------------------------------------------------------------

BG_FMTS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _exact_product(X, Y) -> np.ndarray:
    """``X @ Y`` correctly rounded to float64: each entry the ``math.fsum`` of its products, exact in float64
    for fp32 values (48 significand bits; no product of these tests under- or overflows float64), so the
    reference carries no ``gamma64`` of the magnitudes that could hide a bound a little too small."""
    out = np.full((X.shape[0], Y.shape[1]), np.nan)  # NaN where a factor is not finite (no bound there either)
    for j in range(X.shape[0]):
        for k in range(Y.shape[1]):
            terms = X[j] * Y[:, k]
            if np.isfinite(terms).all():
                out[j, k] = math.fsum(terms)
    return out


def _tail_factors(regime: str, b_dtype: torch.dtype, d_out: int = 20, r: int = 7, seed: int = 6):
    """``B`` of ``b_dtype`` (its values in that dtype's range) and an fp32 ``G``: a Gram of ``regime``'s A, as
    the norm forms it, or, where that Gram would overflow ("huge", "wide_exponents"), A's own values."""
    gen = torch.Generator().manual_seed(seed)
    A = _adapter(regime, r, 33, seed=seed)
    if regime in ("huge", "wide_exponents"):  # a Gram of such an A overflows: A's values as G's (wide: to 2^60)
        G = A[:, :r].clamp(-2.0**60, 2.0**60).contiguous()
    else:
        G = (A.double() @ A.double().T).float()
    B = torch.randn(d_out, r, generator=gen) * 0.01
    if regime == "wide_exponents":
        B = B.sign() * torch.ldexp(1 + torch.rand(d_out, r, generator=gen), torch.randint(-149, 30, (d_out, r), generator=gen))
    if regime == "tiny":
        B = B * 2.0**-100
    B[0] = 0.0
    return B.to(b_dtype), G


@pytest.mark.parametrize("b_dtype", list(BG_FMTS), ids=list(BG_FMTS.values()))
@pytest.mark.parametrize("regime", REGIMES)
def test_split_bg_within_bound_on_an_emulated_tensor_core(regime, b_dtype):
    """``B G`` through bf16 pieces of both factors, on the emulated truncating tensor core, against the exact
    product of the fp32 values it was given: within :func:`split_bg_error` (plus half a float64 unit of the
    correctly rounded reference), every finite-bounded entry finite."""
    from dora_num.numerics.split_products import split_bg_error
    from dora_num.ops.products import split_bg

    B, G = _tail_factors(regime, b_dtype)
    BG = split_bg(B, G, mm=_emulated_mm).double().numpy()
    B64, G64 = B.double().numpy(), G.double().numpy()
    exact = _exact_product(B64, G64)  # correctly rounded to float64: within 2^-53 of itself
    tol = split_bg_error(B64, G64, BG_FMTS[b_dtype]) + 2.0**-52 * np.abs(exact)
    fin = np.isfinite(tol)
    assert fin.mean() > 0.5
    assert np.isfinite(BG[fin]).all()
    assert (np.abs(BG - exact)[fin] <= tol[fin]).all(), float((np.abs(BG - exact)[fin] / tol[fin]).max())


def test_split_bg_pieces_hold_fp16_and_bf16_exactly_and_fp32_above_2_pow_minus_110():
    """The piece counts of ``BG_PIECES``: one bf16 piece is a bf16 B, two hold every fp16 value (subnormals
    included), three every fp32 value of at least ``2^-110``; fewer would not (the counts are the least)."""
    from dora_num.numerics.split_products import split_bg_np, split_residual

    gen = torch.Generator().manual_seed(9)
    fp16 = torch.randn(64, 64, generator=gen).half()
    fp16[0, :8] = torch.tensor([2.0**-24, 3 * 2.0**-24, 1023 * 2.0**-24, 65504.0, -2.0**-14, 0.0, 1.0 + 2.0**-10, -7.0])
    assert (split_residual(fp16.double().numpy(), "bf16", 2)[0] == 0).all()
    assert (split_residual(fp16.double().numpy(), "bf16", 1)[0] > 0).any()
    fp32 = _adapter("wide_exponents", 64, 64, seed=9).numpy()
    big = np.abs(fp32) >= 2.0**-110
    assert (split_residual(fp32, "bf16", 3)[0][big] == 0).all()
    assert (split_residual(fp32, "bf16", 2)[0][big] > 0).mean() > 0.9
    bf16 = torch.randn(8, 8, generator=gen).bfloat16().double().numpy()
    PB, PG = split_bg_np(bf16, fp32[:8, :8], "bf16")
    assert PB.shape == (1, 8, 8) and (PB[0] == bf16).all() and PG.shape == (3, 8, 8)


def test_split_bg_bound_is_not_vacuous():
    """On positive factors the emulated truncation drifts: the error exceeds one rounding of the exact product
    and reaches a quarter of the bound (0.32 measured; a bound a quarter as large would fail here, half as large
    would not: the truncating accumulator loses about half of its ``2u`` per addition on such sums)."""
    from dora_num.numerics.split_products import split_bg_error
    from dora_num.ops.products import split_bg

    gen = torch.Generator().manual_seed(12)
    B = torch.rand(32, 96, generator=gen)
    A = torch.rand(96, 256, generator=gen) / 16
    G = (A.double() @ A.double().T).float()
    BG = split_bg(B, G, mm=_emulated_mm).double().numpy()
    exact = _exact_product(B.double().numpy(), G.double().numpy())
    err = np.abs(BG - exact)
    assert (err > 2.0**-24 * np.abs(exact)).mean() > 0.5
    assert (err / split_bg_error(B.double().numpy(), G.double().numpy(), "fp32")).max() > 0.25


def test_split_bg_refuses_what_it_cannot_split():
    from dora_num.ops.products import split_bg

    with pytest.raises(ValueError, match=r"G \[r, r\]"):
        split_bg(torch.zeros(4, 3), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="fp32, fp16 or bf16 and G fp32"):
        split_bg(torch.zeros(4, 3, dtype=torch.float64), torch.zeros(3, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("b_dtype", list(BG_FMTS), ids=list(BG_FMTS.values()))
def test_cuda_split_bg_within_bound_and_bitwise_eager_when_traced(b_dtype):
    """On CUDA (``torch.mm(..., out_dtype=float32)`` on the tensor cores): within :func:`split_bg_error` of the
    exact product, and the traced route (the split and block-sum kernels launched directly) the same bits."""
    from dora_num.numerics.split_products import split_bg_error
    from dora_num.ops.products import split_bg

    B, G = _tail_factors("kaiming", b_dtype, d_out=4096, r=384)
    BG = split_bg(B.cuda(), G.cuda())
    assert torch.equal(BG, split_bg(B.cuda(), G.cuda(), traced=True))
    B64, G64 = B.double().numpy(), G.double().numpy()
    tol = split_bg_error(B64, G64, BG_FMTS[b_dtype]) + _gamma64(384) * (np.abs(B64) @ np.abs(G64))
    assert (np.abs(BG.double().cpu().numpy() - B64 @ G64) <= tol).all()


def test_split_bg_flush_term_is_needed():
    """Products just below ``2^-126``, all one sign, on the flushing accumulator: every product is lost, an error
    a hundred times the rest of the bound (the accumulation's ``gamma`` of the magnitudes), so a bound without
    its ``(n + 3K) 2^-126`` term would fail here; the whole bound holds."""
    from dora_num.numerics.split_products import split_bg_error
    from dora_num.numerics.standard_model import tc_additions
    from dora_num.ops.products import split_bg

    B = torch.full((1, 4), float(np.float32(2.0**-63 * (1 - 2.0**-8))))
    G = torch.full((4, 4), 2.0**-63)
    B64, G64 = B.double().numpy(), G.double().numpy()
    exact = _exact_product(B64, G64)[0, 0]
    err = abs(split_bg(B, G, mm=_emulated_mm).double().numpy()[0, 0] - exact)
    n = (tc_additions(3 * 4) + 2) * 2.0**-24
    accumulation = n / (1 - n) * (1 + 2.0**-7) ** 2 * exact  # gamma S_B S_G: the bound's part without flushes
    assert err == exact and err > 100 * accumulation
    assert err <= split_bg_error(B64, G64, "fp32")[0, 0]
