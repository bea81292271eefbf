"""Every bound of dora_num.numerics.bounds over the whole domain of its formula, class by
class, against exact ground truth written here (Fraction arithmetic; nothing from
dora_num.numerics.ground_truth): gradual underflow of many squares and products,
subnormal entries, fp32-inexact scales (rsLoRA) under strong cancellation, zero rows,
overflow of intermediates and of dg's partial sums, g outside [0.5, 2], fp8 e4m3fn
saturation.  Where a bound is finite the exact check ``|computed - exact| <= bound`` is
made in rationals (for a norm: ``(w - E)^2 <= Q <= (w + E)^2``); where the computation
overflows the bound must be ``inf``; a bound is never NaN.  The measured tightness
(largest error / bound) per class goes to build/test-reports/numerics_*.json.
"""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import mpmath
import numpy as np
import pytest
import torch

from dora_num.numerics import formulas as F
from dora_num.numerics.arithmetic import TorchFP32, TorchFP32CorrectSqrt
from dora_num.numerics.bounds import (compose_bound, compose_condition, compose_ulp_bound, dense_norm_bound,
                                      dg_bound, factored_norm_bound, factored_norm_posterior,
                                      lora_row_magnitudes, magnitude_scale_bound, one_ulp_condition)
from dora_num.numerics.emulate import emulate
from dora_num.numerics.formats import FORMATS, round_to
from dora_num.ops.norm import dense_row_norm, factored_row_norm

from ._exact_ref import exact_row_norm_sq, norm_within, round_float

F32 = lambda x: round_to(np.asarray(x, dtype=np.float64), "fp32")  # noqa: E731
SCALES = {"0.5": 0.5, "rslora_2/sqrt7": 2 / math.sqrt(7), "rslora_16/sqrt5": 16 / math.sqrt(5), "alpha/r_8/3": 8 / 3}


# ----------------------------------------------------------------------- exact helpers

_exact_q, _within = exact_row_norm_sq, norm_within


def _ratio(w: float, E: float, q: Fr) -> float:
    with mpmath.workdps(60):
        err = abs(mpmath.mpf(w) - mpmath.sqrt(mpmath.mpf(q.numerator) / q.denominator))
        return float(err / E) if E > 0 else (0.0 if err == 0 else math.inf)


# ----------------------------------------------------------------------- norm classes

def _rows(case: str, rng, d: int = 512, r: int = 4, rows: int = 6):
    """(W, A, B, scale) of one class; fp32 values (float64 storage)."""
    A = F32(rng.standard_normal((r, d)) / np.sqrt(d))
    B = F32(rng.standard_normal((rows, r)))
    s = 0.5
    if case == "underflow_squares":  # every square subnormal: d underflow sites per row
        W = F32(rng.uniform(0.5, 1.0, (rows, d)) * 3e-23)
        B = F32(B * 1e-24)
    elif case == "subnormal_entries":  # subnormal W entries beside normal ones, tiny B: U's products underflow
        W = F32(rng.choice([-1, 1], (rows, d)) * np.where(rng.random((rows, d)) < 0.5, 1e-40, 1e-20))
        B = F32(B * 1e-25)
    elif case == "products_underflow":  # A tiny, B huge (B A is invariant): the d products of every entry
        W = F32(rng.standard_normal((rows, d)) * 1e-3)  # of U = W A^T and of G = A A^T underflow
        A = F32(A * 1e-24)
        B = F32(B * 1e22)
    elif case.startswith("cancel_"):  # W = -s BA + tau ||sBA|| N, rsLoRA / alpha-over-r scales
        s = SCALES[case[len("cancel_"):]]
        sf = F.scale_constants(s)[0]
        V = sf * (B @ A)
        tau = np.exp(np.linspace(0, np.log(1e-9), rows))
        W = F32(-V + tau[:, None] * np.linalg.norm(V, axis=1, keepdims=True) * rng.standard_normal((rows, d)) / np.sqrt(d))
    elif case == "zero_rows":
        W = F32(rng.standard_normal((rows, d)))
        W[:3] = 0.0
        B[0] = 0.0
        B[3] = 0.0
    elif case == "near_overflow":  # squares near the top of fp32: the row sums straddle the overflow threshold
        W = F32(rng.uniform(0.9, 1.0, (rows, d)) * np.linspace(1.5e18, 3.5e18, rows)[:, None] / math.sqrt(d / 64))
        B = np.zeros_like(B)
    elif case == "realistic":
        W = F32(rng.standard_normal((rows, d)) / np.sqrt(d))
        B = F32(B * 1e-3)
    else:
        raise ValueError(case)
    return W, A, B, s


