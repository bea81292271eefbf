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
