"""Emulated arithmetics: every operation rounded exactly once to a working format, with or without FMA.

On float64 arrays holding values of the format: ``add``/``sub``/``mul`` form the exact result by
TwoSum / TwoProduct and round it once (:func:`~dora_num.numerics.formats.round_dd`); a contracted
``muladd`` rounds ``a*b + c`` once; ``sqrt`` is numpy's correctly rounded float64 root rounded
again, innocuous for ``p <= 25`` (``53 >= 2p + 2``, Figueroa 1995).  ``RoundEach(fmt)`` is eager
bf16/fp16 PyTorch (each op in fp32 then rounded: an innocuous double rounding, ``24 >= 2*11 + 2``);
``RoundEach(fp32)`` plus one final rounding is the contract; ``fma=True`` contracts every
``muladd``; :func:`emulate` also holds ``g`` in the storage format where asked.
"""

from __future__ import annotations

import numpy as np

from . import formulas as F
from .arithmetic import Arithmetic
from .formats import FORMATS, Format, get_format, round_dd, round_to, two_prod, two_sum


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _is_scalar(x) -> bool:
    """A Python number (a constant of the formula such as ``s`` or ``1``), not an array."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class RoundEach(Arithmetic):
    """Every operation rounded once, exactly, to ``fmt``; ``fma=True`` contracts ``muladd``."""

    def __init__(self, fmt, *, fma: bool = False, torch_scalars: bool = True):
        self.fmt: Format = get_format(fmt)
        self.fma = bool(fma)
        self.torch_scalars = bool(torch_scalars)
        self.name = f"{self.fmt.name}-per-op" + ("-fma" if fma else "")

    def __repr__(self) -> str:
        return f"RoundEach({self.fmt.name}, fma={self.fma})"

    def _round2(self, hi, lo, scalar_op: bool = False):
        ok = np.isfinite(hi)
        lo = np.where(ok & np.isfinite(lo), lo, 0.0)
        if scalar_op and self.torch_scalars and self.fmt.p < 24:
            # eager PyTorch computes (bf16/fp16 tensor) op (Python scalar) in fp32 and
            # rounds that to the tensor's dtype: a double rounding (the scalar has up
            # to 24 bits, so Figueroa's innocuous-double-rounding condition fails).
            # How often depends on s: measured on CPU, lora ~ N(0, 1) stored in the
            # format, 1e5 elements, s*lora differs from one rounding for 0.67% (bf16) /
            # 0.64% (fp16) at s = 0.37, never at s = 0.5 (exact products) and for none
            # of the 1e5 at the rsLoRA scales 2/sqrt(7), 16/sqrt(5)
            # (tests/numerics/test_emulate.py); this reproduces torch bit for bit.
            return round_to(round_dd(hi, lo, FORMATS["fp32"]), self.fmt)
        return round_dd(hi, lo, self.fmt)

    def const(self, x: float) -> float:
        # kept a Python float (like a literal in eager torch): ops with it are scalar ops
        return float(round_to(np.array([x]), FORMATS["fp32"])[0])

    def add(self, a, b):
        s, e = two_sum(_f64(a), _f64(b))
        return self._round2(s, e, _is_scalar(a) or _is_scalar(b))

    def sub(self, a, b):
        return self.add(a, self.neg(b))

    def mul(self, a, b):
        p, e = two_prod(_f64(a), _f64(b))
        return self._round2(p, e, _is_scalar(a) or _is_scalar(b))

    def neg(self, a):
        return -a if _is_scalar(a) else -_f64(a)

    def muladd(self, a, b, c):
        if not self.fma:
            return self.add(self.mul(a, b), c)
        p, e = two_prod(_f64(a), _f64(b))
        if np.any(e[np.isfinite(e)] != 0) if np.ndim(e) else (np.isfinite(e) and e != 0):
            raise ValueError("muladd with fma=True needs a*b exact in float64 (operands of <= 26 significant bits)")
        s, e2 = two_sum(p, _f64(c))
        return self._round2(s, e2)

    def maximum(self, a, b):
        return np.maximum(_f64(a), _f64(b))

    def zero_to(self, a, b):
        a = _f64(a)
        return np.where(a == 0, _f64(b), a)

    def sqrt(self, a):
        with np.errstate(invalid="ignore"):
            return round_to(np.sqrt(_f64(a)), self.fmt)

    def div(self, a, b):
        # float64 division then rounding: innocuous double rounding for p <= 25 (53 >= 2p + 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            return round_to(_f64(a) / _f64(b), self.fmt)


FP32 = RoundEach("fp32")
FP32_FMA = RoundEach("fp32", fma=True)

# name -> (arithmetic factory given the storage format, whether a final rounding to the storage format follows)
VARIANTS = {
    "per_op": (lambda fmt: RoundEach(fmt), False),
    "fp32": (lambda fmt: FP32, True),
    "fp32_fma": (lambda fmt: FP32_FMA, True),
}
G_IN = ("fp32", "storage")
FORMULAS = ("compose_naive", "compose_stable", "norm_assembly")


def _check_fp32(name: str, x: np.ndarray) -> np.ndarray:
    x = _f64(x)
    if not np.array_equal(round_to(x, "fp32"), x, equal_nan=True):
        raise ValueError(f"{name} must hold fp32-representable values (round it with round_to(x, 'fp32'))")
    return x


def emulate(formula: str, inputs: dict, fmt, variant: str, g_in: str = "fp32") -> np.ndarray:
    """Evaluate ``formula`` (one of :data:`FORMULAS`) under ``variant`` for storage format ``fmt``.

    ``inputs``: for the compose forms ``base``, ``lora`` (values of ``fmt``, or
    fp32), ``g`` (fp32), ``s`` (an fp32 float); for ``norm_assembly``
    ``base_sq``, ``cross``, ``ba`` (fp32) and ``s``.  ``variant`` is one of
    :data:`VARIANTS`; ``g_in="storage"`` rounds ``g`` to ``fmt`` first (item d;
    ``per_op`` always holds ``g`` in ``fmt``).  Under ``per_op`` the inputs are
    rounded to ``fmt`` first (storage); under the fp32 variants the compose output
    gets one final rounding to ``fmt`` and the norm stays fp32 (the contract).
    Returns float64 values of the output format.
    """
    fmt = get_format(fmt)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if g_in not in G_IN:
        raise ValueError(f"g_in must be one of {G_IN}, got {g_in!r}")
    make, final = VARIANTS[variant]
    ar = make(fmt)
    store = (lambda x: round_to(_f64(x), fmt)) if variant == "per_op" else (lambda x: _f64(x))
    s, two_s, s_sq = F.scale_constants(float(inputs["s"]))
    if formula in ("compose_naive", "compose_stable"):
        base = store(_check_fp32("base", inputs["base"]))
        lora = store(_check_fp32("lora", inputs["lora"]))
        g = _check_fp32("g", inputs["g"])
        if variant == "per_op" or g_in == "storage":
            g = round_to(g, fmt)
        out = getattr(F, formula)(ar, base, lora, g, s)
        return round_to(out, fmt) if final else out
    if formula == "norm_assembly":
        terms = [store(_check_fp32(k, inputs[k])) for k in ("base_sq", "cross", "ba")]
        return F.norm_assembly(ar, *terms, two_s, s_sq)
    raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")
