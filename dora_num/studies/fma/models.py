"""Models for the FMA/sqrt study of notebook 02 (what do FMA contraction and an
approximate sqrt do to the norm, to g and to the outputs?): where contraction can
occur, how each placement rounds, and what an approximate square root may return.

The method in full: docs/methods.md, studies/fma/models.py.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field

import numpy as np

from ...numerics import formulas as F
from ...numerics.arithmetic import Arithmetic
from ...numerics.emulate import RoundEach
from ...numerics.formats import round_to, two_prod

# --------------------------------------------------------------------------
# Contraction sites
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A symbolic value: the operation that produced it and its operands."""

    op: str
    args: tuple = ()
    name: str = ""

    def __str__(self) -> str:
        if self.op in ("input", "const"):
            return self.name
        if self.op == "neg":
            return f"-{self.args[0]}"
        if self.op == "mul":
            a, b = (f"({x})" if x.op == "mul" else str(x) for x in self.args)
            return f"{a}*{b}"
        if self.op in ("add", "sub"):
            return f"({self.args[0]} {'+' if self.op == 'add' else '-'} {self.args[1]})"
        if self.op == "muladd":
            return f"({self.args[0]}*{self.args[1]} + {self.args[2]})"
        return f"{self.op}({', '.join(map(str, self.args))})"


@dataclass(frozen=True)
class Site:
    """One place where a compiler may contract ``a*b + c`` into an FMA."""

    formula: str
    index: int  # order of the muladd call in the formula
    a: str
    b: str
    c: str
    alternative: tuple[str, str] | None  # c = x*y: the compiler may contract that product instead

    @property
    def removes(self) -> str:
        """The rounding that contracting the site (as marked) removes."""
        return f"fl({self.a}*{self.b})"

    @property
    def fused(self) -> str:
        return f"fma({self.a}, {self.b}, {self.c})"

    @property
    def fused_alt(self) -> str | None:
        if self.alternative is None:
            return None
        return f"fma({self.alternative[0]}, {self.alternative[1]}, fl({self.a}*{self.b}))"


class SiteTracer(Arithmetic):
    """A symbolic arithmetic recording the contraction sites of one formula evaluation."""

    def __init__(self, formula: str):
        self.formula = formula
        self.name = f"trace[{formula}]"
        self.sites: list[Site] = []
        self.unmarked: list[str] = []

    @staticmethod
    def _node(x) -> Node:
        return x if isinstance(x, Node) else Node("const", (), repr(x))

    def const(self, x):
        return Node("const", (), repr(float(x)))

    def _check_unmarked(self, op, a, b):
        for x in (a, b):
            if isinstance(x, Node) and x.op == "mul":
                self.unmarked.append(f"{self.formula}: {op}({a}, {b}) adds the unrounded product {x}")

    def add(self, a, b):
        self._check_unmarked("add", a, b)
        return Node("add", (self._node(a), self._node(b)))

    def sub(self, a, b):
        self._check_unmarked("sub", a, b)
        return Node("sub", (self._node(a), self._node(b)))

    def mul(self, a, b):
        return Node("mul", (self._node(a), self._node(b)))

    def neg(self, a):
        return Node("neg", (self._node(a),))

    def muladd(self, a, b, c):
        a, b, c = self._node(a), self._node(b), self._node(c)
        alt = (str(c.args[0]), str(c.args[1])) if c.op == "mul" else None
        self.sites.append(Site(self.formula, len(self.sites), str(a), str(b), str(c), alt))
        return Node("muladd", (a, b, c))

    def maximum(self, a, b):
        return Node("max", (self._node(a), self._node(b)))

    def zero_to(self, a, b):
        return Node("zero_to", (self._node(a), self._node(b)))

    def sqrt(self, a):
        return Node("sqrt", (self._node(a),))

    def div(self, a, b):
        return Node("div", (self._node(a), self._node(b)))


def formula_names() -> list[str]:
    """Every formula of :mod:`dora_num.numerics.formulas` (public functions taking ``ar`` first)."""
    out = []
    for name, fn in inspect.getmembers(F, inspect.isfunction):
        if fn.__module__ != F.__name__ or name.startswith("_"):
            continue
        params = list(inspect.signature(fn).parameters)
        if params and params[0] == "ar":
            out.append(name)
    return sorted(out)


def formula_inputs(name: str) -> list[str]:
    """The formula's input names (its parameters after ``ar``)."""
    return list(inspect.signature(getattr(F, name)).parameters)[1:]


