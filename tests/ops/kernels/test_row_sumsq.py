"""The row-sum kernel ``base_sq = rowsum(W*W)`` with W's zero rows (:mod:`dora_num.ops.kernels.row_sumsq`).

Each test runs on the CPU under the Triton interpreter and on CUDA (``gpu``).  Ground truth is the
exact sum of the squares (every square of an fp32, bf16 or fp16 value is exact in float64; their sum
is formed in ``Fraction``), and the claim is lemma 4's first line (docs/bounds.md), which holds for
any summation order and so for any tiles: ``|base^ - b| <= gamma_d b + (1 + gamma_d) n_b eta``,
``d = d_in``, ``n_b`` the nonzero squares below fp32's normal range, ``eta = 2^-150``.  The zero-row
mask is exact.  The kernel only upcasts (no rounding to bf16), so bf16 runs on the interpreter too.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from dora_num.ops.config import RowSumsqTiles, get_config, override
from dora_num.ops.kernels.row_sumsq import row_sumsq

from .helpers import DEVICES, DTYPES, assert_bitwise

U = Fraction(1, 2**24)
ETA = Fraction(1, 2**150)
TINY = 2.0**-126
FLT_MAX = Fraction(float(torch.finfo(torch.float32).max))
# tiles around the default: rows per program, columns per step (the order of each row's sum), warps
TILES = [RowSumsqTiles(), RowSumsqTiles(1, 16, 1), RowSumsqTiles(4, 64, 2), RowSumsqTiles(16, 128, 4),
         RowSumsqTiles(32, 1024, 8)]


def _gamma(n: int) -> Fraction:
    return n * U / (1 - n * U)


def exact_row_sums(W: torch.Tensor) -> tuple[list[Fraction], list[int]]:
    """Per row the exact ``sum W_i^2`` (each square exact in float64, the sum in ``Fraction``) and
    ``n_b``, its nonzero squares below fp32's normal range (the underflow sites of lemma 4)."""
    sq = W.detach().cpu().double() ** 2
    sums = [sum(map(Fraction, row), Fraction(0)) for row in sq.tolist()]
    n_b = ((sq > 0) & (sq < TINY)).sum(dim=1).tolist()
    return sums, n_b


def assert_within_lemma_4(W: torch.Tensor, base: torch.Tensor, zero: torch.Tensor) -> None:
    """``base`` within lemma 4's bound of the exact sums of ``W``'s rows (``+inf`` exactly where the
    exact sum exceeds fp32's largest finite value: the bound's overflow clause) and ``zero``
    exactly the rows of W whose entries are all zero."""
    d_out, d_in = W.shape
    assert base.shape == (d_out,) and base.dtype == torch.float32 and zero.shape == (d_out,) and zero.dtype == torch.bool
    sums, n_b = exact_row_sums(W)
    g = _gamma(d_in)
    bad = []
    for j, (b, nb, got) in enumerate(zip(sums, n_b, base.cpu().tolist())):
        if b * (1 + g) > FLT_MAX:  # the computed sum may overflow: the bound is +inf
            assert b <= FLT_MAX or got == float("inf"), (j, got)
            continue
        if abs(Fraction(got) - b) > g * b + (1 + g) * nb * ETA:
            bad.append((j, got, float(b)))
    assert bad == [], f"{len(bad)} rows outside lemma 4's bound, e.g. {bad[:3]}"
    assert zero.cpu().tolist() == (W.cpu() == 0).all(dim=1).tolist()


