"""The products ``U = W A^T`` and ``G = A A^T`` of the factored row norm
(:mod:`dora_num.ops.norm`) in fp32 without an fp32 copy of W.

16-bit W on CUDA: tensor-core products with exact products and fp32 accumulation; with an A of
another dtype (fp32 adapters, as PEFT keeps them) through the exact split of A into 16-bit
pieces (:func:`split_pieces`, :func:`split_mm`, :func:`split_gram`; error bounds in
:mod:`dora_num.numerics.split_products`).  Elsewhere fp32 products, over column chunks of W.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import OpConfig

_MM_OUT_DTYPE_OK: dict = {}  # (device type, dtype) -> whether torch.mm(..., out_dtype=fp32) runs
SPLIT_DTYPES = (torch.bfloat16, torch.float16)
# fp16 pieces: A is scaled by 2^k so that max|A| 2^k lies in [2^14, 2^15) (the first piece then
# cannot overflow fp16's 65504), k clamped to [-126, 126] so that 2^k and 2^-k are normal fp32.
_FP16_TOP = 15
_K_LIMIT = 126


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` with fp32 accumulation and fp32 output for 16-bit CUDA inputs, or None
    where this torch has no such kernel (probed once per device type and dtype)."""
    key = (a.device.type, a.dtype)
    if a.device.type != "cuda" or _MM_OUT_DTYPE_OK.get(key) is False:
        return None
    try:
        out = torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        _MM_OUT_DTYPE_OK[key] = False
        return None
    _MM_OUT_DTYPE_OK[key] = True
    return out