def trace(name: str) -> SiteTracer:
    tr = SiteTracer(name)
    getattr(F, name)(tr, *[Node("input", (), p) for p in formula_inputs(name)])
    return tr


def contraction_sites(names: list[str] | None = None) -> list[Site]:
    """Every contraction site of the formulas (all of them by default)."""
    sites = []
    for name in names or formula_names():
        tr = trace(name)
        if tr.unmarked:
            raise AssertionError("contractible adds not marked by muladd: " + "; ".join(tr.unmarked))
        sites.extend(tr.sites)
    return sites


def placements(name: str) -> list[tuple[str, ...]]:
    """Every way of contracting the formula's sites: one choice per site from
    ``"none"``, ``"fma"`` and (where the addend is a product) ``"alt"``."""
    choices = [("none", "fma") + (("alt",) if s.alternative else ()) for s in contraction_sites([name])]
    return list(itertools.product(*choices))


def placement_label(p: tuple[str, ...]) -> str:
    return "+".join(f"s{i}:{c}" for i, c in enumerate(p) if c != "none") or "none"


# --------------------------------------------------------------------------
# Evaluating a placement exactly
# --------------------------------------------------------------------------


class Placement(RoundEach):
    """fp32, one rounding per operation, each ``muladd`` contracted per ``choice``."""

    def __init__(self, choice: tuple[str, ...], fmt="fp32"):
        super().__init__(fmt)
        bad = [c for c in choice if c not in ("none", "fma", "alt")]
        if bad:
            raise ValueError(f"choice entries must be 'none', 'fma' or 'alt', got {bad}")
        self.choice = tuple(choice)
        self.name = f"{self.fmt.name}-placement[{placement_label(self.choice)}]"
        self._calls = 0
        self._products: dict[int, tuple] = {}
        # per site, in call order: the fp32 product fl(a*b), the rounding error an FMA removes
        # (|a*b - fl(a*b)|, exact) and the site's output (what the formula carries on)
        self.records: list[dict] = []
        self._contracting = RoundEach(fmt, fma=True)

    def mul(self, a, b):
        out = super().mul(a, b)
        self._products[id(out)] = (out, a, b)  # keep `out` alive so its id stays unique
        return out

    def _fma(self, a, b, c):
        """``fl(a*b + c)``, one rounding: the numerics engineer's contracting arithmetic."""
        return self._contracting.muladd(a, b, c)

    def muladd(self, a, b, c):
        if self._calls >= len(self.choice):
            raise ValueError(f"the formula has more contraction sites than the {len(self.choice)} choices given")
        how = self.choice[self._calls]
        self._calls += 1
        p, e = two_prod(np.asarray(a, np.float64), np.asarray(b, np.float64))
        p32 = self._round2(p, e)
        removed = np.abs((p - p32) + e)  # exact: p - p32 is exact (Sterbenz), e tiny against it
        if how == "none":
            out = self.add(self.mul(a, b), c)
        elif how == "fma":
            out = self._fma(a, b, c)
        else:
            hit = self._products.get(id(c))
            if hit is None or hit[0] is not c:
                raise ValueError("choice 'alt' needs the addend to be a product formed in this arithmetic")
            out = self._fma(hit[1], hit[2], self.mul(a, b))
        self.records.append({"product": p32, "removed": removed, "out": out})
        return out

    def finish(self) -> None:
        if self._calls != len(self.choice):
            raise ValueError(f"the formula used {self._calls} contraction sites, {len(self.choice)} choices given")


def evaluate(name: str, choice: tuple[str, ...], inputs: dict, *, sqrt=None, records: list | None = None) -> np.ndarray:
    """``formula(name)`` under :class:`Placement` ``choice`` on fp32 values (float64 arrays).

    ``inputs`` maps the formula's input names to arrays or Python floats.
    ``sqrt`` (optional) replaces the arithmetic's correctly rounded square root,
    e.g. :func:`sqrt_other_neighbour` for the worst faithful approximation, or the
    identity to read the value under the root.  ``records`` (a list) receives the
    per-site records of :class:`Placement`.
    """
    ar = Placement(choice)
    if sqrt is not None:
        ar.sqrt = sqrt
    args = [inputs[k] for k in formula_inputs(name)]
    out = getattr(F, name)(ar, *args)
    ar.finish()
    if records is not None:
        records.extend(ar.records)
    return out


# --------------------------------------------------------------------------
# Square roots: exact checks, neighbours, distance to the rounding boundary
# --------------------------------------------------------------------------