def _cases():
    """``(name, make)``: W of ``dtype`` on ``device``; shapes with masks on both axes (d_out not a
    multiple of any block_m, d_in not a multiple of any block_k), strided and transposed views."""
    def rand(d_out, d_in, dtype, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(d_out, d_in, generator=gen).to(dtype).to(device)

    return {
        "37x1000": lambda dt, dev: rand(37, 1000, dt, dev),
        "1x1": lambda dt, dev: rand(1, 1, dt, dev),
        "transposed-70x33": lambda dt, dev: rand(33, 70, dt, dev).T,  # strides (1, 70)
        "strided-19x300": lambda dt, dev: rand(40, 901, dt, dev)[::2, ::3],  # strides (1802, 3)
        "empty-0x50": lambda dt, dev: rand(0, 50, dt, dev),
        "no-columns-5x0": lambda dt, dev: rand(5, 0, dt, dev),
    }


CASES = _cases()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_row_sums_within_lemma_4_of_the_exact_sum(device, dtype, case):
    W = CASES[case](dtype, device)
    if case == "37x1000":
        W[3] = 0.0  # a zero row
        W[5, 7:] = 0.0
    base, zero = row_sumsq(W)
    assert_within_lemma_4(W, base, zero)
    if case.startswith("strided") or case.startswith("transposed"):
        assert not W.is_contiguous()
        # the order is fixed per W and configuration (the launch specializes on W's strides: on the H100 a
        # transposed W and its contiguous copy differ in the last bit, each within the bound above)
        assert_bitwise(base, row_sumsq(W)[0])
        assert_within_lemma_4(W.contiguous(), row_sumsq(W.contiguous())[0], zero)


def extreme_rows(dtype, device) -> torch.Tensor:
    """Rows at the edges of the format's range, ``d_in = 600`` (two column steps of the default tiles),
    every value exact in the dtype (significands of at most 8 bits).

    fp32 and bf16 (fp32's exponent range): subnormal entries (their squares round to zero), entries
    whose squares are fp32-subnormal (each an underflow site), a row whose only nonzero entry squares
    to zero (base 0 but not a zero row), a row summing to just below fp32's largest value, one whose
    squares overflow, one spanning 2^110 in its squares.  fp16 (squares never leave fp32's range): its
    subnormals, its largest value, its smallest normal.  Every dtype: a row of ``-0.0`` (a zero row)."""
    d_in = 600
    gen = torch.Generator().manual_seed(7)
    mant = 1.0 + torch.randint(0, 128, (8, d_in), generator=gen) / 128  # 8-bit significands in [1, 2)
    odd = torch.arange(d_in) % 2 == 1
    rows = torch.zeros(8, d_in, dtype=torch.float64)
    if dtype == torch.float16:
        rows[0] = 2.0**-24 * torch.randint(1, 1024, (d_in,), generator=gen)  # fp16 subnormals
        rows[1] = 65504.0
        rows[2, 13] = 2.0**-24
        rows[4] = 2.0**-10 * mant[4]
        rows[5] = 2.0**-14 * mant[5]
        rows[6] = torch.where(odd, 2.0**10 * mant[6], 2.0**-24)
    else:
        rows[0] = 2.0**-133 * torch.randint(1, 128, (d_in,), generator=gen)  # subnormal W: squares -> 0
        rows[1] = 2.0**-70 * mant[1]  # squares near 2^-140: fp32 subnormals, rounded (underflow sites)
        rows[2, 13] = 2.0**-100  # one nonzero entry whose square (2^-200) rounds to zero
        rows[4] = 2.0**58 * mant[4]  # 600 squares in [2^116, 2^118): the sum near 2^126.5
        rows[5, :2] = 2.0**64  # squares 2^128: overflow to +inf
        rows[6] = torch.where(odd, 2.0**50 * mant[6], 2.0**-60 * mant[6])
    rows[3] = -0.0
    rows[7] = torch.randint(-128, 129, (d_in,), generator=gen) / 32
    W = rows.to(dtype)
    assert bool((W.double() == rows).all()), "the rows are chosen to be exact in every dtype"
    return W.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_subnormal_and_near_overflow_rows(device, dtype):
    W = extreme_rows(dtype, device)
    base, zero = row_sumsq(W)
    assert_within_lemma_4(W, base, zero)
    got = base.cpu()
    assert zero.cpu().tolist() == [False, False, False, True, False, False, False, False]
    if dtype != torch.float16:
        assert float(got[2]) == 0.0 and float(got[5]) == float("inf")  # base 0, yet not a zero row
        assert 2.0**126 < float(got[4]) < float("inf")  # near overflow and finite
        assert_bitwise(got[3:4], torch.zeros(1))  # -0.0 squares to +0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t.block_m}x{t.block_k}w{t.num_warps}")
def test_every_tile_is_within_the_bound_and_bitwise_deterministic(device, tiles):
    """Any tiles sum within the same bound (lemma 4 holds for any order), and one configuration gives
    the same bits on every call (what lets a cache of it stand for a recompute)."""
    W = torch.cat([CASES["37x1000"](torch.float32, device),
                   torch.nn.functional.pad(extreme_rows(torch.float32, device), (0, 400))])
    cfg = dataclasses.replace(get_config(), row_sumsq_tiles=tiles)
    base, zero = row_sumsq(W, config=cfg)
    assert_within_lemma_4(W, base, zero)
    again, zero2 = row_sumsq(W, config=cfg)
    assert_bitwise(again, base)
    assert torch.equal(zero2, zero)
    with override(row_sumsq_tiles=tiles):  # the default configuration's tiles are the ones launched with
        assert_bitwise(row_sumsq(W)[0], base)


@pytest.mark.parametrize("device", DEVICES)
def test_tiles_change_the_order_of_the_sum(device):
    """Two tiles sum some rows in different orders, hence to different bits: what the caches of
    ``base_sq`` must key on (tests/ops/test_norm.py)."""
    W = CASES["37x1000"](torch.float32, device)
    a = row_sumsq(W, config=dataclasses.replace(get_config(), row_sumsq_tiles=TILES[0]))[0]
    b = row_sumsq(W, config=dataclasses.replace(get_config(), row_sumsq_tiles=TILES[1]))[0]
    assert int((a != b).sum()) > 0