NORM_CASES = ["underflow_squares", "subnormal_entries", "products_underflow", "cancel_0.5", "cancel_rslora_2/sqrt7",
              "cancel_rslora_16/sqrt5", "cancel_alpha/r_8/3", "zero_rows", "near_overflow", "realistic"]


def _t(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float32))


@pytest.mark.parametrize("case", NORM_CASES)
def test_row_norm_bounds_hold_per_row_over_the_domain(case, record):
    rng = np.random.default_rng([5, NORM_CASES.index(case)])
    W, A, B, s = _rows(case, rng)
    q = _exact_q(W, A, B, s)
    bf = factored_norm_bound(W, A, B, s)
    bd = dense_norm_bound(W, A, B, s)
    assert not np.isnan(bf).any() and not np.isnan(bd).any()
    worst = {"factored": 0.0, "dense": 0.0}
    n_inf = {"factored": 0, "dense": 0}
    for j in range(W.shape[0]):  # one row at a time: a row that overflows must not hide the others
        row = (_t(W[j:j + 1]), _t(A), _t(B[j:j + 1]))
        for name, fn, bound in (("factored", factored_row_norm, bf[j]), ("dense", dense_row_norm, bd[j])):
            try:
                w = float(fn(*row, s)[0])
            except ValueError as e:  # the norm overflowed fp32 and says so: there must be no finite bound
                assert "overflow" in str(e)
                w = math.inf
            if not math.isfinite(w):
                assert math.isinf(bound), (name, j)
                n_inf[name] += 1
                continue
            if math.isinf(bound):
                n_inf[name] += 1
                continue
            assert _within(w, bound, q[j]), (case, name, j, w, bound)
            worst[name] = max(worst[name], _ratio(w, bound, q[j]))
    for name in worst:
        record("norm_bounds", case=case, norm=name, ratio_err_over_bound=worst[name], n_rows=W.shape[0],
               n_no_bound=n_inf[name])
    if case != "near_overflow":
        assert n_inf["factored"] == n_inf["dense"] == 0, n_inf
    else:  # some rows fit, some overflow: both kinds occur
        assert 0 < n_inf["dense"] < W.shape[0]


@pytest.mark.parametrize("case", NORM_CASES)
def test_factored_norm_posterior_bound_from_the_fp32_terms(case, record):
    """The guard's a-posteriori bound: from the computed fp32 terms alone, rel >= |w^ - w| / w."""
    rng = np.random.default_rng([6, NORM_CASES.index(case)])
    W, A, B, s = _rows(case, rng)
    if case == "near_overflow":
        W = W / 2.0**40  # the terms must be finite for the guard to evaluate them
    q = _exact_q(W, A, B, s)
    Wt, At, Bt = _t(W), _t(A), _t(B)
    _, two_s, s_sq = F.scale_constants(s)
    base = (Wt * Wt).sum(1)
    U, G = Wt @ At.T, At @ At.T
    cross, ba = (Bt * U).sum(1), ((Bt @ G) * Bt).sum(1)
    w_hat = F.norm_assembly(TorchFP32CorrectSqrt, base, cross, ba, two_s, s_sq)
    lora_abs, b_abs = lora_row_magnitudes(Bt, G, d_in=W.shape[1])
    kappa, rel = factored_norm_posterior(base, cross, ba, two_s, s_sq, d_in=W.shape[1], r=A.shape[0],
                                         lora_abs=lora_abs, b_abs=b_abs)
    assert kappa.dtype == rel.dtype == torch.float32 and not torch.isnan(rel).any() and not torch.isnan(kappa).any()
    worst, n_inf = 0.0, 0
    for j in range(W.shape[0]):
        rj, wj = float(rel[j]), float(w_hat[j])
        if math.isinf(rj):
            n_inf += 1
            continue
        lo = Fr(wj) / (1 + Fr(rj))  # |w^ - w| <= rel w  <=>  w in [lo, hi]
        assert lo * lo <= q[j], (case, j, wj, rj)
        if rj < 1:
            assert q[j] <= (Fr(wj) / (1 - Fr(rj))) ** 2, (case, j, wj, rj)
        with mpmath.workdps(60):
            w = mpmath.sqrt(mpmath.mpf(q[j].numerator) / q[j].denominator)
            worst = max(worst, float(abs(mpmath.mpf(wj) - w) / w / rj) if w > 0 else 0.0)
    record("posterior", case=case, ratio_rel_err_over_rel_bound=worst, n_rows=W.shape[0], n_inf=n_inf,
           kappa_max=float(kappa[torch.isfinite(kappa)].max()) if torch.isfinite(kappa).any() else math.inf)
    if case == "realistic":
        assert n_inf == 0 and float(rel.max()) < 1e-4  # the guard would not fire on these rows
    if case == "underflow_squares":  # every square subnormal: no relative accuracy is guaranteed (dense alike)
        assert (rel > 0.01).all()