def _f32_values(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if not np.array_equal(round_to(a, "fp32"), a, equal_nan=True):
        raise ValueError(f"{name} must hold fp32 values")
    return a


def sqrt_rn(x) -> np.ndarray:
    """Correctly rounded fp32 square root (float64 sqrt rounded to fp32: innocuous, 53 >= 2*24 + 2)."""
    x = _f32_values(x, "x")
    with np.errstate(invalid="ignore"):
        return round_to(np.sqrt(x), "fp32")


def _next32(r: np.ndarray, direction: float) -> np.ndarray:
    return np.nextafter(r.astype(np.float32), np.float32(direction)).astype(np.float64)


def sqrt_is_correctly_rounded(x, r) -> np.ndarray:
    """Exact test that ``r`` is the correctly rounded fp32 ``sqrt(x)`` (``x >= 0`` fp32).

    ``r`` is correct iff ``lo^2 < x < hi^2`` with ``lo``, ``hi`` the midpoints
    between ``r`` and its fp32 neighbours.  Midpoints have at most 25 significant
    bits, so their squares (<= 50 bits) and the comparisons are exact in float64;
    the root of an fp32 number is never a midpoint (so the inequalities are strict).
    """
    x = _f32_values(x, "x")
    r = _f32_values(r, "r")
    x, r = np.broadcast_arrays(x, r)
    lo = (r + np.maximum(_next32(r, -np.inf), 0.0)) / 2
    hi = (r + _next32(r, np.inf)) / 2
    ok = (lo * lo < x) & (x < hi * hi)
    return np.where(x == 0, r == 0, ok & (r > 0))


def sqrt_neighbours(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rn, other, exact)`` for fp32 ``x >= 0``: the correctly rounded root, the other
    fp32 neighbour of the exact root (== ``rn`` where the root is exact), and the mask
    of exact roots.  Decided exactly: ``rn^2`` (48 bits) is exact in float64."""
    rn = sqrt_rn(x)
    x = np.asarray(x, dtype=np.float64)
    sq = rn * rn
    exact = sq == x
    other = np.where(sq < x, _next32(rn, np.inf), _next32(rn, -np.inf))
    return rn, np.where(exact | (x == 0), rn, other), exact | (x == 0)


def sqrt_other_neighbour(x) -> np.ndarray:
    """The worst faithful square root: the neighbour that is *not* correctly rounded
    (wherever the root is inexact).  An upper bound on what ``sqrt.approx`` can change."""
    return sqrt_neighbours(x)[1]


def midpoint_distance(x) -> np.ndarray:
    """Distance from the exact ``sqrt(x)`` to the nearest rounding boundary of fp32, in
    ulps of the result (in ``(0, 0.5]``; 0.5 for an exact root).  Float64 estimate
    (absolute error ~2^-28 ulp): descriptive, never used to decide a rounding."""
    x = np.asarray(x, dtype=np.float64)
    rn, other, exact = sqrt_neighbours(x)
    # |sqrt(x) - rn| = |x - rn^2| / (sqrt(x) + rn): x - rn^2 exact by TwoProduct
    p, e = two_prod(rn, rn)
    diff = (x - p) - e
    with np.errstate(invalid="ignore", divide="ignore"):
        dist = np.abs(diff) / (np.sqrt(x) + rn)
        spacing = np.abs(other - rn)
        d = 0.5 - dist / np.where(spacing > 0, spacing, 1.0)
    return np.where(exact, 0.5, d)


@dataclass
class FaithfulCheck:
    """How a measured square root compares with the faithful model."""

    n: int
    n_exact_root: int  # inputs whose root is an fp32 number (no freedom)
    n_rn: int  # outputs equal to the correctly rounded root
    n_other: int  # outputs equal to the other neighbour (1 ulp off)
    n_outside: int  # outputs that are neither: the faithful model is wrong there
    rate_bounds: tuple[float, float] = field(default=(0.0, 0.0))  # the model's disagreement-rate interval

    @property
    def disagreement(self) -> float:
        return (self.n - self.n_rn) / max(self.n, 1)


def check_faithful(x, measured) -> FaithfulCheck:
    """Classify measured fp32 roots of ``x`` against the faithful model."""
    rn, other, exact = sqrt_neighbours(x)
    measured = _f32_values(measured, "measured")
    is_rn = measured == rn
    is_other = ~is_rn & (measured == other)
    n = int(np.size(rn))
    n_inexact = int((~exact).sum())
    return FaithfulCheck(n=n, n_exact_root=int(exact.sum()), n_rn=int(is_rn.sum()), n_other=int(is_other.sum()),
                         n_outside=int((~is_rn & ~is_other).sum()), rate_bounds=(0.0, n_inexact / max(n, 1)))