def split_pieces(A: torch.Tensor, dtype: torch.dtype, pieces: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""``(P, inv)``: ``A`` (any float dtype, taken as fp32) as a sum of ``pieces`` 16-bit pieces.

    ``P`` is ``[pieces, r, d]`` of ``dtype`` (bf16 or fp16) with, in exact arithmetic,
    ``A = inv * sum_p P[p] + res`` (``inv`` None means 1).  The pieces are the greedy
    round-to-nearest split ``P[0] = RN(R_0)``, ``R_{p+1} = R_p - P[p]``, ``P[p] = RN(R_p)``
    with ``R_0 = A`` (bf16) or ``A 2^k`` (fp16: ``2^k``, a device scalar computed without a
    sync, puts ``max|A| 2^k`` in ``[2^14, 2^15)``, ``k`` clamped to ``[-126, 126]``;
    ``inv = 2^-k``).  Every ``R_p`` is exact in fp32 (``R_p - RN(R_p)`` is a multiple of the
    fp32 quantum of ``A``, at most half a 16-bit ulp of ``R_p``), so the only loss is the
    last rounding, ``res = inv |R_{pieces-1} - P[-1]|``:

    - bf16 (8-bit significands, fp32's exponent range), 3 pieces: ``|R_2| <= 2^-16 |A|``
      spans at most 8 significant bits (quantum of A and up), so ``P[2] = R_2`` exactly
      unless ``R_2`` falls below bf16's normal range: ``res = 0`` for ``|A| >= 2^-110``,
      ``res <= 2^-134`` (half the bf16 subnormal spacing) otherwise;
    - bf16, 2 pieces: ``res <= 2^-17 |A| (1 + 2^-8)`` (about 17 bits of A are kept);
    - fp16 (11 bits; 3 pieces hold 33 >= 24): ``res`` is the underflow of the last
      scaled pieces below fp16's ``2^-24`` spacing, ``<= inv 2^-25`` per element.

    Magnitudes: ``sum_p |P[p]| <= (1 + 2 u_h + 2 u_h^2) |R_0|`` with ``u_h`` the pieces'
    unit roundoff (``|P[0]| <= (1+u_h)|R_0|``, ``|R_1| <= u_h |R_0|``, ...).  An fp32 A
    above bf16's largest finite value (3.39e38) gives an infinite piece (the norm is then not
    finite and flagged).  :func:`dora_num.numerics.split_products.split_pieces_np` is the
    exact emulation the bound and the tests use.
    """
    if dtype not in SPLIT_DTYPES:
        raise ValueError(f"split_pieces: dtype must be bfloat16 or float16, got {dtype}")
    if pieces not in (2, 3):
        raise ValueError(f"split_pieces: pieces must be 2 or 3, got {pieces!r}")
    R = A.float()
    inv = None
    if dtype == torch.float16:
        e = torch.frexp(R.abs().amax()).exponent  # max|A| < 2^e (0 for A = 0)
        k = (_FP16_TOP - e).clamp(-_K_LIMIT, _K_LIMIT).to(torch.int32)
        R = R * _pow2(k)
        inv = _pow2(-k)
    P = torch.empty((pieces,) + tuple(A.shape), dtype=dtype, device=A.device)
    for p in range(pieces):
        P[p].copy_(R)  # round to nearest even
        if p + 1 < pieces:
            R = torch.sub(R, P[p])  # fp32 (type promotion upcasts P[p] exactly): exact
    return P, inv


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` as fp32 for an int32 device tensor ``k`` in ``[-126, 127]``, built from its exponent
    bits (exact; ``torch.ldexp`` goes through ``pow``, which need not be)."""
    return ((k + 127) << 23).view(torch.float32)


def _mm_cpu_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit operands in fp32 (their products are exact in fp32; CPU and tests)."""
    return a.float() @ b.float()


def _mm32(a: torch.Tensor, b: torch.Tensor, mm=None) -> torch.Tensor:
    """``a @ b`` of 16-bit operands with fp32 output: ``mm`` if given (the tests' tensor-core
    emulation), else the tensor-core product (:func:`_mm_fp32_out`), else fp32 products."""
    if mm is not None:
        return mm(a, b)
    out = _mm_fp32_out(a, b)
    return _mm_cpu_fp32(a, b) if out is None else out


def split_mm(W: torch.Tensor, A: torch.Tensor, pieces: int, mm=None, split=None) -> torch.Tensor:
    r"""``U = W A^T`` fp32 ``[d_out, r]`` for a 16-bit ``W`` and an ``A`` of any float dtype,
    from tensor-core products only: ``A`` split into ``pieces`` pieces of W's dtype
    (:func:`split_pieces`), one product ``W [P_1; ...; P_p]^T`` with fp32 accumulation and
    fp32 output (``[d_out, p r]``), then the ``p`` column blocks summed in fp32 (and scaled by
    ``inv``, exact unless the result underflows).  Each product ``W_ji P_p,ki`` is exact in
    fp32 (8+8 or 11+11 significand bits), so the error is the accumulation (``d_in - 1``
    additions that may truncate: ``2u`` each) and the ``p - 1`` block additions:
    ``|U^ - U| <= gamma_{2 d + p - 1} |W| sum_p |P_p|^T inv + |W| res^T`` (+ underflow;
    :func:`dora_num.numerics.split_products.split_u_error`).  ``mm(a, b)`` (default
    ``torch.mm(a, b, out_dtype=float32)`` on CUDA, fp32 products of the upcast operands
    elsewhere) is the seam through which the tests emulate a tensor core.  ``split``: the
    ``(P, inv)`` of :func:`split_pieces` if already computed (shared with :func:`split_gram`).
    """
    P, inv = split_pieces(A, W.dtype, pieces) if split is None else split
    p, r, d = P.shape
    S = P.view(p * r, d)
    U = _mm32(W, S.T, mm).view(W.shape[0], p, r).sum(dim=1)
    return U if inv is None else U.mul_(inv)


def split_gram(A: torch.Tensor, dtype: torch.dtype, pieces: int, mm=None, split=None) -> torch.Tensor:
    r"""``G = A A^T`` fp32 ``[r, r]`` from tensor-core products only: with ``S = [P_1; ...; P_p]``
    (:func:`split_pieces` in ``dtype``), ``S S^T`` (fp32 accumulation and output,
    ``[p r, p r]``) and its ``p^2`` blocks summed in fp32 (then scaled by ``inv`` twice).
    ``|G^ - G| <= gamma_{2 d + p^2 - 1} |S~||S~|^T + res |A~|^T + |A~| res^T + res res^T``
    with ``S~ = inv sum_p |P_p|`` and ``A~ = inv sum_p P_p``
    (:func:`dora_num.numerics.split_products.split_gram_error`).  Independent of torch's TF32
    switches (an fp32 ``A @ A.T`` is not, under ``allow_tf32``).  ``mm``, ``split``: as :func:`split_mm`."""
    P, inv = split_pieces(A, dtype, pieces) if split is None else split
    p, r, d = P.shape
    S = P.view(p * r, d)
    G = _mm32(S, S.T, mm).view(p, r, p, r).sum(dim=(0, 2))
    return G if inv is None else G.mul_(inv).mul_(inv)


def _tensor_core_fp32_out(dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` runs for ``dtype`` on CUDA (probed once, on a
    one-element product)."""
    key = ("cuda", dtype)
    if key not in _MM_OUT_DTYPE_OK:
        one = torch.ones(1, 1, dtype=dtype, device="cuda")
        _mm_fp32_out(one, one)
    return bool(_MM_OUT_DTYPE_OK.get(key))


def _split_on(W: torch.Tensor, A: torch.Tensor) -> bool:
    """Whether the products of the factored norm take the split route: 16-bit W on CUDA (with
    tensor-core fp32 output) and an A of another dtype (fp32 adapters, as PEFT keeps them)."""
    return (W.dtype in SPLIT_DTYPES and A.dtype != W.dtype and W.device.type == "cuda"
            and _MM_OUT_DTYPE_OK.get(("cuda", W.dtype)) is not False)


def _u_product(W: torch.Tensor, A: torch.Tensor, cols: int, pieces: int = 3) -> torch.Tensor:
    """``U = W A^T`` fp32 ``[d_out, r]`` without an fp32 copy of W where possible.

    - W and A fp32: one fp32 product (no copy).
    - W and A of one 16-bit dtype on CUDA: one tensor-core product with fp32
      accumulation and fp32 output (``torch.mm(..., out_dtype=float32)``).  Each
      product ``W_jk A_ik`` is exact in fp32 (8+8 significand bits for bf16, 11+11
      for fp16, both <= 24), so the only error is the accumulation:
      ``|U_hat - U| <= gamma'_{d_in} |W| |A|^T`` with ``gamma'_n = 2nu/(1-2nu)``
      (``2u`` per addition covers an accumulator that truncates instead of
      rounding to nearest, as tensor cores may).  Extra memory: U itself.
    - 16-bit W on CUDA and A of another dtype (fp32 adapters): :func:`split_mm`, ``pieces``
      tensor-core products (no fp32 copy of W, no fp32 GEMM over W).  Extra memory:
      ``d_out * pieces * r * 4`` bytes and the pieces of A.
    - otherwise (CPU 16-bit or mixed dtypes): fp32 column chunks of W under the
      byte budget, accumulated with ``addmm_`` (fp32 products, ``gamma_{d_in}``).
    """
    d_out = W.shape[0]
    r = A.shape[0]
    if W.dtype == torch.float32 and A.dtype == torch.float32:
        return W @ A.T
    if W.dtype in SPLIT_DTYPES and A.dtype == W.dtype:
        U = _mm_fp32_out(W, A.T)
        if U is not None:
            return U
    if _split_on(W, A) and _tensor_core_fp32_out(W.dtype):
        return split_mm(W, A, pieces)
    U = torch.zeros(d_out, r, dtype=torch.float32, device=W.device)
    for start in range(0, W.shape[1], cols):
        U.addmm_(W[:, start : start + cols].float(), A[:, start : start + cols].float().T)
    return U


class Products(NamedTuple):
    """What :func:`_products` returns: ``U``, ``G`` (fp32) and how they were formed."""

    U: torch.Tensor
    G: torch.Tensor
    pieces: int | None  # the split's piece count, None without the split
    inv: torch.Tensor | None  # fp16 pieces: the split's run-time scale 2^-k (0-dim fp32)


def _products(W: torch.Tensor, A: torch.Tensor, cols: int, cfg: OpConfig) -> Products:
    """:class:`Products` of the factored norm (:func:`_u_product`, :func:`_gram_fp32`): both from the
    split of A (``cfg.split_pieces`` pieces) where W is 16-bit on CUDA and A is not of W's dtype
    (the cancellation guard's product model then follows the split's)."""
    if _split_on(W, A) and _tensor_core_fp32_out(W.dtype):
        pieces = split_pieces(A, W.dtype, cfg.split_pieces)  # once, for both products
        return Products(split_mm(W, A, cfg.split_pieces, split=pieces),
                        split_gram(A, W.dtype, cfg.split_pieces, split=pieces), cfg.split_pieces, pieces[1])
    return Products(_u_product(W, A, cols), _gram_fp32(A), None, None)


def _gram_fp32(A: torch.Tensor, W_dtype: torch.dtype | None = None, pieces: int = 3,
               split: bool = False) -> torch.Tensor:
    """``G = A A^T`` fp32 ``[r, r]``: exact products for 16-bit A on CUDA (as :func:`_u_product`);
    with ``split`` (the products of :func:`_u_product` took the split route) :func:`split_gram`
    in ``W_dtype``; fp32 otherwise."""
    if split:
        return split_gram(A, W_dtype, pieces)
    if A.dtype == torch.float32:
        return A @ A.T
    if A.dtype in (torch.bfloat16, torch.float16):
        G = _mm_fp32_out(A, A.T)
        if G is not None:
            return G
    Af = A.float()
    return Af @ Af.T
