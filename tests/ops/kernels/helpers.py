"""Helpers shared by the kernel tests (not a test module): bit-level comparison, the device
and dtype cases, and the inputs of the compose and norm-tail kernels.

Every kernel test runs on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py without a GPU) and on CUDA (marked ``gpu``).  bf16 is not
compared bit for bit under the interpreter: it truncates ``.to(tl.bfloat16)`` where the
GPU rounds to nearest even, so those cases skip on the CPU and run on the H200.
"""

from __future__ import annotations

import pytest
import torch

from dora_num.ops.config import get_config

INTERPRETED = get_config().interpret
BF16_ON_INTERPRETER = ("TRITON_INTERPRET truncates .to(tl.bfloat16) (GPU rounds to nearest): bf16 "
                       "bit-exactness is tested on the H200 (the cuda cases of this test)")

CPU = pytest.param("cpu", id="cpu", marks=pytest.mark.interpreter)
CUDA = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)
DEVICES = [CPU, CUDA]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def device_dtype_cases(dtypes=("fp32", "fp16", "bf16")) -> list:
    """``(device, dtype)`` cases: every dtype on CUDA; on the CPU all but bf16, which skips
    visibly (:data:`BF16_ON_INTERPRETER`)."""
    cases = []
    for dev in ("cpu", "cuda"):
        for name in dtypes:
            marks = [pytest.mark.gpu] if dev == "cuda" else [pytest.mark.interpreter]
            if dev == "cpu" and name == "bf16":
                marks.append(pytest.mark.skipif(INTERPRETED, reason=BF16_ON_INTERPRETER))
            cases.append(pytest.param(dev, DTYPES[name], id=f"{dev}-{name}", marks=marks))
    return cases


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 16- or 32-bit float tensor as integers."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    diff = int((bits(a) != bits(b)).sum())
    assert diff == 0, f"{diff} of {a.numel()} elements differ in their bits"


def compose_inputs(shape, dtype, device="cpu", g_spread=1e-3, seed=0):
    """Seeded ``(base, lora, g, grad)`` for the compose kernels: standard normal activations of
    ``dtype``, fp32 ``g = 1 + g_spread * N(0, 1)`` (the training regime |g-1| ~ 1e-3)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    base = torch.randn(shape, generator=gen, device=device).to(dtype)
    lora = torch.randn(shape, generator=gen, device=device).to(dtype)
    g = 1.0 + g_spread * torch.randn(shape[-1], generator=gen, device=device)
    grad = torch.randn(shape, generator=gen, device=device).to(dtype)
    return base, lora, g, grad


def exact_tail_inputs(d_out, r, dtype=torch.float32, seed=0, device="cpu"):
    """Small-integer ``(U, B, G, base_sq)`` for the norm tail: every product and partial sum of
    ``cross = rowsum(B*U)`` and ``ba = rowsum((B@G)*B)`` is an fp32 integer below 2^24
    (r <= 4096), so exact in any order.  G is symmetric but not PSD: some rows get ba < 0
    and t < 0, which the clamp zeroes."""
    gen = torch.Generator().manual_seed(seed)
    U = torch.randint(-8, 9, (d_out, r), generator=gen).float()
    B = torch.randint(-1, 2, (d_out, r), generator=gen).to(dtype)
    H = torch.randint(-2, 3, (r, r), generator=gen).float()
    G = torch.triu(H) + torch.triu(H, 1).T
    base = torch.randint(1, 2**18, (d_out,), generator=gen).float() * 8.0
    return tuple(t.to(device) for t in (U, B, G, base))


def exact_tail_terms(U, B, G):
    """``(cross, ba)`` of :func:`exact_tail_inputs` in float64 (exact), rounded to fp32 (exact)."""
    B64 = B.double()
    BG = B64 @ G.double()
    cross = (B64 * U.double()).sum(1)
    ba = (BG * B64).sum(1)
    assert max(float(BG.abs().max()), float(cross.abs().max()), float(ba.abs().max())) < 2**24  # exact in fp32
    return cross.float(), ba.float()


def assert_tail_bitwise_lemma_4_prime(t, U, B, G, base, C, two_s=1.0, s_sq=0.25):
    """On exact sums (one-hot rows of B): the tail's ``wnorm`` is the torch assembly and its ``kappa``, ``rel``
    are ``posterior_from_terms`` on ``lora_row_magnitudes`` with the same constants ``C``, bit for bit.
    Returns torch's ``rel``."""
    from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
    from dora_num.numerics.formulas import norm_assembly
    from dora_num.numerics.norm_bounds import lora_row_magnitudes, posterior_from_terms

    cross, ba = exact_tail_terms(U, B, G)
    assert_bitwise(t.wnorm, norm_assembly(TorchFP32CorrectSqrt, base, cross, ba, two_s, s_sq))
    la, bb = lora_row_magnitudes(B, G, constants=C)
    kappa, rel = posterior_from_terms(base, cross, ba, la, bb, C)
    assert_bitwise(t.kappa, kappa)
    assert_bitwise(t.rel, rel)
    return rel
