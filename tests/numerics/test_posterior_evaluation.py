"""Lemma 4' evaluated in fp32 (``posterior_from_terms``, the guard's sequence): the computed
``rel`` must not fall below the lemma's own value ``(1+u) dQ / (2 (Q^ - dQ)) + u`` evaluated exactly
from the same fp32 terms and constants (rationals here; the square root of ``b_up`` from below by
integer ``isqrt``), over the whole domain: subnormal terms, whose underflows the fp32 sequence then
multiplies by ``|2s|`` and ``s^2`` far above 1, zero rows, terms near fp32's largest values."""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dora_num.numerics.formulas import scale_constants
from dora_num.numerics.norm_posterior import posterior_constants, posterior_from_terms

U = Fr(2) ** -24
SCALES = [0.5, 2.0, 8.0, 181.0, 2.0**20, 2 / math.sqrt(7)]


def _f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _sqrt_lo(q: Fr) -> Fr:
    """A rational ``<= sqrt(q)`` within ``2^-80`` relative."""
    if q == 0:
        return Fr(0)
    k = 100 - (q.numerator.bit_length() - q.denominator.bit_length()) // 2
    n = q * Fr(4) ** k
    return Fr(math.isqrt(n.numerator // n.denominator), 2**k)


def _lemma_rel(base, cross, ba, lora_abs, b_abs, C) -> Fr | None:
    """The lemma's ``rel`` in rationals from the given fp32 terms and constants (None: no bound)."""
    F = {k: Fr(getattr(C, k)) for k in ("ts", "s2", "cb1", "cb2", "gb", "gc4", "gc1", "tc", "gcr", "ga", "ga1",
                                        "gar", "eta", "q_s2", "q_u2", "q_u3", "q_eta", "s_sq")}
    b, c, a, la, bb = (Fr(x) for x in (base, cross, ba, lora_abs, b_abs))
    ab, aba = abs(b), abs(a)
    b_up = (ab + F["cb1"]) * F["cb2"]
    e_b = b_up * F["gb"] + F["cb1"]
    e_c = _sqrt_lo(b_up) * la * F["gc4"] + bb * F["gc1"] * F["tc"] + F["gcr"]
    e_a = la * la * F["ga"] + bb * bb * F["ga1"] * F["tc"] + (bb + 1) * F["gar"] * F["eta"]
    dQ = (e_b + e_c * F["ts"] + e_a * F["s2"] + aba * F["q_s2"] + aba * F["eta"] + (ab + F["s_sq"] * aba) * F["q_u2"]
          + F["ts"] * abs(c) * F["q_u3"] + F["q_eta"])
    Qh = _f32(_f32(float(F["s_sq"]) * ba) + _f32(_f32(C.two_s * cross) + base))  # the assembly's Q^
    if not math.isfinite(Qh) or Fr(Qh) - dQ <= 0:
        return None
    return (1 + U) * dQ / (2 * (Fr(Qh) - dQ)) + U


def _check(base, cross, ba, lora_abs, b_abs, s, d_in=64, r=4):
    _, two_s, s_sq = scale_constants(s)
    C = posterior_constants(two_s, s_sq, d_in=d_in, r=r)
    t = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    _, rel = posterior_from_terms(t(base), t(cross), t(ba), t(lora_abs), t(b_abs), C)
    want = _lemma_rel(base, cross, ba, lora_abs, b_abs, C)
    got = float(rel[0])
    assert not math.isnan(got)
    if want is None:
        assert math.isinf(got), (base, cross, ba, lora_abs, b_abs, s, got)
    else:
        assert math.isinf(got) or Fr(got) >= want, (base, cross, ba, lora_abs, b_abs, s, got, float(want))


f32 = st.floats(min_value=0.0, max_value=3.4028234663852886e38, width=32, allow_subnormal=True)
tiny = st.integers(0, 2**20).map(lambda k: _f32(k * 2.0**-149))  # the subnormal range and just above
# magnitudes whose squares and products with the constants underflow (2^-80 .. 2^-55)
root = st.tuples(st.integers(2**23, 2**24 - 1), st.integers(-80, -55)).map(lambda t: _f32(t[0] * 2.0 ** (t[1] - 23)))


@settings(max_examples=400, deadline=None)
@given(base=st.one_of(tiny, root, f32), cross=st.one_of(tiny, root, f32), ba=st.one_of(tiny, root, f32),
       lora_abs=st.one_of(tiny, root, f32), b_abs=st.one_of(tiny, root, f32), s=st.sampled_from(SCALES),
       neg=st.booleans())
@example(base=2.0**-120, cross=0.0, ba=0.0, lora_abs=2.0**-140, b_abs=2.0**-140, s=181.0, neg=False)
@example(base=2.0**-118, cross=0.0, ba=0.0, lora_abs=2.0**-66.5, b_abs=2.0**-66, s=181.0, neg=False)
@example(base=3e-39, cross=1e-40, ba=1e-42, lora_abs=1e-41, b_abs=1e-40, s=8.0, neg=True)
@example(base=1e-36, cross=1e-44, ba=1e-44, lora_abs=2.0**-133, b_abs=2.0**-130, s=181.0, neg=False)
@example(base=0.0, cross=0.0, ba=0.0, lora_abs=0.0, b_abs=0.0, s=0.5, neg=False)
@example(base=3.4028235e38, cross=0.0, ba=0.0, lora_abs=0.0, b_abs=0.0, s=0.5, neg=False)
def test_fp32_evaluation_not_below_the_lemma(base, cross, ba, lora_abs, b_abs, s, neg):
    _check(base, -cross if neg else cross, ba, lora_abs, b_abs, s)


def test_underflowing_terms_at_large_scales():
    """The class the former fixed floor 2^-144 missed: row magnitudes whose squares and products with the
    constants underflow (lost whole), which the sequence then multiplies by |2s| = 362 and s^2 = 32761
    (s = 181), beside terms near fp32's normal range."""
    rng = np.random.default_rng(0)
    for s in (8.0, 181.0, 2.0**20):
        for _ in range(300):
            la, bb = (_f32(2.0 ** rng.uniform(-80, -55)) for _ in range(2))
            cross, ba = (_f32(float(k) * 2.0**-149) for k in rng.integers(0, 2**12, 2))
            base = _f32(2.0 ** rng.uniform(-125, -100))
            _check(base, cross, ba, la, bb, s)


def test_a_saturated_gram_certifies_no_row_that_uses_it():
    """Under the project's truncating accumulator model a Gram diagonal past fp32 saturates at 3.4e38
    instead of becoming inf (mm_truncating_fp32): the guard's row magnitudes become inf (or NaN, 0 * inf)
    for every row, so no row is certified from such terms; the row that uses the saturated entry is wrong
    far beyond fp32's accuracy, which only the recompute repairs."""
    from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
    from dora_num.numerics.formulas import norm_assembly
    from dora_num.numerics.norm_posterior import lora_row_magnitudes
    from dora_num.numerics.split_products import mm_truncating_fp32

    d = 8
    A = np.zeros((2, d))
    A[0], A[1] = 2.0**64, 1.0  # G_00 = 8 2^128 > 3.4e38: saturates
    W = np.ones((3, d))
    B = np.array([[2.0**-70, 0.0], [2.0**-70, 1.0], [0.0, 1.0]])
    G, U = mm_truncating_fp32(A, A.T), mm_truncating_fp32(W, A.T)
    assert G[0, 0] == float(np.finfo(np.float32).max)
    Gt, Ut, Bt, Wt = (torch.tensor(x, dtype=torch.float32) for x in (G, U, B, W))
    base, cross, ba = (Wt * Wt).sum(1), (Bt * Ut).sum(1), ((Bt @ Gt) * Bt).sum(1)
    _, two_s, s_sq = scale_constants(1.0)
    C = posterior_constants(two_s, s_sq, d_in=d, r=2, tensor_core_products=True)
    la, bb = lora_row_magnitudes(Bt, Gt, constants=C)
    _, rel = posterior_from_terms(base, cross, ba, la, bb, C)
    assert bool(torch.isinf(rel).all()), rel
    w = norm_assembly(TorchFP32CorrectSqrt, base, cross, ba, two_s, s_sq).double()
    exact = [math.sqrt(sum((Fr(W[j, i]) + sum(Fr(B[j, k]) * Fr(A[k, i]) for k in range(2))) ** 2 for i in range(d)))
             for j in range(3)]
    assert abs(float(w[0]) - exact[0]) > 1e-5 * exact[0]  # row 0 wrong far beyond fp32: rel = inf is needed
