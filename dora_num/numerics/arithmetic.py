"""Arithmetics: the rounding behaviour a formula is evaluated under.

Every DoRA formula in :mod:`dora_num.numerics.formulas` is written once, against
the small interface below, so the eager torch reference, the CPU emulations, the
exact ground truth and the error bounds all evaluate *the same sequence of
operations*.  An arithmetic decides only how each operation rounds.

Interface (duck-typed; ``a``, ``b``, ``c`` are whatever the arithmetic holds:
torch tensors, numpy arrays, mpmath numbers, or Python scalars):

``add(a, b)``, ``sub(a, b)``, ``mul(a, b)``, ``sqrt(a)``, ``maximum(a, b)``
    one operation, one rounding (or none, for an exact arithmetic).
``muladd(a, b, c)``
    ``a*b + c`` at a place where a compiler *may* contract into an FMA. A
    non-contracting arithmetic rounds twice (mul, then add); a contracting one
    rounds once.
``neg(a)``
    exact negation.
``const(x)``
    a Python float constant brought into the arithmetic (e.g. the 1 in ``g-1``).

This module holds the torch fp32 arithmetic, the one the eager reference path
(and the fused kernels, by bitwise tests) follow.  Emulated arithmetics (per-op
rounding to bf16/fp16/fp8, FMA contraction, exact) live beside it in
:mod:`dora_num.numerics`.
"""

from __future__ import annotations

import numpy as np
import torch


class TorchFP32:
    """IEEE fp32, round-to-nearest-even, one rounding per operation, no FMA.

    This is what eager PyTorch does for fp32 elementwise ops on CPU and CUDA:
    every op is its own kernel, so nothing is contracted.  ``sqrt`` is
    ``torch.sqrt``: correctly rounded on CUDA, *not* on CPU for every input
    (docs/platform.md: about 17% of random fp32 inputs 1 ulp off), which is why the
    norm assembly in :func:`dora_num.numerics.formulas.norm_assembly` takes its
    square root from the arithmetic and the CPU reference overrides it below.
    """

    name = "torch-fp32"
    dtype = torch.float32

    @staticmethod
    def const(x: float) -> float:
        # fl32(x) as a Python float; numpy, not torch.tensor(...), so that
        # torch.compile does not break the graph on a tensor-to-scalar conversion.
        return float(np.float32(x))

    @staticmethod
    def add(a, b):
        return a + b

    @staticmethod
    def sub(a, b):
        return a - b

    @staticmethod
    def mul(a, b):
        return a * b

    @staticmethod
    def neg(a):
        return -a

    @staticmethod
    def muladd(a, b, c):
        return a * b + c

    @staticmethod
    def maximum(a, b):
        if isinstance(b, (int, float)):
            return torch.clamp_min(a, b)
        return torch.maximum(a, b)

    @staticmethod
    def sqrt(a):
        return torch.sqrt(a)

    @staticmethod
    def div(a, b):
        return a / b


class TorchFP32CorrectSqrt(TorchFP32):
    """:class:`TorchFP32` with a correctly rounded square root on every device.

    fp32 ``sqrt`` via float64 is correctly rounded: for a float32 input ``x``,
    ``sqrt(x)`` rounded to float64 then to float32 is the correctly rounded
    float32 square root, because float64 carries more than ``2*24 + 2`` bits
    (the double-rounding-is-innocuous condition for sqrt, Figueroa 1995).
    On CUDA ``torch.sqrt`` is already correctly rounded and we use it directly.
    """

    name = "torch-fp32-rn-sqrt"

    @staticmethod
    def sqrt(a):
        if isinstance(a, torch.Tensor) and a.device.type != "cuda":
            return torch.sqrt(a.double()).float()
        return torch.sqrt(a)
