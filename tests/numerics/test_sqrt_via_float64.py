"""TorchFP32CorrectSqrt on CPU: torch's float64 sqrt is faithful but not correctly rounded,
and a faithful float64 root still rounds to the correctly rounded float32 root (the
argument in the class docstring).  Ground truth: integer arithmetic (``math.isqrt``)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt


def _f32_inputs(n=1_000_000, seed=0):
    rng = np.random.default_rng(seed)
    bits = rng.integers(1, 0x7F800000, n, dtype=np.uint32)  # every positive finite pattern equally likely
    x = bits.view(np.float32)
    # the hardest cases: x next to m^2 for float32 midpoints m (1.5 ulp apart from representable roots)
    m = (rng.integers(2**23, 2**24, 20_000) * 2 + 1).astype(np.float64) * np.exp2(rng.integers(-80, 40, 20_000) - 24.0)
    with np.errstate(over="ignore"):
        near = (m * m).astype(np.float32)
    near = near[(near > 0) & np.isfinite(near)]
    near = np.concatenate([near, np.nextafter(near, np.float32(0)), np.nextafter(near, np.float32(np.inf))])
    return np.concatenate([x, near, np.float32([2.0**-149, 2.0**-126, 1.0, 2.0, 3.4028235e38])])


def _rn_sqrt_int(x: float, p: int, emin: int) -> Fraction:
    """Correctly rounded sqrt of a positive float, to ``p`` bits (``emin``: min normal exponent), by isqrt."""
    q = Fraction(x)
    e = (q.numerator.bit_length() - q.denominator.bit_length()) // 2
    qe = max(e - 1, emin) - p + 1 - 2  # two guard bits below the quantum
    # floor(sqrt(q) / 2^qe) from integers: sqrt(q * 4^-qe)
    N = q / Fraction(2) ** (2 * qe)
    r = math.isqrt(N.numerator // N.denominator)
    while Fraction(r + 1) ** 2 <= N:
        r += 1
    exact = Fraction(r) ** 2 == N
    # r = floor(sqrt(q) 2^-qe); round away 2 + (shift to the true quantum) bits with the sticky bit
    val = Fraction(r) * Fraction(2) ** qe
    ee = (val.numerator.bit_length() - val.denominator.bit_length())
    if Fraction(2) ** ee > val:
        ee -= 1
    quantum = Fraction(2) ** (max(ee, emin) - p + 1)
    k, rem = divmod(Fraction(r) * Fraction(2) ** qe, quantum)
    half = quantum / 2
    if rem > half or (rem == half and (not exact or k % 2 == 1)):
        k += 1
    return k * quantum


def test_torch_cpu_float64_sqrt_is_faithful_not_correctly_rounded_but_suffices():
    x32 = _f32_inputs()
    x64 = x32.astype(np.float64)
    t64 = torch.sqrt(torch.from_numpy(x64)).numpy()
    n64 = np.sqrt(x64)  # IEEE: correctly rounded (checked below on a sample with integers)
    off = t64 != n64
    rate = off.mean()
    assert 0.005 < rate < 0.03, rate  # about 1.3%: not correctly rounded
    rng = np.random.default_rng(1)
    sample = np.concatenate([rng.choice(np.flatnonzero(off), 3000, replace=False),
                             rng.choice(x64.size, 2000, replace=False)])
    for i in sample:
        rn = _rn_sqrt_int(float(x64[i]), 53, -1022)
        assert Fraction(float(n64[i])) == rn, i
        t = float(t64[i])  # faithful: one of the two float64 neighbours of sqrt(x)
        lo, hi = Fraction(np.nextafter(t, 0)), Fraction(np.nextafter(t, np.inf))
        assert lo * lo < Fraction(float(x64[i])) < hi * hi, i
    # what the class returns: the correctly rounded float32 root, every input
    got = TorchFP32CorrectSqrt.sqrt(torch.from_numpy(x32)).numpy()
    want = n64.astype(np.float32)  # innocuous double rounding (53 >= 2*24 + 2)
    np.testing.assert_array_equal(got, want)
    for i in sample[:1500]:
        assert Fraction(float(got[i])) == _rn_sqrt_int(float(x64[i]), 24, -126), i
    # torch's own fp32 sqrt on CPU is not correctly rounded (why the class exists); how often depends on
    # the CPU's vector sqrt (17% of these inputs on the machine of docs/platform.md, 0.59% on another)
    t32 = torch.sqrt(torch.from_numpy(x32)).numpy()
    assert (t32 != want).any()
    from dora_num.numerics.formats import ulp_distance

    assert (np.abs(ulp_distance(t32.astype(np.float64), want.astype(np.float64), "fp32")) <= 1).all()
