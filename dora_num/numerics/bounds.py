r"""A-priori (and, for the factored norm's guard, a-posteriori) forward error bounds, one function
per lemma of docs/bounds.md.

Every bound holds on its formula's whole input domain (subnormals, cancellation, fp32-inexact
scale constants, zero rows) or returns ``inf`` where none exists; never NaN; non-finite inputs
raise ``ValueError``.  Standard model with an underflow term per product site
(:mod:`dora_num.numerics.standard_model`); bounds are evaluated in float64 and inflated slightly
(each function says by how much).  The row-norm bounds live in :mod:`dora_num.numerics.norm_bounds`
and are re-exported here.  The model, the compose's ulp bound and the per-op scalar rounding:
docs/bounds.md, "How the bounds are evaluated".
"""

from __future__ import annotations

import numpy as np

from . import formulas as F
from .formats import FORMATS, get_format, quantum, round_to
from .norm_bounds import dense_norm_bound, factored_norm_bound, factored_norm_posterior, lora_row_magnitudes
from .standard_model import ETA32, SAFE, U32, U64, finite64, gamma, pw

__all__ = ["assembly_bound", "assembly_condition", "compose_bound", "compose_condition", "compose_ulp_bound",
           "dense_norm_bound", "dg_bound", "dg_max_additions", "factored_norm_bound", "factored_norm_posterior",
           "gamma", "lora_row_magnitudes", "magnitude_scale_bound", "one_ulp_condition", "working_arithmetic"]

def working_arithmetic(fmt, variant: str):
    """The standard model of ``variant`` for storage format ``fmt``, as every compose and
    assembly bound uses it: ``(w, u_s, eta, out_fmt, fma)``, ``w`` the working format (the
    storage format for ``per_op``, fp32 otherwise), ``u_s`` the relative error of an operation
    with a Python scalar (per-op: computed in fp32, then rounded to ``w``), ``eta`` its underflow
    term, ``out_fmt`` the format of the final rounding of an fp32 result (None for ``per_op``, and
    for fp32 output: the fp32 result is the output, no final rounding) and whether products are
    contracted (``fp32_fma``).  Public so that a transcription of a
    bound (the exhaustive GPU kernel) takes its constants from here."""
    fmt = get_format(fmt)
    if variant == "per_op":
        w = fmt
        u32 = FORMATS["fp32"].u
        us = (1 + w.u) * (1 + u32) - 1 if w.p < 24 else w.u
        eta = w.min_subnormal / 2 + (FORMATS["fp32"].min_subnormal / 2 if w.p < 24 else 0.0)
        return w, us, eta, None, False
    if variant in ("fp32", "fp32_fma"):
        w = FORMATS["fp32"]
        # fp32 output: the fp32 result is the output, no further rounding to charge
        return w, w.u, w.min_subnormal / 2, fmt if fmt.p < w.p else None, variant == "fp32_fma"
    raise ValueError(f"variant must be per_op, fp32 or fp32_fma, got {variant!r}")


def _g_used(g, fmt, variant, g_in):
    g = np.asarray(g, dtype=np.float64)
    return round_to(g, fmt) if (variant == "per_op" or g_in == "storage") else g


