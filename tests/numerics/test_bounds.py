"""The a-priori bounds of numerics.bounds: argument checking and the overflow domain
(the measured-error-within-bound sweep is tests/studies/bounds/test_sweep.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dora_num.numerics.bounds import assembly_bound, compose_bound


def test_bounds_reject_bad_arguments():
    with pytest.raises(ValueError, match="variant must be per_op, fp32 or fp32_fma"):
        compose_bound("compose_stable", 1.0, 1.0, 1.0, 0.5, "bf16", "fp64")
    with pytest.raises(ValueError, match="formula must be compose_stable or compose_naive"):
        compose_bound("norm", 1.0, 1.0, 1.0, 0.5, "bf16", "fp32")
    # base + 2s cross = 4e38 overflows fp32: no finite bound; 3e38 alone does not overflow
    assert np.isinf(assembly_bound(np.array([3e38]), np.array([1e38]), np.array([0.0]), 0.5, "fp32", "fp32"))[0]
    assert np.isfinite(assembly_bound(np.array([3e38]), np.array([0.0]), np.array([0.0]), 0.5, "fp32", "fp32"))[0]


def test_lemma4_underflow_charge_carries_the_later_additions():
    """Lemma 4 (fp32 products): each of the n underflowing products of an entry of U passes through at most
    d - 1 later additions, so its charge is (1 + gamma_{d-1}) n eta (docs/bounds.md's table); transcribed
    here in rationals on a row where all d products W_i A_ki = 2^-140 underflow."""
    from fractions import Fraction as Fr

    from dora_num.numerics.norm_bounds import _factored_parts

    d, r = 64, 2
    W = np.full((1, d), 2.0**-70)
    A = np.full((r, d), 2.0**-70)
    B = np.ones((1, r))
    P = _factored_parts(W, A, B, 0.5, "fp32")
    u, eta = Fr(1, 2**24), Fr(1, 2**150)
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    g_r, g_d = gam(r), gam(d)
    M_c = Fr(r * d) * Fr(2) ** -140
    want = (g_r + (1 + g_r) * g_d) * M_c + (1 + g_r) * (r * (1 + gam(d - 1)) * d * eta + r * eta)
    assert float(want) == pytest.approx(float(P["e_cross"][0]), rel=1e-9, abs=0)