def test_old_nan_class_scale_with_inexact_square_under_strong_cancellation():
    """The class that gave NaN: ``s^2`` inexact in fp32 and ``W = -s BA`` exactly representable."""
    rng = np.random.default_rng(9)
    for s in SCALES.values():
        A = F32(rng.standard_normal((4, 64)) / 8)
        B = F32(rng.standard_normal((5, 4)))
        W = F32(-F.scale_constants(s)[0] * (B @ A))
        bf = factored_norm_bound(W, A, B, s)
        assert np.isfinite(bf).all()
        q = _exact_q(W, A, B, s)
        w = factored_row_norm(_t(W), _t(A), _t(B), s).double().numpy()
        assert all(_within(float(w[j]), float(bf[j]), q[j]) for j in range(5))


# ----------------------------------------------------------------------- dg

def test_dg_bound_is_inf_where_fp32_partial_sums_may_overflow(record):
    """Exact dg in range, fp32 partial sums beyond 3.4e38: the computed dg is inf/NaN, so the
    bound must be inf; elsewhere (random columns, subnormal products) it holds exactly."""
    rng = np.random.default_rng(10)
    T, N = 64, 8
    base = F32(rng.standard_normal((T, N)))
    lora = F32(rng.standard_normal((T, N)) * 0.1)
    grad = F32(rng.standard_normal((T, N)))
    base[:, 0] = np.tile([3e38, 3e38, -3e38, -3e38], T // 4)  # partial sums overflow, exact dg = 0
    grad[:, 0] = 1.0
    base[:, 1], grad[:, 1] = 1e30, np.tile([1e9, -1e9], T // 2)  # each product overflows
    base[:, 2], lora[:, 2], grad[:, 2] = 1e-30, 0.0, 1e-16  # every product subnormal: T underflow sites
    s = 2 / math.sqrt(7)
    sf = F.scale_constants(s)[0]
    inner = F.compose_inner(TorchFP32, _t(base), _t(lora), sf)
    dg = F.compose_grad_g_terms(TorchFP32, inner, _t(grad)).sum(0).double().numpy()
    bound = dg_bound(s, lora, base, grad, "eager")
    assert not np.isnan(bound).any()
    assert np.isinf(bound[:2]).all()
    worst = 0.0
    for n in range(N):
        exact = sum((Fr(sf) * Fr(lora[k, n]) + Fr(base[k, n])) * Fr(grad[k, n]) for k in range(T))
        if not np.isfinite(dg[n]):
            assert np.isinf(bound[n])
            continue
        if np.isfinite(bound[n]):
            assert abs(Fr(dg[n]) - exact) <= Fr(bound[n]), n
            worst = max(worst, float(abs(Fr(dg[n]) - exact) / Fr(bound[n])) if bound[n] > 0 else 0.0)
    record("dg", case="overflow_and_subnormal_columns", ratio_err_over_bound=worst)


# ----------------------------------------------------------------------- compose

def _compose_cases(rng, n, fmt):
    f = FORMATS[fmt]
    r = lambda x: round_to(round_to(x, "fp32"), fmt)  # noqa: E731
    k = n // 5
    base = np.concatenate([r(rng.standard_normal(k) * f.min_normal), r(rng.standard_normal(k) * f.max / 4),
                           r(rng.standard_normal(k)), r(rng.standard_normal(k)), r(rng.standard_normal(n - 4 * k))])
    lora = np.concatenate([r(rng.standard_normal(k) * f.min_subnormal * 3), r(rng.standard_normal(k) * f.max / 8),
                           r(rng.standard_normal(k) * 0.02), r(rng.standard_normal(k)), r(rng.standard_normal(n - 4 * k))])
    g = np.concatenate([F32(1 + rng.standard_normal(k) * 1e-3), F32(1 + rng.standard_normal(k) * 1e-3),
                        F32(rng.choice([-1, 1], k) * np.exp2(rng.uniform(-30, 12, k))),  # outside [0.5, 2], negative
                        F32(np.full(k, 500.0)),  # e4m3fn: g held in the format saturates to 448
                        F32(1 + rng.standard_normal(n - 4 * k) * 1e-5)])
    return base, lora, g


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compose_bounds_over_the_domain(fmt, record):
    rng = np.random.default_rng([11, list(FORMATS).index(fmt)])
    base, lora, g = _compose_cases(rng, 1500, fmt)
    s = 2 / math.sqrt(7)
    sf = Fr(F.scale_constants(s)[0])
    exact = [(Fr(g[i]) - 1) * Fr(base[i]) + Fr(g[i]) * (sf * Fr(lora[i])) for i in range(base.size)]
    for formula in ("compose_stable", "compose_naive"):
        for variant, g_in in (("per_op", "storage"), ("fp32", "fp32"), ("fp32", "storage"), ("fp32_fma", "fp32")):
            out = emulate(formula, {"base": base, "lora": lora, "g": g, "s": s}, fmt, variant, g_in)
            E = compose_bound(formula, base, lora, g, s, fmt, variant, g_in)
            assert not np.isnan(E).any(), (formula, variant)
            worst = 0.0
            for i in np.flatnonzero(np.isfinite(E)):
                assert np.isfinite(out[i]), (formula, variant, i)
                err = abs(Fr(out[i]) - exact[i])
                assert err <= Fr(E[i]), (formula, variant, g_in, i, base[i], lora[i], g[i])
                worst = max(worst, float(err / Fr(E[i])) if E[i] > 0 else 0.0)
            assert (~np.isfinite(out) <= np.isinf(E)).all()  # a non-finite result only where there is no bound
            record("compose", case=f"{fmt}/{formula}/{variant}/g_{g_in}", ratio_err_over_bound=worst,
                   n_no_bound=int(np.isinf(E).sum()))


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_compose_ulp_bound_and_the_one_ulp_condition(fmt, record):
    """The ulp form of lemma 1 on cancelling inputs: measured ulps <= bound for every element,
    and <= 1 wherever kappa_c <= one_ulp_condition(fmt) (g in [0.5, 2])."""
    from dora_num.numerics.formats import ulp_distance

    rng = np.random.default_rng([12, len(fmt)])
    n = 4000
    s = 2 / math.sqrt(7)
    sf = F.scale_constants(s)[0]
    b = round_to(F32(rng.standard_normal(n)), fmt)
    g = F32(1 + rng.choice([-1, 1], n) * np.exp(rng.uniform(np.log(1e-5), np.log(1e-2), n)))
    rho = 1 + rng.choice([-1, 1], n) * np.exp(rng.uniform(np.log(1e-7), 0, n))  # (g-1) b ~ -g s lora
    lo = round_to(F32(-(g - 1) * b / (g * sf) * rho), fmt)
    kap = compose_condition(b, lo, g, s)
    out = emulate("compose_stable", {"base": b, "lora": lo, "g": g, "s": s}, fmt, "fp32")
    ub = compose_ulp_bound("compose_stable", b, lo, g, s, fmt, "fp32")
    want = np.array([round_float(fmt, (Fr(g[i]) - 1) * Fr(b[i]) + Fr(g[i]) * Fr(sf) * Fr(lo[i])) for i in range(n)])
    ulps = np.abs(ulp_distance(out, want, fmt))
    assert (ulps <= ub).all()
    K = one_ulp_condition(fmt)
    well = kap <= K
    assert (ub[well] <= 1).all() and (ulps[well] <= 1).all()
    if K > 0:
        assert well.any() and (~well).any()
    record("compose_ulps", case=f"{fmt}/stable/fp32", one_ulp_kappa=K, max_ulps=float(ulps.max()),
           max_ulps_well=float(ulps[well].max()) if well.any() else math.nan,
           frac_within_1ulp=float((ulps <= 1).mean()), ratio_ulps_over_bound=float((ulps / ub).max()))


# ----------------------------------------------------------------------- magnitude scale

def _magnitude_cases():
    """``(m, w, w_hat, rel, eps)``: w^ = w (1 - rel) with rel from 2^-24 to 2^-2, subnormal m, rows below eps,
    zero rows; ``rel`` an upper bound of the exact relative error of each w^."""
    rng = np.random.default_rng(13)
    n = 3000
    w = F32(np.exp2(rng.uniform(-20, 20, n)))
    rel_target = np.exp2(rng.uniform(-24, -2, n))
    w_hat = F32(w * (1 - rel_target))
    m = F32(w * (1 + rng.standard_normal(n) * 1e-3))
    m[:100] = F32(rng.uniform(1, 2, 100) * 2.0**-140)  # subnormal m: the quotient's underflow site
    w[100:200] = w_hat[100:200] = F32(np.full(100, 1e-13))  # below eps: g = m / w all the same
    w[200:220] = w_hat[200:220] = 0.0  # zero rows: g = m / eps (eps guards zero rows only)
    rel = np.array([float(abs(Fr(w_hat[i]) - Fr(w[i])) / Fr(w[i])) if w[i] else 0.0 for i in range(n)])
    return m, w, w_hat, np.nextafter(rel, np.inf), 1e-12


def former_magnitude_bound_violations() -> tuple[int, int]:
    """How many of :func:`_magnitude_cases` the former bound ``u + (1 + u) rel`` (relative) misses, and of how
    many (docs/bounds.md, lemma 6, quotes it)."""
    m, w, w_hat, rel, eps = _magnitude_cases()
    e32 = Fr(float(np.float32(eps)))
    g_hat = F.magnitude_scale(TorchFP32, _t(m), _t(w_hat), eps).double().numpy()
    n = 0
    for i in range(m.size):
        g = Fr(m[i]) / (Fr(w[i]) if w[i] != 0 else e32)
        n += abs(Fr(g_hat[i]) - g) > (Fr(2.0**-24) + (1 + Fr(2.0**-24)) * Fr(rel[i])) * abs(g)
    return n, m.size


def test_magnitude_scale_bound_second_order(record):
    """``g^ = fl32(m / w^)`` with ``w^ = w (1 - rel)``: the error reaches ``(u + rel)/(1 - rel)``,
    beyond the former ``u + (1+u) rel`` once ``rel > ~2^-12``; the bound holds exactly, also
    below eps and for subnormal m."""
    m, w, w_hat, rel, eps = _magnitude_cases()
    e32 = Fr(float(np.float32(eps)))
    g_hat = F.magnitude_scale(TorchFP32, _t(m), _t(w_hat), eps).double().numpy()
    E = magnitude_scale_bound(m, w_hat, eps, rel)
    worst = 0.0
    for i in range(m.size):
        g = Fr(m[i]) / (Fr(w[i]) if w[i] != 0 else e32)
        err = abs(Fr(g_hat[i]) - g)
        assert err <= Fr(E[i]), i
        worst = max(worst, float(err / Fr(E[i])))
    old_broken = former_magnitude_bound_violations()[0]
    assert old_broken > 0  # the former docstring bound fails on this class
    record("magnitude_scale", case="w^ = w(1 - rel), subnormal m, below eps", ratio_err_over_bound=worst,
           n_former_bound_violated=old_broken)


# ----------------------------------------------------------------------- norm assembly

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_assembly_bound_over_the_domain(fmt, record):
    """Lemma 3 per arithmetic: cancellation (Q -> 0 and Q < 0: the clamp), subnormal terms,
    zero rows, inexact 2s and s^2 (rsLoRA), terms near the format's overflow; exact
    reference ``sqrt(max(Q, 0))`` of the given terms and fp32 constants, decided in rationals."""
    from dora_num.numerics.bounds import assembly_bound

    f = FORMATS[fmt]
    rng = np.random.default_rng([14, list(FORMATS).index(fmt)])
    n = 1200
    s = 2 / math.sqrt(7)
    _, two_s, s_sq = F.scale_constants(s)
    top = min(f.max, FORMATS["fp32"].max)
    b = rng.uniform(0.05, 1.0, n) * min(100.0, top / 32)
    t = 1 + rng.standard_normal(n) * np.exp2(-rng.uniform(2, 24, n))
    a = b * t * t / s**2
    c = (-1 + np.exp2(-rng.uniform(1, 40, n))) * np.sqrt(a * b)
    c[:100] = -np.sqrt(a[:100] * b[:100]) * 1.01  # Q < 0 exactly: the clamp
    b[100:150], c[100:150], a[100:150] = 0.0, 0.0, 0.0
    sub = slice(150, 300)  # subnormal terms of the storage format
    b[sub], c[sub], a[sub] = (rng.uniform(0, 64, 150) * f.min_subnormal for _ in range(3))
    hi = slice(300, 400)  # near the format's overflow
    b[hi], a[hi], c[hi] = rng.uniform(0.2, 0.5, 100) * top, rng.uniform(0, 0.2, 100) * top, rng.uniform(-1, 1, 100) * top / 4
    b, c, a = F32(b), F32(c), F32(a)
    q = [Fr(b[i]) + Fr(two_s) * Fr(c[i]) + Fr(s_sq) * Fr(a[i]) for i in range(n)]
    for variant in ("per_op", "fp32", "fp32_fma"):
        out = emulate("norm_assembly", {"base_sq": b, "cross": c, "ba": a, "s": s}, fmt, variant)
        E = assembly_bound(b, c, a, s, fmt, variant)
        assert not np.isnan(E).any()
        worst = 0.0
        for i in np.flatnonzero(np.isfinite(E)):
            assert np.isfinite(out[i]), (variant, i)
            assert _within(float(out[i]), float(E[i]), max(q[i], Fr(0))), (fmt, variant, i)
            worst = max(worst, _ratio(float(out[i]), float(E[i]), max(q[i], Fr(0))))
        record("assembly", case=f"{fmt}/{variant}", ratio_err_over_bound=worst, n_no_bound=int(np.isinf(E).sum()))


# ----------------------------------------------------------------------- never NaN, and the domain's edges

def _exact_compose(base, lora, g, s):
    sf = Fr(F.scale_constants(s)[0])
    return [(Fr(g[i]) - 1) * Fr(base[i]) + Fr(g[i]) * (sf * Fr(lora[i])) for i in range(len(base))]


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e5m2", "fp8_e4m3fn", "bf16"])
def test_compose_bounds_with_g_beyond_the_format_are_inf_not_nan(fmt):
    """g = m / eps = 1e5 on a zero row held in fp16 or e5m2 overflows to inf there (e4m3fn saturates to
    448, bf16 holds it): at base = lora = 0 and beside it the computed compose is not finite, so the
    bound and the ulp bound are inf there, never NaN, and hold exactly wherever they are finite."""
    base = np.array([0.0, 0.0, 1.5, -2.0])
    lora = np.array([0.0, 1.0, 0.0, 3.0])
    g = np.full(4, 1e5)
    s = 0.5
    exact = _exact_compose(base, lora, g, s)
    for formula in ("compose_stable", "compose_naive"):
        for variant, g_in in (("per_op", "storage"), ("fp32", "storage"), ("fp32_fma", "storage"), ("fp32", "fp32")):
            E = compose_bound(formula, base, lora, g, s, fmt, variant, g_in)
            ub = compose_ulp_bound(formula, base, lora, g, s, fmt, variant, g_in)
            assert not np.isnan(E).any() and not np.isnan(ub).any(), (formula, variant, g_in, E, ub)
            out = emulate(formula, {"base": base, "lora": lora, "g": g, "s": s}, fmt, variant, g_in)
            for i in range(4):
                if not np.isfinite(out[i]):
                    assert np.isinf(E[i]) and np.isinf(ub[i]), (formula, variant, g_in, i)
                elif np.isfinite(E[i]):
                    assert abs(Fr(out[i]) - exact[i]) <= Fr(E[i]), (formula, variant, g_in, i)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"])
def test_per_op_compose_bound_charges_the_storage_of_wider_inputs(fmt):
    """Per-op stores base and lora in the format before it computes; given fp32 values (not values of the
    format) the exact result is that of the given values, and the bound charges their storage rounding."""
    rng = np.random.default_rng([17, len(fmt)])
    n = 4000
    f = FORMATS[fmt]
    base = F32(rng.standard_normal(n) * np.exp2(rng.uniform(np.log2(f.min_subnormal), np.log2(f.max) - 8, n)))
    lora = F32(base * rng.standard_normal(n) * np.exp2(rng.uniform(-12, 2, n)))
    g = F32(np.where(rng.random(n) < 0.5, 1 + rng.standard_normal(n) * np.exp2(rng.uniform(-14, 0, n)),
                     rng.choice([-1, 1], n) * np.exp2(rng.uniform(-20, 10, n))))
    s = 16 / math.sqrt(5)
    exact = _exact_compose(base, lora, g, s)
    for formula in ("compose_stable", "compose_naive"):
        out = emulate(formula, {"base": base, "lora": lora, "g": g, "s": s}, fmt, "per_op", "storage")
        E = compose_bound(formula, base, lora, g, s, fmt, "per_op", "storage")
        assert not np.isnan(E).any()
        for i in np.flatnonzero(np.isfinite(E)):
            assert abs(Fr(out[i]) - exact[i]) <= Fr(E[i]), (formula, i, base[i], lora[i], g[i])


def test_assembly_bound_at_the_scale_extremes_is_inf_or_holds_never_nan():
    """s^2 beyond fp32 (s = 2e19: the fp32 constant s^2 is inf) and s = 0 under per-op with a term beyond
    the format (stored as inf, multiplied by 0: NaN in the computation): inf there, never NaN; the
    exact check wherever the bound is finite."""
    from dora_num.numerics.bounds import assembly_bound

    b = F32(np.array([1.0, 4.0, 0.0, 2.0]))
    c = F32(np.array([0.0, -1.0, 0.0, 1e30]))
    a = F32(np.array([0.0, 1e30, 0.0, 1e30]))
    for s in (2e19, 0.0, 1e-30, 3e38):
        _, two_s, s_sq = F.scale_constants(s)
        for fmt in ("bf16", "fp16", "fp32", "fp8_e4m3fn"):
            for variant in ("per_op", "fp32", "fp32_fma"):
                E = assembly_bound(b, c, a, s, fmt, variant)
                assert not np.isnan(E).any(), (s, fmt, variant, E)
                with np.errstate(all="ignore"):
                    out = emulate("norm_assembly", {"base_sq": b, "cross": c, "ba": a, "s": s}, fmt, variant)
                for i in range(4):
                    if not np.isfinite(out[i]):
                        assert np.isinf(E[i]), (s, fmt, variant, i)
                    elif np.isfinite(E[i]):
                        q = Fr(b[i]) + Fr(two_s) * Fr(c[i]) + Fr(s_sq) * Fr(a[i])
                        assert _within(float(out[i]), float(E[i]), max(q, Fr(0))), (s, fmt, variant, i)