def _compose_parts(formula, base, lora, g, s, fmt, variant, g_in):
    """The pieces of the compose bounds (lemmas 1-2 of docs/bounds.md).

    Returns a dict: ``E_pre`` (bound on ``|pre - X'|``, ``pre`` the exact operands of the
    last rounding in the working format, ``X'`` the exact result with the ``g'`` used),
    ``E_w`` (after that rounding), ``E`` (the full bound vs ``X`` with the given ``g``,
    after a final rounding to ``fmt`` where the variant has one), ``over`` (overflow
    possible), ``X`` (an upper bound on ``|X'|``), ``Xtrue`` (float64 ``X`` with ``g``),
    ``dgL = |g' - g| |L + base|`` (plus, for ``per_op``, the storage rounding of ``base`` and
    ``lora`` when given in a wider format: ``|g - 1| |base' - base| + |g s| |lora' - lora|``) and the
    formats.  Where ``g'`` (or a stored input) overflows the format, ``over`` is set and the
    arithmetic uses 0 there, so no NaN arises."""
    if formula not in ("compose_stable", "compose_naive"):
        raise ValueError(f"formula must be compose_stable or compose_naive, got {formula!r}")
    fmt = get_format(fmt)
    w, us, eta, out_fmt, fma = working_arithmetic(fmt, variant)
    u = w.u
    base, lora, g = (finite64(n, x) for n, x in (("base", base), ("lora", lora), ("g", g)))
    s = F.scale_constants(s)[0]
    gp = _g_used(g, fmt, variant, g_in)
    # g held in the format may overflow it (g = m / eps = 1e5 on a zero row, in fp16 or e5m2): the computed
    # compose is then not finite and no finite bound exists; the arithmetic below uses 0 there (never NaN)
    g_over = ~np.isfinite(gp)
    gp = np.where(g_over, 0.0, gp)
    dg = np.where(g_over, 0.0, np.abs(gp - g))
    d_store = np.zeros(np.broadcast(base, lora, g).shape)
    if variant == "per_op":
        # per-op stores base and lora in the format first (emulate's `store`); given values of wider formats
        # round there, and X is affine in both: charged |g - 1| |base' - base| + |g s| |lora' - lora|
        base_s, lora_s = round_to(base, fmt), round_to(lora, fmt)
        g_over = g_over | ~np.isfinite(base_s) | ~np.isfinite(lora_s)
        base_s, lora_s = np.where(np.isfinite(base_s), base_s, 0.0), np.where(np.isfinite(lora_s), lora_s, 0.0)
        d_store = np.abs(g - 1.0) * np.abs(base_s - base) + np.abs(g) * abs(s) * np.abs(lora_s - lora)
        base_given, lora_given, base, lora = base, lora, base_s, lora_s
    else:
        base_given, lora_given = base, lora
    L = s * lora  # exact in float64 (24-bit s times a <= 24-bit value)
    aL, ab, ag = np.abs(L), np.abs(base), np.abs(gp)
    # g'-1 is exact in float64; the products and every later float64 operation of the bound round
    # (each by at most 2^-53, relative, on non-negative terms): SAFE in compose_bound covers them all
    A = np.abs((gp - 1.0) * base)
    T = ag * aL
    X = np.abs((gp - 1.0) * base + gp * L) + 4 * U64 * (A + T)  # three float64 roundings
    k = ((gp < 0.5) | (gp > 2.0)).astype(np.float64)  # g' - 1 rounds (one more factor)
    if formula == "compose_stable":
        # sl = L(1+d1)+e1; t = g' sl(1+d2)+e2; p = gm1 base(1+d3)+e3; pre = p + t (FMA: gm1 base + t)
        c_t = (1 + us) * (1 + u) - 1
        if fma:
            E_pre = pw(us, k) * A + c_t * T + (ag * (1 + u) + 1) * eta
        else:
            E_pre = ((1 + us) ** k * (1 + u) - 1) * A + c_t * T + (ag * (1 + u) + 2) * eta
        mags = [aL * (1 + us) + eta, T * (1 + u) ** 2 + 2 * eta, A * (1 + u) ** 2 + eta, X + E_pre]
    else:
        Lb = np.abs(L + base)
        if fma:  # inner = fl(L + b) = (L+b)(1+d1) + e1; pre = g' inner - b
            E_pre = ag * (u * Lb + eta)
        else:  # inner = (L(1+d1)+e1+b)(1+d2); P = g' inner(1+d3)+e3; pre = P - b
            E_pre = ag * (pw(u, 2) * Lb + (1 + u) ** 2 * (us * aL + eta)) + eta
        mags = [aL * (1 + us) + eta, (aL + ab) * (1 + u) ** 2 + eta, ag * (aL + ab) * (1 + u) ** 3 + 2 * eta,
                X + E_pre]
    E_w = E_pre + u * (X + E_pre) + (eta if fma else 0.0)
    over = np.broadcast_to(g_over, np.broadcast(base, lora, g).shape).copy()
    for m in mags:
        over |= m * (1 + u) >= w.max
    E = E_w
    if out_fmt is not None:
        over |= (X + E_w) * (1 + out_fmt.u) >= out_fmt.max
        E = E_w + out_fmt.u * (X + E_w) + out_fmt.min_subnormal / 2
    # X(g', stored) - X(g, given) = (g' - g)(base + L) + (g - 1)(base - base_given) + g s (lora - lora_given)
    dgL = dg * np.abs(L + base) + d_store
    Xtrue = (g - 1.0) * base_given + g * (s * lora_given)
    return {"E_pre": E_pre, "E_w": E_w, "E": E, "over": over, "X": X, "Xtrue": Xtrue, "dgL": dgL,
            "out_fmt": out_fmt if out_fmt is not None else w, "final_round_in_w": out_fmt is None}


