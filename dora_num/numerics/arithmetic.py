"""Arithmetics: the rounding behaviour a formula is evaluated under, and the torch fp32 one.

Every formula of :mod:`dora_num.numerics.formulas` is written once against one interface,
:class:`Arithmetic`, so the eager reference, the emulations, the ground truth and the bounds evaluate
the same sequence of operations; an arithmetic decides only how each one rounds.  ``add``, ``sub``,
``mul``, ``div``, ``sqrt``, ``maximum``: one operation, one rounding (none for an exact arithmetic);
``zero_to(a, b)``: ``b`` where ``a == 0``; ``muladd(a, b, c)``: ``a*b + c`` where a compiler may
contract (one rounding with FMA, two without); ``neg``; ``const(x)``.  :class:`TorchFP32` is what the
eager reference (and, by bitwise tests, the fused kernels) follow; the emulated arithmetics are in
:mod:`.emulate`, the exact ones in :mod:`.exact`.  Every arithmetic class names :class:`Arithmetic`
as its base (tests/numerics/test_arithmetic.py checks each defines every member itself).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Arithmetic(Protocol):
    """The operations a formula of :mod:`dora_num.numerics.formulas` may use, each on the
    arithmetic's values (tensors, float64 arrays, mpmath objects, double-doubles, symbols) or
    Python numbers.  A class declares it by naming it as a base; it must define every member."""

    name: str  # a short label for tables and test ids

    def const(self, x: float) -> Any:
        """The constant ``x`` as this arithmetic holds it (fp32-rounded where it rounds to fp32)."""

    def add(self, a, b) -> Any:
        """``a + b``, one rounding."""

    def sub(self, a, b) -> Any:
        """``a - b``, one rounding."""

    def mul(self, a, b) -> Any:
        """``a * b``, one rounding."""

    def div(self, a, b) -> Any:
        """``a / b``, one rounding."""

    def neg(self, a) -> Any:
        """``-a`` (exact)."""

    def muladd(self, a, b, c) -> Any:
        """``a*b + c`` at a site a compiler may contract: one rounding with FMA, two without."""

    def maximum(self, a, b) -> Any:
        """``max(a, b)`` elementwise (exact)."""

    def zero_to(self, a, b) -> Any:
        """``b`` where ``a == 0``, else ``a`` (exact)."""

    def sqrt(self, a) -> Any:
        """``sqrt(a)``, one rounding."""


class TorchFP32(Arithmetic):
    """IEEE fp32, round-to-nearest-even, one rounding per operation, no FMA.

    This is what eager PyTorch does for fp32 elementwise ops on CPU and CUDA:
    every op is its own kernel, so nothing is contracted.  ``sqrt`` is
    ``torch.sqrt``: correctly rounded on CUDA, *not* on CPU for every input
    (measured, torch 2.13: about 17% of fp32 inputs 1 ulp off the correctly rounded root;
    ``tests/numerics/test_sqrt_via_float64.py``), which is why the
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
    def zero_to(a, b):
        return torch.where(a == 0, b, a)

    @staticmethod
    def sqrt(a):
        return torch.sqrt(a)

    @staticmethod
    def div(a, b):
        return a / b


class TorchFP32CorrectSqrt(TorchFP32):
    """:class:`TorchFP32` with a correctly rounded square root on every device.

    On CPU: ``sqrt`` of the float64 upcast, rounded to float32.  torch's CPU float64
    ``sqrt`` is *not* correctly rounded (about 1.3% of inputs 1 ulp off; measured,
    ``tests/numerics/test_sqrt_via_float64.py``), but it is faithful, and a faithful
    float64 root suffices: for a float32 ``x`` with ``2^E <= sqrt(x) < 2^(E+1)`` and a
    float32 midpoint ``m`` (25 significant bits) of that binade, ``m^2`` is an odd
    multiple of ``2^(2E-48)`` while ``x`` is an even one (a multiple of ``2^(2E-23)``, or of
    ``2^-149`` for a subnormal ``x``, where ``E <= -64``), so ``|x - m^2| >= 2^(2E-48)`` and
    ``|sqrt(x) - m| = |x - m^2| / (sqrt(x) + m) >= 2^(E-50)``.  Any float64 value within
    ``4 ulp64 = 2^(E-50)`` of ``sqrt(x)`` (a faithful one is within ``2^(E-52)``) therefore lies
    strictly on the same side of every float32 midpoint, and rounds to the same float32:
    the correctly rounded root.  (The classic statement, Figueroa 1995, assumes a
    correctly rounded intermediate; it is not needed.)  On CUDA ``torch.sqrt`` is already
    correctly rounded and used directly.
    """

    name = "torch-fp32-rn-sqrt"

    @staticmethod
    def sqrt(a):
        if isinstance(a, torch.Tensor) and a.device.type != "cuda":
            return torch.sqrt(a.double()).float()
        return torch.sqrt(a)
