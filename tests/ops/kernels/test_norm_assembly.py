"""The Triton norm assembly and its variants (:mod:`dora_num.ops.kernels.norm_assembly`).

The production variant (no contraction, ``sqrt.rn``) equals the correctly rounded torch
assembly bit for bit on the CPU (interpreter) and on CUDA; the PTX of every variant, and
that the non-production variants do differ, are checked on the H200.
"""

import pytest
import torch

from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
from dora_num.numerics.formulas import norm_assembly, scale_constants
from dora_num.ops.kernels.norm_assembly import norm_assembly_triton, ptx_instruction_counts

from .helpers import DEVICES, INTERPRETED, assert_bitwise


def _norm_inputs(n=3000, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    base_sq = torch.rand(n, generator=gen) * 100 + 1
    cross = torch.randn(n, generator=gen)
    ba = torch.rand(n, generator=gen)
    cross[:100] = -base_sq[:100] / 0.74 * (1 - 1e-4)  # the update cancels the row
    base_sq[100:110] = 0.0
    cross[100:110] = 0.0
    ba[100:110] = 0.0  # zero rows
    return base_sq.to(device), cross.to(device), ba.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_assembly_production_bitwise(device):
    _, two_s, s_sq = scale_constants(0.37)
    b, c, a = _norm_inputs(device=device)
    got = norm_assembly_triton(b, c, a, two_s, s_sq)
    assert_bitwise(got, norm_assembly(TorchFP32CorrectSqrt, b, c, a, two_s, s_sq))
    assert bool((got[100:110] == 0).all())


@pytest.mark.skipif(not INTERPRETED, reason="a property of the interpreter (numpy's sqrt); on the GPU "
                                            "test_norm_assembly_ptx_of_every_variant shows where it differs")
def test_norm_assembly_approx_sqrt_is_exact_under_the_interpreter():
    """Under the interpreter every sqrt is numpy's (correctly rounded), so ``sqrt="approx"``
    also matches here: the CPU cannot show what an approximate sqrt does."""
    _, two_s, s_sq = scale_constants(0.37)
    b, c, a = _norm_inputs()
    got = norm_assembly_triton(b, c, a, two_s, s_sq, sqrt="approx")
    assert_bitwise(got, norm_assembly(TorchFP32CorrectSqrt, b, c, a, two_s, s_sq))


@pytest.mark.parametrize("device", DEVICES)
def test_norm_assembly_errors(device):
    b, c, a = _norm_inputs(10, device=device)
    if INTERPRETED:
        with pytest.raises(NotImplementedError, match="inline PTX"):
            norm_assembly_triton(b, c, a, 1.0, 0.25, sqrt="ptx")
    with pytest.raises(ValueError, match="sqrt must be one of"):
        norm_assembly_triton(b, c, a, 1.0, 0.25, sqrt="fast")
    with pytest.raises(TypeError, match="cross must be a float32"):
        norm_assembly_triton(b, c.double(), a, 1.0, 0.25)
    with pytest.raises(ValueError, match="ba must match"):
        norm_assembly_triton(b, c, a[:5], 1.0, 0.25)


@pytest.mark.gpu
def test_norm_assembly_ptx_of_every_variant():
    from dora_num.studies.inputs import suite_assembly

    _, two_s, s_sq = scale_constants(0.5)
    b, c, a = (torch.from_numpy(v).cuda() for v in suite_assembly(1 << 20))
    want = norm_assembly(TorchFP32CorrectSqrt, b, c, a, two_s, s_sq)  # torch.sqrt on CUDA is correctly rounded
    got, k = norm_assembly_triton(b, c, a, two_s, s_sq, return_kernel=True)
    assert_bitwise(got, want)
    counts = ptx_instruction_counts(k)
    assert counts["fma.rn.f32"] == 0 and counts["sqrt.approx"] == 0 and counts["sqrt.rn"] >= 1
    got_ptx, _ = norm_assembly_triton(b, c, a, two_s, s_sq, sqrt="ptx", return_kernel=True)
    assert_bitwise(got_ptx, want)
    approx, k3 = norm_assembly_triton(b, c, a, two_s, s_sq, sqrt="approx", fp_fusion=True, return_kernel=True)
    c3 = ptx_instruction_counts(k3)
    assert c3["sqrt.approx"] >= 1 and c3["fma.rn.f32"] >= 1
    assert not torch.equal(approx, want)  # the non-production variant does differ