def compose_bound(formula: str, base, lora, g, s: float, fmt, variant: str, g_in: str = "fp32") -> np.ndarray:
    """Lemmas 1-2: bound on ``|computed - exact|`` of the compose ``formula``
    (``"compose_stable"`` or ``"compose_naive"``) evaluated by
    :func:`dora_num.numerics.emulate.emulate` with the same arguments; ``exact`` is the
    real result for ``g`` as given (``g_in="storage"``: the rounding of ``g`` costs
    ``|g' - g| |s lora + base|``, as ``X`` is affine in ``g``).  ``inf`` where overflow is
    possible.  Multiplied by ``1 + 2^-40`` (a handful of float64 operations on
    non-negative terms)."""
    P = _compose_parts(formula, base, lora, g, s, fmt, variant, g_in)
    E = (P["E"] + P["dgL"]) * SAFE
    return np.where(P["over"], np.inf, E)


def compose_condition(base, lora, g, s: float) -> np.ndarray:
    r"""Condition number of the compose sum ``X = (g-1) base + g (s lora)``:
    ``kappa_c = (|(g-1) base| + |g s lora|) / |X|`` (1 where both terms are 0, ``inf`` where
    they cancel exactly).  ``kappa_c = 1`` when the terms have one sign; it is large
    where ``(g-1) base`` and ``g s lora`` nearly cancel."""
    base, lora, g = (finite64(n, x) for n, x in (("base", base), ("lora", lora), ("g", g)))
    s = F.scale_constants(s)[0]
    A, T = np.abs((g - 1.0) * base), np.abs(g * (s * lora))
    X = np.abs((g - 1.0) * base + g * (s * lora))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(A + T == 0, 1.0, (A + T) / X)


def compose_ulp_bound(formula: str, base, lora, g, s: float, fmt, variant: str = "fp32",
                      g_in: str = "fp32") -> np.ndarray:
    r"""Lemma 1 (ulp form): the computed compose is within this many ulps of the correctly
    rounded exact result ``RN_fmt(X)`` (``X`` with the given ``g``), per element.

    ``1 + floor(E_last / q_min)``: ``E_last`` bounds the error of the value that the
    last rounding to ``fmt`` receives (the fp32 result for the fp32 variants with a
    narrower ``fmt``; the exact operands ``pre`` of the final operation when that
    operation itself rounds to ``fmt``), plus ``|g'-g||L+base|``; ``q_min`` is the
    spacing of ``fmt`` at ``max(|X| - E_last, 0)``.  Since ``RN`` is monotone and
    changes value only at midpoints, the two roundings differ by at most the number of
    midpoints within ``E_last`` of ``X``.  For the stable form with fp32 intermediates
    and ``g`` in ``[0.5, 2]``, ``E_last <= u32 |X| (1 + 2.0000002 kappa_c) + 4.0001 eta32``,
    so the result is within **1 ulp** wherever ``kappa_c <= one_ulp_condition(fmt)``
    (``2^(22 - p)``: 16384 for bf16, 2048 for fp16; none for fp32 output) and within
    ``~1 + (1 + 2 kappa_c) 2^(p - 23)`` ulps beyond.  ``inf`` where overflow is possible.
    """
    P = _compose_parts(formula, base, lora, g, s, fmt, variant, g_in)
    last_in_w = P["final_round_in_w"] or P["out_fmt"].p >= FORMATS["fp32"].p  # fp32 output: the fp32 op rounds last
    E_last = (P["E_pre"] if last_in_w else P["E_w"]) + P["dgL"]
    E_last = E_last * SAFE
    low = np.maximum(np.abs(P["Xtrue"]) - E_last, 0.0)
    q = quantum(low, P["out_fmt"])
    ulps = 1.0 + np.floor(E_last / q)
    return np.where(P["over"], np.inf, ulps)


