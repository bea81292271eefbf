"""Named, seeded input regimes: where every study and the tests draw their inputs.

The vocabulary (one definition; docs/contract.md uses the same words):

The method in full: docs/methods.md, studies/inputs.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..numerics import fixed_order
from ..numerics.formats import FORMATS, get_format, round_to
from ..numerics.formulas import scale_constants

REGIMES = ("random", "realistic", "adversarial")

# Scales.  Not powers of two, so s*lora, 2s*cross and s^2*ba round (a power-of-two
# scale makes those products exact and hides what a contraction can change).
BOUNDS_SCALE = 0.37  # an rsLoRA-like scale (bounds sweep, notebook 03)
# The GPU suite's FMA inputs: rsLoRA alpha=192, r=384 (the paper's configuration).
SUITE_FMA_SCALE = 192 / math.sqrt(384)
SUITE_SEED = 20261129  # the GPU suite: compose SUITE_SEED, norms +1, layers +2, FMA compose +3
SUITE_COMPOSE_SCALE = 0.5  # compose benchmarks (speed does not depend on it)


# --------------------------------------------------------------------------
# Building blocks shared by the generators
# --------------------------------------------------------------------------

def gm1_realistic(rng: np.random.Generator, n: int) -> np.ndarray:
    """``g - 1`` of the realistic regime: random sign, ``|g-1|`` log-uniform on ``[1e-5, 1e-2]``."""
    return rng.choice([-1.0, 1.0], n) * np.exp(rng.uniform(np.log(1e-5), np.log(1e-2), n))


def boundary_g(fmt) -> np.ndarray:
    """fp32 values of g at and around the format's rounding boundaries near 1:
    ``1 + k eps/4`` (k = -4..4: the spacing below, the ties ``1 - eps/4``,
    ``1 + eps/2``, the spacing above; below 1 in steps of ``spacing_below_one / 2``, which is
    ``eps/4`` except where 1 is the smallest normal) and 1, 2, 3 fp32 steps either side of each."""
    fmt = get_format(fmt)
    centres = 1.0 + np.concatenate([np.arange(-4, 0) * fmt.spacing_below_one / 2, np.arange(0, 5) * fmt.eps / 4])
    steps = []
    for c in centres:
        up, down = c, c
        steps.append(c)
        for _ in range(3):
            up = np.nextafter(np.float32(up), np.float32(2))
            down = np.nextafter(np.float32(down), np.float32(0))
            steps += [float(up), float(down)]
    return np.unique(round_to(np.array(steps), "fp32"))


def _cancelling_cross(rng: np.random.Generator, base_sq: np.ndarray, two_s: float, k: int) -> np.ndarray:
    """``cross`` with ``2s cross = -base_sq (1 - 10^-j)``, ``j`` uniform on ``[1, 6]``: the
    cross term cancels all but ``10^-j`` of ``base_sq`` (the adversarial rows of
    :func:`fma_assembly` and :func:`suite_assembly`)."""
    return -(base_sq / two_s) * (1.0 - 10.0 ** rng.uniform(-6, -1, k))


def _f32(x) -> np.ndarray:
    return round_to(np.asarray(x, dtype=np.float64), "fp32")


# --------------------------------------------------------------------------
# The bounds sweep (notebook 03): every regime, every format
# --------------------------------------------------------------------------

def compose(fmt, regime: str, n: int, seed: int = 0) -> dict:
    """``base``, ``lora`` (values of ``fmt``), ``g`` (fp32), ``s`` for one regime.

    ``random``: ``N(0,1) 2^U(-4,4)`` operands, ``g ~ U(0.5, 2)``.  ``realistic``:
    ``base ~ N(0,1)``, ``lora ~ 0.02 N(0,1)``, ``g - 1`` from :func:`gm1_realistic`.
    ``adversarial``: a third ``g`` from :func:`boundary_g`; a third cancelling,
    ``(g-1) base ~ -g s lora``; a third near the format's overflow (``|base|`` in
    ``[0.5, 1] max``, ``|s lora|`` up to ``max / 4``)."""
    fmt = get_format(fmt)
    rng = np.random.default_rng([seed, fmt.seed, REGIMES.index(regime)])
    r = lambda x: round_to(x, fmt)  # noqa: E731
    if regime == "random":
        base = r(rng.standard_normal(n) * np.exp2(rng.uniform(-4, 4, n)))
        lora = r(rng.standard_normal(n) * np.exp2(rng.uniform(-4, 4, n)))
        g = rng.uniform(0.5, 2.0, n)
    elif regime == "realistic":  # |g-1| in 1e-5..1e-2, ||s lora|| << ||base||
        base = r(rng.standard_normal(n))
        lora = r(rng.standard_normal(n) * 0.02)
        g = 1.0 + gm1_realistic(rng, n)
    elif regime == "adversarial":
        k = n // 3
        gb = boundary_g(fmt)
        g1 = gb[rng.integers(0, gb.size, k)]
        b1, l1 = r(rng.standard_normal(k)), r(rng.standard_normal(k) * 0.02)
        # cancelling: (g-1) base ~ -g s lora, so the result is far below either term
        g2 = round_to(1.0 + gm1_realistic(rng, k), "fp32")
        b2 = r(rng.standard_normal(k))
        l2 = r(-(g2 - 1.0) * b2 / (g2 * BOUNDS_SCALE) * (1 + rng.standard_normal(k) * 1e-3))
        # near overflow of the format: |base| in [0.5, 1] max, |s lora| up to max / 4
        m = n - 2 * k
        g3 = round_to(1.0 + gm1_realistic(rng, m), "fp32")
        b3 = r(rng.choice([-1.0, 1.0], m) * rng.uniform(0.5, 1.0, m) * fmt.max)
        l3 = r(rng.uniform(-1, 1, m) * fmt.max / 4 / BOUNDS_SCALE)
        base, lora, g = np.concatenate([b1, b2, b3]), np.concatenate([l1, l2, l3]), np.concatenate([g1, g2, g3])
    else:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    return {"base": base, "lora": lora, "g": round_to(g, "fp32"), "s": BOUNDS_SCALE}


def assembly(fmt, regime: str, n: int, seed: int = 0) -> dict:
    """fp32 terms ``base_sq``, ``cross``, ``ba`` (Cauchy-Schwarz consistent) and ``s``.

    ``cross = rho sqrt(base_sq ba)`` with ``|rho| <= 1`` and ``ratio = s^2 ba / base_sq``:
    ``random`` ratio ``U(0, 2)``; ``realistic`` ratio log-uniform on ``[1e-6, 1e-2]``
    (``||sBA|| <= 0.1 ||W||``); ``adversarial``: a third where the update cancels the
    row (ratio ~ 1, rho ~ -1, 2% exact zero rows), the rest near the overflow of the
    storage format (and, for fp32, of the fp32 working format)."""
    fmt = get_format(fmt)
    rng = np.random.default_rng([seed, 7, fmt.seed, REGIMES.index(regime)])
    s = BOUNDS_SCALE
    top = min(fmt.max, FORMATS["fp32"].max)

    def terms(base, ratio, rho):  # ratio = s^2 ba / base; cross = rho sqrt(base ba)
        ba = base * ratio / s**2
        return base, rho * np.sqrt(base * ba), ba

    if regime == "random":
        b, c, a = terms(rng.uniform(0.05, 1.0, n) * min(100.0, top / 32), rng.uniform(0, 2, n), rng.uniform(-1, 1, n))
    elif regime == "realistic":
        b, c, a = terms(rng.uniform(0.05, 1.0, n) * min(100.0, top / 32),
                        np.exp(rng.uniform(np.log(1e-6), np.log(1e-2), n)), rng.uniform(-1, 1, n))
    elif regime == "adversarial":
        k = n // 3
        # the update cancels the row: ratio ~ 1 and rho ~ -1, so Q = base (1 + 2 rho t + t^2) ~ 0
        t = 1.0 + rng.standard_normal(k) * np.exp2(-rng.uniform(2, 20, k))
        b1, c1, a1 = terms(rng.uniform(0.05, 1.0, k) * min(100.0, top / 32), t * t,
                           -1.0 + np.exp2(-rng.uniform(1, 40, k)))
        zero = rng.random(k) < 0.02  # exact zero rows
        b1, c1, a1 = (np.where(zero, 0.0, x) for x in (b1, c1, a1))
        # near overflow of the storage format (and, for fp32, of the fp32 working format)
        m = n - k
        b2, c2, a2 = terms(rng.uniform(0.2, 0.5, m) * top, rng.uniform(0, 0.2, m), rng.uniform(-1, 1, m))
        b, c, a = np.concatenate([b1, b2]), np.concatenate([c1, c2]), np.concatenate([a1, a2])
    else:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    f32 = lambda x: round_to(x, "fp32")  # noqa: E731
    return {"base_sq": f32(b), "cross": f32(c), "ba": f32(a), "s": s}


def conditioning_rows(rows: int, d_in: int, r: int, *, seed: int = 0, tau_min: float = 1e-6,
                      tau_max: float = 1.0, scale: float = BOUNDS_SCALE):
    """``W = -s BA + tau ||sBA|| N`` row by row, ``tau`` log-spaced in ``[tau_min, tau_max]``:
    ``W + sBA = tau ||sBA|| N`` (up to fp32 rounding of W), so the assembly's
    condition number grows like ``4 / tau^2`` (until ``tau`` reaches the fp32 rounding
    of ``W``, ``~u``, below which the rounding of W sets the exact norm).  All fp32;
    ``s = fl32(scale)`` (any positive scale, e.g. rsLoRA's ``alpha / sqrt(r)``); returns
    ``(W, A, B, s)``."""
    if not (0 < tau_min <= tau_max):
        raise ValueError(f"need 0 < tau_min <= tau_max, got {tau_min}, {tau_max}")
    rng = np.random.default_rng([seed, 3])
    s = scale_constants(scale)[0]
    A = round_to(rng.standard_normal((r, d_in)) / np.sqrt(d_in), "fp32")
    B = round_to(rng.standard_normal((rows, r)), "fp32")
    V = s * fixed_order.matmul(B, A)  # not BLAS: the same inputs on every CPU
    N = rng.standard_normal((rows, d_in)) / np.sqrt(d_in)
    tau = np.exp(np.linspace(np.log(tau_max), np.log(tau_min), rows))
    W = round_to(-V + tau[:, None] * np.linalg.norm(V, axis=1, keepdims=True) * N, "fp32")
    return W, A, B, s


# --------------------------------------------------------------------------
# The FMA study (notebook 02): rows where the contraction sites matter
# --------------------------------------------------------------------------

def fma_assembly(n: int, s: float, seed: int) -> dict:
    """Norm-assembly rows built to make the assembly's contraction sites matter, each
    with a ``category`` label:

    - ``cancel`` (40%): the cross term cancels all but ``10^-k`` (k in 1..6) of ``base_sq``;
    - ``large_update`` (30%): ``||sBA_j||`` comparable to ``||W_j||`` (every term of one size);
    - ``near_zero`` (2%): ``W_j ≈ -s(BA)_j`` (relative gap ~1e-4..1e-7): the sum cancels to
      a few ulps of ``base_sq`` or below zero (the clamp);
    - ``realistic`` (28%): ``||sBA|| << ||W||`` (``2s cross`` ~1e-2, ``s^2 ba`` ~1e-4 of base_sq).

    Returns fp32 values (float64 arrays) ``base_sq, cross, ba``, ``s = fl32(s)``, ``category``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    s, two_s, s_sq = scale_constants(s)
    cat = rng.choice(np.array(["cancel", "large_update", "near_zero", "realistic"], dtype=object), n,
                     p=[0.4, 0.3, 0.02, 0.28])
    base = np.exp(rng.normal(0.0, 1.0, n)) * 100.0
    cross = base * rng.normal(0.0, 1e-2, n) / two_s
    ba = base * np.abs(rng.normal(0.0, 1.0, n)) * 1e-4 / s_sq
    k = cat == "cancel"
    cross[k] = _cancelling_cross(rng, base[k], two_s, int(k.sum()))
    k = cat == "large_update"
    cross[k] = base[k] * rng.normal(0.0, 0.5, int(k.sum())) / s
    ba[k] = base[k] * rng.uniform(0.25, 4.0, int(k.sum())) / s_sq
    k = cat == "near_zero"  # |w - v|^2 with v = w (1 + d)/s... in terms: base, -base(1+d)/s, base(1+d)^2/s^2
    d = 10.0 ** rng.uniform(-7, -4, int(k.sum())) * rng.choice([-1.0, 1.0], int(k.sum()))
    cross[k] = -base[k] * (1 + d) / s
    ba[k] = base[k] * (1 + d) ** 2 / s_sq
    return {"base_sq": _f32(base), "cross": _f32(cross), "ba": _f32(ba), "s": s, "category": cat}


def fma_compose(n: int, s: float, seed: int) -> dict:
    """Compose elements where the contraction sites matter, each with a ``category``:

    - ``g_one_ulp``: ``g`` within a few fp32 ulps of 1 (``g-1`` tiny, exact);
    - ``big_base``: ``|base| >> |s lora|`` with ``|g-1| ~ 1e-3`` (the ``(g-1) base`` term dominates);
    - ``cancel``: ``s g lora ≈ -(g-1) base`` (the two terms of the stable form cancel);
    - ``unit``: ``base, lora ~ N(0,1)``, ``g - 1 ~ 1e-3`` (realistic ``g``, unit operands).

    Returns fp32 values (float64 arrays) ``base, lora, g``, ``s = fl32(s)``, ``category``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    s = scale_constants(s)[0]
    cat = rng.choice(np.array(["g_one_ulp", "big_base", "cancel", "unit"], dtype=object), n)
    base = rng.normal(0, 1, n)
    lora = rng.normal(0, 1, n)
    g = 1.0 + 1e-3 * rng.normal(0, 1, n)
    k = cat == "g_one_ulp"
    g[k] = 1.0 + rng.integers(-8, 9, int(k.sum())) * 2.0**-24
    k = cat == "big_base"
    base[k] *= 1e3
    k = cat == "cancel"
    lora[k] = -(g[k] - 1) * base[k] / (g[k] * s) * (1 + 1e-3 * rng.normal(0, 1, int(k.sum())))
    return {"base": _f32(base), "lora": _f32(lora), "g": _f32(g), "s": s, "category": cat}


# --------------------------------------------------------------------------
# The GPU suite: seeded numpy streams the CPU regenerates bit for bit
# --------------------------------------------------------------------------

SUITE_FMA_N = 1 << 22  # norm-assembly inputs of the suite's FMA section (full mode)
SUITE_FMA_COMPOSE_SHAPE = (2048, 2048)  # compose inputs of the suite's FMA section (4M elements)


def suite_assembly(n: int, seed: int = SUITE_SEED, scale: float = SUITE_FMA_SCALE):
    """The GPU suite's norm-assembly inputs: float32 arrays ``(base_sq, cross, ba)``
    (numpy PCG64: any machine regenerates them bit for bit).

    Realistic rows (``cross`` ~1e-2 and ``ba`` ~1e-4 of ``base_sq``; at the suite's
    scale ``2s cross`` ~0.2 and ``s^2 ba`` ~1e-2 of it), and one in eight rows
    adversarial (the cross term cancels most of ``base_sq``)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    base_sq = np.exp(rng.normal(0.0, 1.0, n)) * 100.0
    cross = base_sq * rng.normal(0.0, 1e-2, n)
    ba = base_sq * np.abs(rng.normal(0.0, 1.0, n)) * 1e-4
    adv = rng.random(n) < 0.125
    two_s = 2 * scale
    cross[adv] = _cancelling_cross(rng, base_sq[adv], two_s, int(adv.sum()))
    return base_sq.astype(np.float32), cross.astype(np.float32), ba.astype(np.float32)


def suite_compose(rows: int, cols: int, seed: int = SUITE_SEED + 3):
    """The GPU suite's FMA compose inputs: float32 ``base, lora [rows, cols]`` ~ N(0, 1)
    and ``g [cols] = 1 + 1e-3 N(0, 1)`` (numpy PCG64)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    base = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    lora = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    g = (1.0 + 1e-3 * rng.normal(0, 1, cols)).astype(np.float32)
    return base, lora, g


def suite_compose_torch(tokens: int, d_out: int, dtype, gen: torch.Generator, device: str = "cuda"):
    """The GPU suite's compose-benchmark inputs ``(base, lora, g, grad)``: ``base``, ``lora``
    and the upstream gradient ``N(0, 1)`` in ``dtype``, ``g = 1 + 1e-3 N(0, 1)`` fp32,
    drawn by torch's generator ``gen`` on ``device`` (the stream of one machine's
    generator: timing inputs, not regenerated elsewhere)."""
    base = torch.randn(tokens, d_out, device=device, dtype=torch.float32, generator=gen).to(dtype)
    lora = torch.randn(tokens, d_out, device=device, dtype=torch.float32, generator=gen).to(dtype)
    g = 1.0 + 1e-3 * torch.randn(d_out, device=device, dtype=torch.float32, generator=gen)
    grad = torch.randn(tokens, d_out, device=device, dtype=torch.float32, generator=gen).to(dtype)
    return base, lora, g, grad


# --------------------------------------------------------------------------
# The magnitude gradient (notebook 06)
# --------------------------------------------------------------------------

DG_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dg_operands(T: int, N: int, dtype: str, *, seed: int, base_scale: float = 1.0, lora_std: float = 1.0,
                grad_std: float = 2.0**-10, s: float = 0.5, cancelling: bool = False):
    """``(lora, base, grad)`` torch ``[T, N]`` in ``dtype``: ``base ~ N(0, base_scale^2)``,
    ``s*lora ~ N(0, lora_std^2)`` (the paper's absorption study: base scale up to 128,
    unit lora term), ``D ~ N(0, grad_std^2)`` with random signs (power-of-two std:
    a loss scale; fp16-safe), drawn in float64 and rounded once to ``dtype``.

    ``cancelling=True`` (adversarial): the second half of the rows repeats the first
    with ``D`` negated, so ``dg`` is a tiny residue (its condition number huge)."""
    if dtype not in DG_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DG_DTYPES)}, got {dtype!r}")
    gen = torch.Generator().manual_seed(seed)
    kw = dict(generator=gen, dtype=torch.float64)
    base = torch.randn(T, N, **kw) * base_scale
    lora = torch.randn(T, N, **kw) * (lora_std / scale_constants(s)[0])
    grad = torch.randn(T, N, **kw) * grad_std
    dt = DG_DTYPES[dtype]
    lora, base, grad = lora.to(dt), base.to(dt), grad.to(dt)
    if cancelling:
        h = T // 2
        lora[h:2 * h], base[h:2 * h], grad[h:2 * h] = lora[:h], base[:h], -grad[:h]
    return lora, base, grad
