r"""Lemma 4' (docs/bounds.md): the factored norm's a-posteriori condition and error bound, from its
own fp32 terms: what the cancellation guard evaluates (:mod:`dora_num.ops.guard`, in the Triton
tail :mod:`dora_num.ops.kernels.norm_tail` and in the torch tail).

One fp32 sequence (:func:`posterior_from_terms`, :func:`lora_row_magnitudes`) on constants computed
once per configuration on the host (:func:`posterior_constants`, :func:`runtime_constants` for the
fp16 split's scale); the Triton tail evaluates the same sequence on the same constants, bit for
bit.  The product models (fp32, tensor cores, split products) and the split model's per-row
coefficients: docs/bounds.md, "The guard's terms under each product model".
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from .arithmetic import TorchFP32CorrectSqrt
from .split_products import BG_PIECES, tail_bg_coefficients
from .standard_model import TINY32, U32, U64, gamma, pw, tc_additions, up32

SPLIT_FORMATS = {"bf16": (2.0**-8, 2.0**-134), "fp16": (2.0**-11, 2.0**-25)}  # (u_h, sigma)
_UU = 2.0**-149  # added after a product by a power of two: fl(p) + 2^-149 >= p (underflow is <= 2^-150)


class PosteriorConstants(NamedTuple):
    """The fp32 constants (Python floats, each exactly an fp32 number) of
    :func:`lora_row_magnitudes` and :func:`factored_norm_posterior` for one
    ``(two_s, s_sq, d_in, r, product model)``: computed once on the host, and the same values
    are given to the Triton tail (:mod:`dora_num.ops.kernels.norm_tail`; the fields of
    :data:`KERNEL_FIELDS`, in that order), which evaluates the same sequence of fp32 operations
    on them.  ``split``/``inv_runtime`` select the split-product terms (docs/bounds.md) and
    whether their absolute parts scale with the run-time ``inv`` (fp16 pieces)."""

    two_s: float  # the kernel's 2s (signed) and s^2
    s_sq: float
    ts: float  # |2s|
    s2: float  # >= the real s^2
    na_add: float  # ||A_k|| <= sqrt((max(G_kk, 0) + na_add) * na_mul) * na_up  [+ na_res, * na_up2: split]
    na_mul: float
    na_up: float
    k_up: float  # 1 / (1 - gamma_{r+4}), rounded up: the lift of a length-r fp32 sum of non-negative terms
    r_eta: float  # r * 2^-149
    cb1: float  # (1 + g_b) d eta
    cb2: float  # 1 / (1 - g_b), rounded up, times (1 + 4u)
    gb: float  # g_b = gamma_d
    gc4: float  # g_c (1 + 4u)
    gc1: float  # 1 + g_c
    tc: float  # d eta + t  (t = (d - 1) 2^-126 on tensor cores, else 0); split: f_U
    gcr: float  # (1 + g_c) r eta
    ga: float  # g_a
    ga1: float  # 1 + g_a
    gar: float  # (1 + g_a) r
    eta: float  # 2^-149
    q_s2: float  # u s_sq / (1 - u)
    q_u2: float  # (1+u)^2 - 1
    q_u3: float  # (1+u)^3 - 1
    q_eta: float  # 2 (1+u)^2 eta
    lift: float  # 1 + 2^-18
    floor: float  # 2^-144
    lo: float  # 1 - 2u
    up1: float  # 1 + u
    u: float
    # the split-product model (docs/bounds.md); neutral values otherwise
    split: bool = False
    inv_runtime: bool = False  # fp16 pieces: the absolute terms scale with the run-time inv
    tg: float = 0.0  # the absolute error per entry of G in e_a (split: f_G; else tc), and the tensor-core
    # tail's B G adds its own (tail_bg)
    rc: float = 0.0  # split: coefficient of sqrt(b_up) b_abs in e_c
    rab: float = 0.0  # split: coefficient of b_abs lora_abs in e_a
    na_res: float = 0.0  # split: added to the bound of ||A_k||
    na_up2: float = 1.0  # split: 1 + 4u, after that addition
    tc_inv: float = 0.0  # inv_runtime: tc += uu(tc_inv inv)
    tg_inv2: float = 0.0  # tg += uu(uu(tg_inv2 inv) inv)
    na_add_inv2: float = 0.0  # na_add += uu(uu(na_add_inv2 inv) inv)
    rc_inv: float = 0.0  # rc = uu(rc_inv inv)
    rab_inv: float = 0.0  # rab = uu(rab_inv inv)
    na_res_inv: float = 0.0  # na_res = uu(na_res_inv inv)
    tail_bg: str | None = None  # B's format where the tail forms B G on tensor cores (tail_bg_coefficients)


# what the Triton tail loads from its constants tensor, in this order
KERNEL_FIELDS = tuple(f for f in PosteriorConstants._fields
                      if f not in ("two_s", "s_sq", "split", "inv_runtime", "tail_bg"))


PRODUCT_MODELS = ("fp32", "fp64", "tensor_core", "split")


def posterior_constants(two_s: float, s_sq: float, *, d_in: int, r: int, tensor_core_products: bool = False,
                        split_pieces: int | None = None, split_format: str = "bf16", products: str | None = None,
                        certify: bool = True, tail_bg: str | None = None) -> PosteriorConstants:
    """The constants of lemma 4' (docs/bounds.md) for the fp32 ``2s``, ``s^2`` of
    :func:`~dora_num.numerics.formulas.scale_constants`, ``d_in``, ``r`` and the product model
    of ``U``, ``G`` (``products``, :data:`PRODUCT_MODELS`: ``"fp32"`` any-order fp32 GEMMs,
    ``gamma_{d_in}``; ``"fp64"`` float64 accumulation rounded once, ``u + gamma64_{2 d_in}``;
    ``"tensor_core"`` 16-bit inputs on tensor cores, ``gamma_{2 d_in}`` and flushed partial sums;
    ``"split"`` ``split_pieces`` pieces of ``split_format``, docs/bounds.md).  Without
    ``products``: ``"split"`` if ``split_pieces``, else ``"tensor_core"`` if
    ``tensor_core_products``, else ``"fp32"``.  ``certify=False``: constants under which every row
    gets ``rel = inf`` (the terms are not products the lemma covers: :func:`dora_num.ops.guard.guard_constants`).
    ``tail_bg``: the format of ``B`` (``"fp32"``, ``"fp16"``, ``"bf16"``) where the tail forms ``B G`` on tensor
    cores from bf16 pieces (:func:`~dora_num.numerics.split_products.tail_bg_coefficients`; the factor
    ``gamma_{2r}`` of ``ba`` becomes ``beta``, docs/bounds.md), None for the fp32 dot.
    Cached (the operator asks for them on every call)."""
    if products is None:
        products = "split" if split_pieces is not None else ("tensor_core" if tensor_core_products else "fp32")
    if products not in PRODUCT_MODELS:
        raise ValueError(f"products must be one of {PRODUCT_MODELS}, got {products!r}")
    if products == "split" and (split_pieces not in (2, 3) or split_format not in SPLIT_FORMATS):
        raise ValueError(f"split_pieces must be 2 or 3 and split_format one of {tuple(SPLIT_FORMATS)}, "
                         f"got {split_pieces!r}, {split_format!r}")
    if tail_bg is not None and tail_bg not in BG_PIECES:
        raise ValueError(f"tail_bg must be None or one of {tuple(BG_PIECES)}, got {tail_bg!r}")
    return _posterior_constants(float(two_s), float(s_sq), int(d_in), int(r), products,
                                None if products != "split" else int(split_pieces), str(split_format), bool(certify),
                                tail_bg)


def _entry_model(products: str, d: int) -> tuple[float, float]:
    """``(c, t)``: per entry ``|U^_jk - U_jk| <= c ||W_j|| ||A_k|| + t`` and the same for ``G`` (lemma 4's
    product models; the split's are in :func:`_split_constants`)."""
    u = U32
    if products == "fp64":  # float64 sums of exact products, one rounding to fp32 (which may underflow once)
        return u + (1 + u) * float(gamma(2 * d, U64)), 2.0**-149
    if products == "tensor_core":  # a truncating accumulator that may flush each partial sum; a flushed partial
        # sum passes through the later additions, (1 + c) as lemma 4's table carries it (2^-149 per product
        # site is twice a product's underflow, which covers that factor for the products)
        c = float(gamma(tc_additions(d), u))
        return c, d * 2.0**-149 + (1 + c) * (d - 1) * TINY32
    return float(gamma(d, u)), d * 2.0**-149  # fp32, any order: d products, each an underflow site


@functools.lru_cache(maxsize=256)
def _tail_factors(r: int, tail_bg: str | None) -> tuple[float, float, float]:
    """``(g_t, gar, tg_add)`` of ``ba``'s sum in the tail: the relative factor that multiplies ``|B||G^||B|^T``
    (``gamma_{2r}``: the fp32 dot ``B G^`` and the row sum; on tensor cores ``beta = gamma_r + (1 + gamma_r)
    (gamma_{2N} c_K + c_D)``), the coefficient ``gar`` of ``(b_abs + 1) eta`` (underflows and flushes, linear in
    ``b_abs``) and what the tensor cores add to ``tg``, the coefficient of ``b_abs^2`` (over ``1 + g_t``)."""
    u, eta = U32, 2.0**-149
    g_r, g_2r = float(gamma(r, u)), float(gamma(2 * r, u))
    if tail_bg is None:
        return g_2r, (1 + g_2r) * r, 0.0
    k = tail_bg_coefficients(r, tail_bg)
    beta = g_r + (1 + g_r) * (k["g2N"] * k["cK"] + k["cD"])
    gar = (1 + g_r) * (r + k["flush"] / eta)
    return beta, gar, (1 + g_r) * (k["g2N"] * k["tauK"] + k["tauD"] + k["sigma"])


@functools.lru_cache(maxsize=256)
def _posterior_constants(two_s: float, s_sq: float, d_in: int, r: int, products: str,
                         split_pieces: int | None, split_format: str, certify: bool = True,
                         tail_bg: str | None = None) -> PosteriorConstants:
    u, eta = U32, 2.0**-149  # eta: 2^-150 rounded up to an fp32 number (twice what a product's underflow needs)
    d, r = int(d_in), int(r)
    if d < 1 or r < 0:
        raise ValueError(f"need d_in >= 1 and r >= 0, got d_in = {d}, r = {r}")
    g_b, g_r = (float(gamma(n, u)) for n in (d, r))
    g_t, gar, tg_add = _tail_factors(r, tail_bg)
    c, t = _entry_model("tensor_core" if products == "split" else products, d)
    if not max(g_b, c, g_t) < 0.5:
        raise ValueError(f"d_in = {d}, r = {r} too large for an fp32 bound (gamma >= 1/2)")
    U = up32
    ts, sq = abs(float(two_s)), float(s_sq)
    if float(np.float32(two_s)) != float(two_s) or float(np.float32(sq)) != sq:
        raise ValueError("two_s and s_sq must be fp32 numbers (dora_num.numerics.formulas.scale_constants)")
    s2 = U((sq + 2.0**-150) / (1 - u) * (1 + 2 * u))
    # the fp32 evaluation's underflows (each < 2^-150, about 30 products) are multiplied by at most
    # max(1, |2s|, s2) afterwards: the floor covers 64 of them at that weight (docs/bounds.md, lemma 4')
    floor = U(2.0**-144 * max(1.0, ts, s2))
    C = PosteriorConstants(
        two_s=float(two_s), s_sq=sq, ts=ts, s2=s2,
        na_add=U((1 + c) * t + 2.0**-149), na_mul=U(1 / (1 - c) * (1 + 4 * u)), na_up=U(1 + 2 * u),
        k_up=U(1 / (1 - float(gamma(r + 4, u)))), r_eta=r * 2.0**-149,
        cb1=U((1 + g_b) * d * eta), cb2=U(1 / (1 - g_b) * (1 + 4 * u)), gb=U(g_b),
        # cross = sum_k B_k U^_k: |dcross| <= ((1+g_r) c + g_r) sqrt(b) lora_abs + (1+g_r)(t b_abs + r eta)
        gc4=U(((1 + g_r) * c + g_r) * (1 + 4 * u)), gc1=U(1 + g_r), tc=U(t), gcr=U((1 + g_r) * r * eta),
        # ba = sum (B G^) * B: |dba| <= (g_t + (1+g_t) c) lora_abs^2 + (1+g_t)(t b_abs^2 + (b_abs+1) r eta)
        # (g_t = gamma_2r; the tensor-core tail: _tail_factors)
        ga=U(g_t + (1 + g_t) * c), ga1=U(1 + g_t), gar=U(gar), eta=eta,
        q_s2=U(u * sq / (1 - u)), q_u2=U(pw(u, 2)), q_u3=U(pw(u, 3)), q_eta=U(2 * (1 + u) ** 2 * eta),
        lift=U(1 + 2.0**-18) if certify else math.inf, floor=floor, lo=float(np.float32(1 - 2 * u)),
        up1=U(1 + u), u=u, tail_bg=tail_bg)
    if products != "split":
        return C._replace(tg=C.tc if tail_bg is None else U(t + tg_add / (1 + g_t)))
    return _split_constants(C, d, r, split_pieces, split_format, g_t, tg_add)


def _split_constants(C: PosteriorConstants, d: int, r: int, p: int, fmt: str, g_t: float,
                     tg_add: float) -> PosteriorConstants:
    """``C`` with the coefficients of the split-product model (docs/bounds.md); ``g_t``, ``tg_add``: the tail's
    factor of ``ba`` and its addition to ``tg`` (:func:`_tail_factors`)."""
    u, eta, U = U32, 2.0**-149, up32
    u_h, sigma = SPLIT_FORMATS[fmt]
    fp16 = fmt == "fp16"
    c_h = 1 + 2 * u_h + 2 * u_h**2
    rho = 0.0 if p == 3 else u_h**2
    sigma_r = (sigma if p == 3 else sigma * (1 + u_h)) + (2.0**-150 if fp16 else 0.0)
    tau = 5 * sigma + (2.0**-149 if fp16 else 0.0)  # per unit of inv
    g_u, g_G = float(gamma(tc_additions(d) + p - 1, u)), float(gamma(tc_additions(d) + p * p - 1, u))
    g_r = float(gamma(r, u))
    gG = g_G * c_h**2 + 2 * rho + 3 * rho**2
    if not max(g_u, g_G, gG, g_r, g_t) < 0.5:
        raise ValueError(f"d_in = {d}, r = {r} too large for an fp32 bound (gamma >= 1/2)")
    sd = math.sqrt(d) * (1 + 2.0**-50)
    a1 = g_u * tau + sigma_r  # x inv: the absolute part of U's error per unit of ||W_j||_1
    aG = g_G * c_h * tau + sigma_r * (1 + 3 * rho)  # x inv
    fU1 = (1 + g_u) * p * (2 * d - 1) * TINY32  # x inv
    fG2 = g_G * d * tau**2 + 3 * d * sigma_r**2 + (1 + g_G) * p * p * (2 * d - 1) * TINY32  # x inv^2
    rc1 = (1 + g_r) * sd * a1
    rab1 = 2 * (1 + g_t) * sd * aG
    nres1 = 2 * sd * aG / (1 - gG) * (1 + 4 * u)
    common = dict(split=True, gc4=U((g_r + (1 + g_r) * (g_u * c_h + rho)) * (1 + 4 * u)), gc1=U(1 + g_r),
                  gcr=U((1 + g_r) * r * eta), ga=U(g_t + (1 + g_t) * gG), ga1=U(1 + g_t),
                  na_mul=U(1 / (1 - gG) * (1 + 4 * u)), na_up2=U(1 + 4 * u))
    if not fp16:  # inv = 1: everything folded into the constants
        return C._replace(**common, tc=U(fU1 + eta), tg=U(fG2 + 2 * eta + tg_add / (1 + g_t)), na_add=U(fG2 + 2 * eta),
                          rc=U(rc1), rab=U(rab1), na_res=U(nres1))
    return C._replace(**common, inv_runtime=True, tc=U(eta), tg=U(2 * eta + tg_add / (1 + g_t)), na_add=U(2 * eta),
                      rc=0.0, rab=0.0,
                      na_res=0.0, tc_inv=U(fU1), tg_inv2=U(fG2), na_add_inv2=U(fG2), rc_inv=U(rc1),
                      rab_inv=U(rab1), na_res_inv=U(nres1))


def runtime_constants(C: PosteriorConstants, inv=None):
    """``(tc, tg, na_add, rc, rab, na_res)`` for one call: the constants themselves, or with
    ``C.inv_runtime`` (fp16 pieces) their parts that scale with the run-time ``inv = 2^-k`` of the
    split (an fp32 0-dim tensor, or a float), each product by ``inv`` raised by ``2^-149`` so that it
    is not below the exact one where it underflows.  The Triton tail evaluates the same operations."""
    if not C.inv_runtime:
        return C.tc, C.tg, C.na_add, C.rc, C.rab, C.na_res
    if inv is None:
        raise ValueError("these constants (fp16 split pieces) need the split's run-time inv = 2^-k")
    import torch

    inv = torch.as_tensor(inv, dtype=torch.float32)

    def uu(x):
        return x + _UU

    return (C.tc + uu(C.tc_inv * inv), C.tg + uu(uu(C.tg_inv2 * inv) * inv),
            C.na_add + uu(uu(C.na_add_inv2 * inv) * inv), uu(C.rc_inv * inv), uu(C.rab_inv * inv),
            uu(C.na_res_inv * inv))


def _sqrt_rn(x):
    """The correctly rounded fp32 square root on every device (as the Triton tail's ``sqrt_rn``)."""
    return TorchFP32CorrectSqrt.sqrt(x)


def lora_row_magnitudes(B, G, *, d_in: int | None = None, tensor_core_products: bool = False,
                        constants: PosteriorConstants | None = None, inv=None):
    r"""``(lora_abs, b_abs)``, fp32 ``[d_out]`` upper bounds, from ``B`` and the computed Gram
    ``G = A A^T`` (what the factored norm's tail holds): ``lora_abs_j >= sum_k |B_jk| ||A_k||``
    and ``b_abs_j >= sum_k |B_jk|``, the magnitudes :func:`factored_norm_posterior` needs.

    ``||A_k||^2 = G_kk`` exactly, and the computed ``G^_kk >= G_kk (1 - gamma_dp) - n eta``
    (``dp = d_in``, ``2 d_in`` on tensor cores, plus ``2^-126`` per addition there), so
    ``||A_k|| <= sqrt((G^_kk + c) / (1 - gamma_dp))`` (a correctly rounded square root, then
    raised by ``1 + 2u``; split products: docs/bounds.md's bound); the fp32 sums of ``r``
    non-negative products, in any order, are then raised by ``1 / (1 - gamma_{r+4})`` and ``r``
    underflows.  Cost: two length-``r`` reductions per row.  ``d_in``: the inner dimension of
    ``G`` (``A.shape[1]``), or the ``constants`` of :func:`posterior_constants`; ``inv``: the
    split's run-time scale (fp16 pieces)."""
    import torch

    B = torch.as_tensor(B).detach().float()
    G = torch.as_tensor(G).detach().float().to(B.device)
    r = B.shape[1]
    if constants is None:
        if d_in is None:
            raise ValueError("lora_row_magnitudes needs d_in (the inner dimension of G = A A^T)")
        constants = posterior_constants(1.0, 0.25, d_in=d_in, r=r, tensor_core_products=tensor_core_products)
    C = constants
    _, _, na_add, _, _, na_res = runtime_constants(C, inv)
    diag = torch.diagonal(G).clamp_min(0)
    nA = _sqrt_rn((diag + na_add) * C.na_mul) * C.na_up
    if C.split:
        nA = (nA + na_res) * C.na_up2
    aB = B.abs()
    # elementwise products and sums, not a GEMM: torch's TF32/bf16 matmul switches cannot lower them
    lora_abs = (aB * nA).sum(1) * C.k_up + C.r_eta
    b_abs = aB.sum(1) * C.k_up
    return lora_abs, b_abs


def factored_norm_posterior(base, cross, ba, two_s: float, s_sq: float, *, d_in: int, r: int,
                            lora_abs, b_abs, tensor_core_products: bool = False,
                            split_pieces: int | None = None, split_format: str = "bf16", inv=None):
    r"""Lemma 4' (the cancellation guard's bound): per row, from the factored norm's own
    fp32 terms, ``(kappa, rel)``, fp32 tensors ``[d_out]``:

    - ``kappa = (base^ + |2s cross^| + s_sq ba^) / Q^``, the condition of the assembly from
      the computed terms, ``Q^`` the fp32 ``fl(fl(s_sq ba^) + fl(fl(2s cross^) + base^))``
      of :func:`~dora_num.numerics.formulas.norm_assembly` (``inf`` where ``Q^ <= 0``; 1 where
      all three terms are 0);
    - ``rel``: a guaranteed bound on ``|w^ - w| / w`` for the computed ``w^ = RN(sqrt(max(Q^, 0)))``
      and the exact ``w = ||W + s BA||_row`` (real ``s^2``), valid although the terms are
      themselves rounded; ``inf`` where no finite bound exists (``Q`` may be 0 within the
      terms' errors, e.g. a zero row or a row whose squares all underflow: such a row must be
      recomputed, e.g. by the dense norm).

    Inputs: ``base``, ``cross``, ``ba`` as the kernel holds them (fp32 ``[d_out]``),
    ``two_s``, ``s_sq`` its fp32 constants, ``d_in``, ``r``, the product model
    (``tensor_core_products``: ``U``, ``G`` from tensor-core products of 16-bit inputs;
    ``split_pieces``, ``split_format``, ``inv``: from split products, docs/bounds.md), and the
    row magnitudes of :func:`lora_row_magnitudes` (``lora_abs >= sum_k |B_k| ||A_k||``,
    ``b_abs >= sum_k |B_k|``): the term errors are relative to ``M_c = sum_k |B_k| (|W||A_k|) <=
    sqrt(base) lora_abs`` (Cauchy-Schwarz per k) and ``M_a = || |B||A| ||^2 <= lora_abs^2``, not to
    ``|cross|`` or ``ba``, which may cancel; without them no bound from the terms alone exists.

    Derivation (docs/bounds.md, lemma 4'): with ``b <= b_up = (base^ + (1+g_b) d eta) /
    (1 - g_b)``, the a-priori term errors of lemma 4 become
    ``e_b <= g_b b_up + (1+g_b) d eta``, ``e_c <= g_c sqrt(b_up) lora_abs + (1+g_c)(b_abs (d eta + t)
    + r eta)``, ``e_a <= g_a lora_abs^2 + (1+g_a)(b_abs^2 (d eta + t) + (b_abs + 1) r eta)``
    (``g_b = gamma_d``, ``g_c = gamma_{dp+r}``, ``g_a = gamma_{dp+2r}``, ``t = (d-1) 2^-126`` on
    tensor cores; split products: docs/bounds.md's ``e_c``, ``e_a``), and ``|Q^ - Q| <= dQ
    = e_b + |2s| e_c + s2 e_a + (u s2 + eta) ba^ + ((1+u)^2-1)(base^ + s_sq ba^) +
    ((1+u)^3-1)|2s cross^| + 2(1+u)^2 eta`` with ``s2 = (s_sq + eta)/(1-u) >= s^2``.  Then ``Q >=
    Q_lo = Q^ - dQ > 0`` and ``Q^ >= Q_lo``, so ``|sqrt(Q^) - sqrt(Q)| / sqrt(Q) = |Q^ - Q| /
    (sqrt(Q^ Q) + Q) <= dQ / (2 Q_lo)``, and with the rounding of the square root ``|w^ - w| / w
    <= (1+u) dQ / (2 Q_lo) + u``.  Evaluated in fp32 (about 40 operations on non-negative values,
    ordered so that the tiny constants multiply last; the constants of
    :func:`posterior_constants`): ``dQ`` is raised by ``1 + 2^-18`` (> ``(1+u)^40``) and by
    ``2^-144`` (> the underflow of the ~40 products, ``2^-150`` each), ``Q_lo`` lowered by
    ``1 - 2u``, the quotient raised by ``1 + 2^-18``.  The Triton tail evaluates the same
    sequence (bitwise equal given the same terms and magnitudes:
    ``tests/ops/kernels/test_norm_tail.py``).
    """
    import torch

    C = posterior_constants(two_s, s_sq, d_in=d_in, r=r, tensor_core_products=tensor_core_products,
                            split_pieces=split_pieces, split_format=split_format)
    base, cross, ba = (torch.as_tensor(x).float() for x in (base, cross, ba))
    lora_abs = torch.as_tensor(lora_abs).float().to(base.device)
    b_abs = torch.as_tensor(b_abs).float().to(base.device)
    return posterior_from_terms(base, cross, ba, lora_abs, b_abs, C, inv)


def posterior_from_terms(base, cross, ba, lora_abs, b_abs, C: PosteriorConstants, inv=None):
    """``(kappa, rel)`` of :func:`factored_norm_posterior` from fp32 tensors and the constants
    ``C`` (the sequence the torch tail of :func:`dora_num.ops.norm.factored_row_norm` runs; ``inv``:
    the split's run-time scale, fp16 pieces)."""
    import torch

    tc, tg, _, rc, rab, _ = runtime_constants(C, inv)
    ab, aba = base.abs(), ba.abs()
    Qh = (C.s_sq * ba) + ((C.two_s * cross) + base)
    tcr = (C.ts * cross).abs()
    mag = ab + tcr + C.s_sq * aba
    b_up = (ab + C.cb1) * C.cb2
    e_b = b_up * C.gb + C.cb1
    if C.split:
        sb = _sqrt_rn(b_up)
        e_c = (sb * lora_abs) * C.gc4 + (sb * b_abs) * rc + (b_abs * C.gc1) * tc + C.gcr
        e_a = (lora_abs * lora_abs) * C.ga + (b_abs * lora_abs) * rab + ((b_abs * b_abs) * C.ga1) * tg \
            + ((b_abs + 1) * C.gar) * C.eta
    else:
        e_c = _sqrt_rn(b_up) * lora_abs * C.gc4 + (b_abs * C.gc1) * C.tc + C.gcr
        e_a = (lora_abs * lora_abs) * C.ga + ((b_abs * b_abs) * C.ga1) * tg + ((b_abs + 1) * C.gar) * C.eta
    dQ = e_b + e_c * C.ts + e_a * C.s2 + aba * C.q_s2 + aba * C.eta \
        + (ab + C.s_sq * aba) * C.q_u2 + tcr * C.q_u3 + C.q_eta
    dQ = dQ * C.lift + C.floor
    Q_lo = (Qh - dQ) * C.lo
    ok = torch.isfinite(dQ) & torch.isfinite(Qh) & (Q_lo > 0)
    inf = torch.full_like(Qh, float("inf"))
    q = dQ / torch.where(ok, Q_lo, torch.ones_like(Q_lo))
    rel = torch.where(ok, ((q * 0.5) * C.up1 + C.u) * C.lift, inf)
    pos = torch.isfinite(Qh) & (Qh > 0)
    kappa = torch.where(pos, mag / torch.where(pos, Qh, torch.ones_like(Qh)), inf)
    kappa = torch.where(mag == 0, torch.ones_like(kappa), kappa)
    return kappa, rel