def one_ulp_condition(fmt) -> float:
    r"""Lemma 1: the largest ``kappa_c`` for which the stable compose with fp32
    intermediates (``g`` in ``[0.5, 2]``, one final rounding to ``fmt``) is guaranteed within
    1 ulp of the correctly rounded result: ``2^(22 - p)`` (``p`` the format's precision);
    0 for fp32 output (no condition suffices: the fp32 result has up to ``~2 kappa_c``
    ulps).  Derivation: :func:`compose_ulp_bound`; checked there per element."""
    p = get_format(fmt).p
    return 2.0 ** (22 - p) if p <= 22 else 0.0


def assembly_bound(base_sq, cross, ba, s: float, fmt, variant: str) -> np.ndarray:
    """Lemma 3: bound on ``|computed - exact|`` of :func:`~dora_num.numerics.formulas.norm_assembly`
    as evaluated by ``emulate("norm_assembly", ...)``; exact = ``sqrt(max(Q, 0))`` of the
    given terms with the fp32 constants ``2s``, ``s^2 = fl32(s*s)`` (what the assembly
    receives).  ``inf`` where overflow is possible: a partial sum, a term stored in the format
    (``per_op``), or the constants themselves (``s^2`` beyond fp32 for ``|s| > 1.8e19``); ``s = 0``
    multiplies nothing (no ``0 * inf``).  Never NaN."""
    fmt = get_format(fmt)
    w, us, eta, _, fma = working_arithmetic(fmt, variant)
    u = w.u
    b, c, a = (finite64(n, x) for n, x in (("base_sq", base_sq), ("cross", cross), ("ba", ba)))
    _, two_s, s_sq = F.scale_constants(s)
    shape = np.broadcast(b, c, a).shape
    # 2s or s^2 beyond fp32 (|s| > 1.8e19): the fp32 constants are inf, no finite bound; 0 below (never NaN)
    const_over = not (abs(two_s) <= FORMATS["fp32"].max and np.isfinite(s_sq))
    if const_over:
        two_s, s_sq = 0.0, 0.0
    mul = lambda k, x: np.where(x == 0, 0.0, k * x) if k != 0 else np.zeros_like(x)  # noqa: E731  (0 * inf = 0)
    Sb, Sc, Sa = np.abs(b), np.abs(mul(two_s, c)), np.abs(mul(s_sq, a))  # exact products in float64
    S = Sb + Sc + Sa
    if fma:
        dQ = pw(u, 2) * (Sb + Sc) + u * Sa + (2 + u) * eta
    else:
        dQ = pw(u, 2) * Sb + ((1 + us) * (1 + u) ** 2 - 1) * Sc + ((1 + us) * (1 + u) - 1) * Sa \
            + 2 * (1 + u) ** 2 * eta
    store_over = np.zeros(shape, dtype=bool)
    if variant == "per_op":  # the terms stored in the format first: a term beyond it is inf there
        rb, rc, ra = (round_to(x, w) for x in (b, c, a))
        store_over = ~(np.isfinite(rb) & np.isfinite(rc) & np.isfinite(ra))
        fin = lambda r, x: np.where(np.isfinite(r), np.abs(r - x), 0.0)  # noqa: E731
        d_in = fin(rb, b) + abs(two_s) * fin(rc, c) + s_sq * fin(ra, a)
        dQ = dQ + d_in * (1 + u) ** 3
    Q64 = b + mul(two_s, c) + mul(s_sq, a)
    Q_lo = np.maximum(Q64 - 4 * U64 * S, 0.0)
    w_hi = np.sqrt(np.maximum(Q64 + 4 * U64 * S, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        lin = np.where(Q_lo > 0, dQ / np.sqrt(np.where(Q_lo > 0, Q_lo, 1.0)), np.inf)
    E = ((1 + u) * np.minimum(lin, np.sqrt(dQ)) + u * w_hi) * SAFE
    over = ((S + dQ) * (1 + u) ** 3 >= w.max) | store_over | const_over
    return np.where(over, np.inf, E)


def assembly_condition(base_sq, cross, ba, s: float) -> np.ndarray:
    """``kappa = (|base| + |2s cross| + |s^2 ba|) / |base + 2s cross + s^2 ba|`` (inf at Q = 0)."""
    b, c, a = (finite64(n, x) for n, x in (("base_sq", base_sq), ("cross", cross), ("ba", ba)))
    _, two_s, s_sq = F.scale_constants(s)
    S = np.abs(b) + np.abs(two_s * c) + np.abs(s_sq * a)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(S == 0, 1.0, S / np.abs(b + two_s * c + s_sq * a))


def magnitude_scale_bound(m, wnorm, eps: float, rel_wnorm) -> np.ndarray:
    r"""Lemma 6: bound on ``|g^ - g|`` for ``g^ = fl32(m / d(w^))`` (fp32, as
    :func:`~dora_num.numerics.formulas.magnitude_scale` under ``TorchFP32``) and the exact
    ``g = m / d(w)``, ``d(w) = w`` for ``w > 0`` and ``eps`` (its fp32 value) for ``w = 0``
    (:func:`~dora_num.numerics.formulas.magnitude_denominator`), where ``w^ = wnorm`` is the
    computed norm and ``w`` the exact one, ``|w^ - w| <= rel_wnorm * w``.

    With ``rel < 1``, ``w^ = 0`` iff ``w = 0`` (then ``d(w^) = d(w) = eps``), else
    ``d(w^) = d(w)(1 + r)`` with ``|r| <= rel``; the division adds ``(1 + d)`` and an underflow
    ``e``: ``g^ = g (1 + d) / (1 + r) + e``, hence

        |g^ - g| <= |g| (u + rel) / (1 - rel) + eta  (+ (1 + u) |fl32(m) - m| / d(w^)),

    exact to second order (``(1+u)/(1-rel) - 1``; the former ``u + (1 + u) rel`` misses
    the ``rel^2`` term and fails for ``rel > ~2^-12``).  ``inf`` for ``rel >= 1`` or where
    ``g^`` may overflow.  ``|g|`` is evaluated from the inputs as ``|m| / max(w^, eps) /
    (1 - rel)`` (an upper bound), times ``1 + 2^-40``.  An ``m`` that is not fp32 (float64
    magnitudes) is rounded to fp32 before the division, as the operator does: the term in
    parentheses charges that rounding (0 for fp32 ``m``)."""
    m = finite64("m", m)
    wn = finite64("wnorm", wnorm)
    rel = np.broadcast_to(finite64("rel_wnorm", rel_wnorm), np.broadcast(m, wn).shape)
    if (wn < 0).any() or (rel < 0).any():
        raise ValueError("wnorm and rel_wnorm must be non-negative")
    e32 = float(np.float32(eps))
    if not e32 > 0:
        raise ValueError(f"eps must be positive in fp32, got {eps!r}")
    u, eta = U32, ETA32
    den = np.where(wn == 0, e32, wn)
    # m given in float64 is rounded to fp32 before the division (the operator's m.float()): charged exactly
    dm = np.abs(round_to(m, "fp32") - m)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        g_up = np.abs(m) / den / np.where(rel < 1, 1.0 - rel, 1.0) * (1 + 2 * U64)
        E = (g_up * (u + rel) / np.where(rel < 1, 1.0 - rel, 1.0) + eta + (1 + u) * dm / den) * SAFE
    bad = (rel >= 1) | ~np.isfinite(E) | (g_up * (1 + u) >= FORMATS["fp32"].max)
    return np.where(bad, np.inf, E)


# --------------------------------------------------------------------------
# The magnitude gradient dg = sum over rows of (s*lora + base) * D.
# --------------------------------------------------------------------------

def dg_max_additions(reduction: str, n_rows: int, *, block_m: int | None = None, chunk: int | None = None) -> int:
    r"""Largest number of roundable additions any one product passes through in ``dg``.

    A reduction of ``T`` terms by binary additions, in *any* order or tree
    (sequential, pairwise, cascade, vector lanes, GPU shuffles), puts each leaf
    through at most ``T - 1`` additions: that is why one bound holds for eager
    ``torch.sum`` on CPU and CUDA, whose order is an implementation detail.

    - ``"eager"``, ``"fp64"``: ``T - 1`` (any order).
    - ``"fused"`` (the kernel of :mod:`dora_num.ops.kernels.compose`): stage 1 adds
      the ``min(BLOCK_M, T)`` products of a row block in some order (``<= BLOCK_M - 1``);
      stage 2 adds the ``nb = ceil(T / BLOCK_M)`` partials in chunks of ``CHUNK``
      (``<= min(CHUNK, nb) - 1`` inside a chunk, any tree) and accumulates the
      ``ceil(nb / CHUNK)`` chunk sums in sequence into a zero accumulator (the first
      addition, ``0 + x``, is exact): ``<= ceil(nb / CHUNK) - 1``.
    """
    if isinstance(n_rows, bool) or not isinstance(n_rows, (int, np.integer)) or n_rows < 1:
        raise ValueError(f"n_rows must be a positive int, got {n_rows!r}")
    n_rows = int(n_rows)
    if reduction in ("eager", "fp64"):
        return n_rows - 1
    if reduction != "fused":
        raise ValueError(f"reduction must be eager, fused or fp64, got {reduction!r}")
    for name, v in (("block_m", block_m), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int for the fused reduction, got {v!r}")
    nb = -(-n_rows // block_m)
    return (min(block_m, n_rows) - 1) + (min(chunk, nb) - 1) + (-(-nb // chunk) - 1)


def dg_bound(s: float, lora, base, grad, reduction: str, *, block_m: int | None = None,
             chunk: int | None = None) -> np.ndarray:
    r"""Lemma 7: bound on ``|dg_computed - dg_exact|`` per column (float64 ``[N]``).

    ``lora``, ``base``, ``grad`` ``[T, N]`` are the stored activations and upstream
    gradient (any float format, exactly representable in float64), ``s`` the scale
    (rounded to fp32 as every path does).  ``dg_exact = sum_k (s L_k + b_k) D_k``
    in real arithmetic; the computed value follows the numerical contract (fp32 intermediates):
    ``inner = fl32(fl32(s*L) + b)`` (:func:`~dora_num.numerics.formulas.compose_inner`),
    products ``inner * D`` (:func:`~dora_num.numerics.formulas.compose_grad_g_terms`)
    in fp32 (``"eager"``, ``"fused"``) or exactly in float64 (``"fp64"``: 24 x 24 bits),
    then a sum in fp32 / float64 with at most ``A = dg_max_additions(...)`` additions
    per leaf.  Standard model, ``u = 2^-24``, ``eta = 2^-150`` (fp32 underflow of a
    product; sums underflow exactly)::

        inner^ = (sL(1+d1) + e1 + b)(1+d2):   |inner^ - inner| <= E = u(1+u)|sL| + u|inner| + (1+u) eta
        p^     = inner^ D (1+d3) + e3,         |d3| <= u_p,  |e3| <= eta_p
        dg^    = sum_k p^_k prod_{i <= a_k} (1 + d_i),   a_k <= A,  |d_i| <= u_s

    hence, with ``c = (1+u_p)(1+u_s)^A - 1``::

        |dg^ - dg| <= sum_k |D_k| E_k + c sum_k (|inner_k| + E_k)|D_k| + T eta_p (1+u_s)^A

    (``u_p = u_s = u``, ``eta_p = eta`` for fp32; ``u_p = eta_p = 0``, ``u_s = 2^-53`` for
    float64.)  ``inf`` where ``s L``, ``inner``, a product or, for the fp32 reductions, any
    partial sum may reach the fp32 overflow threshold (partial sums are bounded by
    ``sum_k |p^_k| (1 + u_s)^A`` in any order), even if the exact ``dg`` is in range.  Relative to ``|dg|`` this is ``~ (A + 2) u kappa`` with the condition
    number ``kappa = sum |inner D| / |sum inner D|`` of the reduction: the data enter
    only through ``kappa`` (about ``sqrt(T)`` for gradients of random sign) and
    through ``|sL|/|inner|``.  ``A`` is ``T - 1`` for any-order sums (eager) but
    ``~ BLOCK_M + CHUNK + T/(BLOCK_M CHUNK)`` for the fused two-stage tree, so the
    fused bound grows like ``kappa`` alone until ``T ~ 10^5`` rows.  Evaluated in
    float64 and multiplied by ``1 + 1e-9`` (a sum of ``<= 3T`` non-negative terms:
    relative evaluation error ``< 3T 2^-53``).
    """
    L, b, D = (np.asarray(x, dtype=np.float64) for x in (lora, base, grad))
    if L.ndim != 2 or L.shape != b.shape or L.shape != D.shape:
        raise ValueError(f"lora, base, grad must be [T, N] of one shape, got {L.shape}, {b.shape}, {D.shape}")
    if not (np.isfinite(L).all() and np.isfinite(b).all() and np.isfinite(D).all()):
        raise ValueError("lora, base and grad must be finite")
    T = L.shape[0]
    A = dg_max_additions(reduction, T, block_m=block_m, chunk=chunk)
    u32 = FORMATS["fp32"].u
    eta32 = FORMATS["fp32"].min_subnormal / 2
    if reduction == "fp64":
        u_p, eta_p, u_s = 0.0, 0.0, U64
    else:
        u_p, eta_p, u_s = u32, eta32, u32
    s = F.scale_constants(s)[0]
    sL = np.abs(s * L)  # exact: 24 x 24 bits
    inner = np.abs(s * L + b)  # one float64 rounding: within the final 1 + 1e-9, as every other one
    E = u32 * (1 + u32) * sL + u32 * inner + (1 + u32) * eta32
    aD = np.abs(D)
    c = (1 + u_p) * (1 + u_s) ** A - 1
    bound = (aD * E).sum(0) + c * ((inner + E) * aD).sum(0) + T * eta_p * (1 + u_s) ** A
    # Overflow (fp32): of s*L, of inner, of a product, or of any partial sum of the reduction,
    # whose magnitude is at most sum_k |p^_k| (1 + u_s)^A whatever the order: then no finite
    # bound exists (the computed dg may be inf or NaN although the exact dg is in range).
    mx = FORMATS["fp32"].max
    p_mag = (inner + E) * aD * (1 + u_p) + eta_p
    over = ((sL * (1 + u32)).max(0, initial=0) >= mx) | ((inner + E).max(0, initial=0) * (1 + u32) >= mx)
    over |= p_mag.max(0, initial=0) >= mx
    if reduction != "fp64":
        over |= p_mag.sum(0) * (1 + u_s) ** A * (1 + 1e-9) >= mx
    return np.where(over, np.inf, bound * (1 + 1e-9))
