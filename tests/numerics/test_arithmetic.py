"""The arithmetic interface is a type: every arithmetic the formulas are evaluated under declares
:class:`~dora_num.numerics.arithmetic.Arithmetic` and defines each of its members itself (a member
inherited from the protocol's stub would silently return None), with the protocol's signature."""

from __future__ import annotations

import inspect

import pytest

from dora_num.numerics import formulas as F
from dora_num.numerics.arithmetic import Arithmetic, TorchFP32, TorchFP32CorrectSqrt
from dora_num.numerics.emulate import RoundEach
from dora_num.numerics.exact import DDArith, MPArith
from dora_num.oracles import TorchFP64
from dora_num.studies.fma.models import Placement, SiteTracer

ARITHMETICS = {  # every arithmetic class of the package, with one instance each
    "TorchFP32": TorchFP32(), "TorchFP32CorrectSqrt": TorchFP32CorrectSqrt(), "TorchFP64": TorchFP64(),
    "RoundEach": RoundEach("bf16", fma=True), "Placement": Placement(("none",)), "MPArith": MPArith(64),
    "DDArith": DDArith(), "SiteTracer": SiteTracer("compose_stable"),
}
METHODS = sorted(n for n, v in vars(Arithmetic).items() if inspect.isfunction(v) and not n.startswith("_"))


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def test_the_protocol_lists_the_operations_the_formulas_use():
    """Every ``ar.<op>`` in the formulas is a member of the protocol, and every member is used."""
    used = set()
    for fn in vars(F).values():
        if inspect.isfunction(fn) and fn.__module__ == F.__name__:
            src = inspect.getsource(fn)
            used |= {m for m in METHODS if f"ar.{m}(" in src}
    assert set(METHODS) == {"add", "const", "div", "maximum", "muladd", "mul", "neg", "sqrt", "sub", "zero_to"}
    assert set(METHODS) - used == {"add"}  # the arithmetics compose with it (sub, unfused muladd); studies call it


def test_every_arithmetic_class_is_listed_here():
    classes = {c.__name__ for c in _all_subclasses(Arithmetic) if c.__module__.startswith("dora_num")}
    assert classes == set(ARITHMETICS)


def _stubs(cls) -> list[str]:
    """The members ``cls`` takes from the protocol's stubs (each returns None)."""
    return [m for m in METHODS if next(k for k in cls.__mro__ if m in vars(k)) is Arithmetic]


@pytest.mark.parametrize("name", list(ARITHMETICS))
def test_each_arithmetic_declares_and_satisfies_the_protocol(name):
    ar = ARITHMETICS[name]
    assert Arithmetic in type(ar).__mro__ and isinstance(ar, Arithmetic)
    assert isinstance(ar.name, str) and ar.name
    assert _stubs(type(ar)) == []
    for m in METHODS:
        want = [p for p in inspect.signature(getattr(Arithmetic, m)).parameters if p != "self"]
        got = list(inspect.signature(getattr(ar, m)).parameters)
        assert len(got) == len(want), (m, got, want)


def test_a_declared_class_missing_operations_is_caught():
    """What the check above guards against: a declared class passes isinstance whatever it lacks."""

    class Bare(Arithmetic):
        name = "bare"

        def add(self, a, b):
            return a + b

    assert isinstance(Bare(), Arithmetic) and Bare().sqrt(4.0) is None
    assert _stubs(Bare) == [m for m in METHODS if m != "add"]


def test_double_double_zero_to_against_exact_values():
    """DDArith.zero_to (the member it lacked before the protocol): ``b`` exactly where ``a`` is an exact
    0, ``a`` where ``a`` is certainly not 0, and undecided (err = inf) where 0 lies within ``a``'s bound."""
    import numpy as np

    from dora_num.numerics.exact import DD

    a = DD(np.array([0.0, 3.0, 2.0**-60, 0.0, 1e-300]), np.array([0.0, 2.0**-60, 0.0, 0.0, 0.0]),
           np.array([0.0, 0.0, 2.0**-59, 1e-20, 0.0]))
    out = DDArith.zero_to(a, 7.0)
    assert out.hi.tolist() == [7.0, 3.0, 2.0**-60, 0.0, 1e-300] and out.lo.tolist() == [0.0, 2.0**-60, 0.0, 0.0, 0.0]
    assert out.err.tolist() == [0.0, 0.0, np.inf, np.inf, 0.0]
