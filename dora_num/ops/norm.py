"""Row norms of ``W + s*B@A``: dense (PEFT-style) and factored (never forms BA).

Math
----
``||W_j + s(BA)_j||^2 = base_j + 2s cross_j + s^2 ba_j`` with
``base = rowsum(W*W)``, ``U = W A^T``, ``cross = rowsum(B*U)``,
``G = A A^T``, ``ba = rowsum((B G) * B)``; assembled by
:func:`dora_num.numerics.formulas.norm_assembly`.

Where it loses accuracy: the assembly is a sum whose condition number is
``kappa = (base + |2s cross| + s^2 ba) / wnorm^2``.  With fp32 terms each carrying
relative error up to ``gamma_{d_in}`` (about ``log2(d_in) u`` in practice, for
pairwise summation), ``wnorm^2`` carries about ``kappa`` times that, so the
relative error of ``wnorm`` grows like ``u kappa``.  The dense norm rounds
``W + s(BA)`` elementwise, with errors proportional to ``|W_i|`` rather than to the
result, and degrades only like ``u sqrt(kappa)`` (derivations and measurements:
:func:`dora_num.numerics.bounds.factored_norm_bound`, ``dense_norm_bound``,
notebook 03).  The factored norm loses to the dense one only when ``kappa`` is
large (the update cancelling the row).
Realistic adapters have ``||sBA|| << ||W||`` and ``kappa ≈ 1``.

Memory: ``base`` needs one fp32 chunk of W and its square,
``2 * d_out * chunk * 4`` bytes, kept under ``chunk_bytes`` (by default a quarter of
a dense fp32 ``[d_out, d_in]``, at most 256 MiB: :func:`resolve_chunk_bytes`).  With the cached
``base_sq`` and 16-bit W on CUDA, ``U = W A^T`` is one tensor-core product with
fp32 output (no fp32 copy of W).  On CUDA the tail (``cross``, ``ba``, the
assembly) is one Triton launch (:mod:`dora_num.ops.kernels.norm_tail`, which keeps
``B G`` and the fp32 copy of ``B`` in registers), so the extra memory is ``U``
(``d_out*r*4``) plus ``G`` (``r*r*4``): 13.2 MB at 8192x8192, r=384, against 805 MB
for the dense fp32 norm (H200, ``data/gpu/norm_bench.csv``).  Elsewhere (or with
``OpConfig.norm_tail="torch"``, environment ``DORA_NUM_NORM_TAIL=torch``) the tail is
torch operations over row blocks of ``B`` under ``ROW_CHUNK_BYTES``.

Public pieces besides the norms: :func:`factored_terms` (the fp32 terms the torch tail
assembles, for studies of the assembly), :func:`magnitude_scale_and_flag` (the layer's
``g`` with a device flag instead of a sync), :func:`uses_tail_kernel`.
"""

from __future__ import annotations

import contextlib

import torch

from ..numerics import formulas
from ..numerics.arithmetic import TorchFP32, TorchFP32CorrectSqrt
from ..numerics.formulas import norm_assembly, scale_constants
from .config import OpConfig, get_config
from .validation import check_finite, check_lora_factors, check_scale, check_tensor

CHUNK_ALIGN = 64  # columns; chunk widths are multiples of this (coalesced, tensor-core friendly)
DEFAULT_CHUNK_BYTES = 256 * 2**20


def uses_tail_kernel(device: torch.device, config: OpConfig | None = None) -> bool:
    """Whether the factored norm's tail (cross, ba, assembly; for the layer also the clamp and
    the finiteness flag of g) runs as the one-launch Triton kernel of
    :mod:`dora_num.ops.kernels.norm_tail` on ``device`` under ``config`` (default
    :func:`~dora_num.ops.config.get_config`): ``norm_tail="auto"`` on CUDA, ``"triton"`` on
    CUDA and on CPU under the interpreter; otherwise (``"torch"``, or CPU without the
    interpreter) the torch sequence runs."""
    cfg = get_config() if config is None else config
    if cfg.norm_tail == "torch":
        return False
    if device.type == "cuda":
        return True
    return cfg.norm_tail == "triton" and device.type == "cpu" and cfg.interpret


class _AutocastDisabled:
    """Autocast off for ``device_type`` inside the block, restored after (the one switch the
    norm needs: its products must not be cast).  0.8 us per enter/exit on the CPU machine
    against 4.4 us for ``torch.autocast(..., enabled=False)`` (which also saves and restores the
    autocast dtype and cache state, unchanged here); eager only."""

    __slots__ = ("device_type",)

    def __init__(self, device_type: str):
        self.device_type = device_type

    def __enter__(self):
        torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc):
        torch.set_autocast_enabled(self.device_type, True)
        return False


def _autocast_off(device_type: str):
    """Autocast off for ``device_type`` where it is on, else a no-op (constructing a
    ``torch.autocast`` context costs ~4-10 us of Python on the hot path; while tracing,
    ``torch.autocast`` itself)."""
    if torch.is_autocast_enabled(device_type):
        if torch.compiler.is_compiling():
            return torch.autocast(device_type, enabled=False)
        return _AutocastDisabled(device_type)
    return contextlib.nullcontext()


def dense_row_norm(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """``||W + s*B@A||_row`` in fp32 by materialising the dense ``[d_out, d_in]`` sum.

    The PEFT-style reference, evaluated in fp32 (PEFT itself works in the weight
    dtype).  Costs ``d_out * d_in * 4`` bytes (twice, with the product).  Checks
    all inputs for NaN/Inf.  No gradient.
    """
    check_lora_factors(W, A, B)
    s = check_scale(scale)
    for name, t in (("W", W), ("A", A), ("B", B)):
        check_finite(name, t)
    with torch.no_grad(), torch.autocast(W.device.type, enabled=False):
        dense = W.float() + s * (B.float() @ A.float())
        return torch.linalg.vector_norm(dense, dim=1)


def resolve_chunk_bytes(d_out: int, d_in: int, chunk_bytes: int | None) -> int:
    """The byte budget of one fp32 chunk of W plus its square.

    ``None`` (the default everywhere) means ``min(256 MiB, d_out*d_in*4 / 4)``, never
    below one 64-column chunk: each temporary is then at most an eighth of a dense
    fp32 ``[d_out, d_in]`` matrix (the two together a quarter) for ``d_in >= 512``,
    and never above the 256 MiB of the paper's implementation at large sizes.
    An explicit ``chunk_bytes`` is used as given (validated by :func:`chunk_columns`).
    """
    if chunk_bytes is not None:
        return chunk_bytes
    smallest = min(CHUNK_ALIGN, d_in) * 2 * 4 * max(d_out, 1)
    return max(smallest, min(DEFAULT_CHUNK_BYTES, d_out * d_in))


def chunk_columns(d_out: int, d_in: int, chunk_bytes: int | None) -> int:
    """Widest chunk (a multiple of 64 columns, or all of ``d_in``) whose fp32
    copy of W plus its square fit in ``chunk_bytes`` (``None``: :func:`resolve_chunk_bytes`)."""
    chunk_bytes = resolve_chunk_bytes(d_out, d_in, chunk_bytes)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    per_column = 2 * 4 * max(d_out, 1)  # fp32 chunk of W and its elementwise square
    smallest = min(CHUNK_ALIGN, d_in)
    if chunk_bytes < smallest * per_column:
        raise ValueError(
            f"chunk_bytes={chunk_bytes} is smaller than one {smallest}-column fp32 chunk of W "
            f"(needs {smallest * per_column} bytes for d_out={d_out})"
        )
    cols = chunk_bytes // per_column
    if cols >= d_in:
        return d_in
    return max(CHUNK_ALIGN, cols // CHUNK_ALIGN * CHUNK_ALIGN)


def base_row_norm_sq(W: torch.Tensor, *, chunk_bytes: int | None = None) -> torch.Tensor:
    """``rowsum(W*W)`` in fp32, chunked along ``d_in``; depends on the frozen W only."""
    check_tensor("W", W, ndim=2)
    d_out, d_in = W.shape
    cols = chunk_columns(d_out, d_in, chunk_bytes)
    with torch.no_grad(), _autocast_off(W.device.type):
        acc = torch.zeros(d_out, dtype=torch.float32, device=W.device)
        for start in range(0, d_in, cols):
            Wc = W[:, start : start + cols].float()
            acc += (Wc * Wc).sum(dim=1)
        return acc


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
    if mm is None:
        Up = _mm_fp32_out(W, S.T)
        if Up is None:
            Up = _mm_cpu_fp32(W, S.T)
    else:
        Up = mm(W, S.T)
    U = Up.view(W.shape[0], p, r).sum(dim=1)
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
    if mm is None:
        Gp = _mm_fp32_out(S, S.T)
        if Gp is None:
            Gp = _mm_cpu_fp32(S, S.T)
    else:
        Gp = mm(S, S.T)
    G = Gp.view(p, r, p, r).sum(dim=(0, 2))
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


def _products(W: torch.Tensor, A: torch.Tensor, cols: int, cfg: OpConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, G)`` of the factored norm (:func:`_u_product`, :func:`_gram_fp32`): both from the
    split of A (``cfg.split_pieces`` pieces) where W is 16-bit on CUDA and A is not of W's dtype."""
    split = _split_on(W, A) and _tensor_core_fp32_out(W.dtype)
    if split:
        pieces = split_pieces(A, W.dtype, cfg.split_pieces)  # once, for both products
        return (split_mm(W, A, cfg.split_pieces, split=pieces),
                split_gram(A, W.dtype, cfg.split_pieces, split=pieces))
    return _u_product(W, A, cols), _gram_fp32(A)


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


# Temporaries of the torch tail's cross/Gram terms: three [rows, r] fp32 blocks.  24 MiB
# keeps 8192 x r=384 to two row blocks, since the loop is bound by launches (on the H200,
# seven blocks of 6 MiB cost ~0.9 ms of the cached norm at 8192x8192 against ~0.1 ms of
# GEMMs; a reading not kept in data/).  With 24 MiB the cached norm takes 0.46 ms there,
# and 0.23 ms with the tail kernel that replaced this loop on CUDA (bf16, r=384:
# data/gpu/norm_bench.csv).
ROW_CHUNK_BYTES = 24 * 2**20


def factored_row_norm(
    W: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: float,
    *,
    chunk_bytes: int | None = None,
    base_sq: torch.Tensor | None = None,
    check: bool = True,
    return_flag: bool = False,
):
    """``||W + s*B@A||_row`` in fp32 without forming ``B@A`` or an fp32 copy of W.

    ``base = rowsum(W*W)`` (fp32, over column chunks of W under ``chunk_bytes``,
    unless the cached ``base_sq`` is given: fp32 ``[d_out]``), ``U = W A^T`` in
    fp32 (:func:`_u_product`: a tensor-core product with exact products and fp32
    accumulation for 16-bit W on CUDA, no fp32 copy of W), then ``cross``, ``ba`` and
    the assembly of :func:`~dora_num.numerics.formulas.norm_assembly` with a correctly
    rounded square root: one Triton launch on CUDA (:mod:`dora_num.ops.kernels.norm_tail`),
    torch operations over row blocks of ``B`` elsewhere (temporaries under
    ``ROW_CHUNK_BYTES``); all under ``no_grad`` with autocast off.  The two tails sum
    ``cross`` and ``ba`` in different orders, both within
    :func:`~dora_num.numerics.bounds.factored_norm_bound`.  ``scale == 0`` skips the
    cross and Gram terms.

    A non-finite result raises ``ValueError`` naming the input at fault.  On CUDA the check
    needs no device sync (:mod:`dora_num.ops.finite`, ``OpConfig.finite_check``; default
    ``"deferred"``: it raises at a later call of the operator or at
    :func:`~dora_num.ops.finite.check_pending`, and this call returns the non-finite norm;
    ``"sync"`` raises here); on the CPU it raises here.  ``check=False`` skips it, for callers
    that check the final ``g`` once instead; ``return_flag=True`` returns ``(wnorm, bad)``
    unchecked, ``bad`` a 0-dim device bool (true iff some ``wnorm`` is not finite).  A zero
    row gives ``wnorm = 0`` exactly; :func:`magnitude_scale` turns that into a finite ``g``.
    Where the tail runs: :func:`uses_tail_kernel`.  Products with a 16-bit W and an fp32 A:
    :func:`split_mm`.
    """
    from . import finite

    cfg = get_config()
    compiling = torch.compiler.is_compiling()
    if not compiling:
        finite.poll()
    if return_flag or compiling or not check or cfg.finite_check in ("sync", "off") or W.device.type != "cuda":
        immediate = check and not return_flag and cfg.finite_check != "off"
        wnorm = _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, immediate, cfg)
        return (wnorm, finite.any_not_finite(wnorm)) if return_flag else wnorm
    wnorm = _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, False, cfg)
    watched = finite.watch(finite.all_finite(wnorm), "factored_row_norm", cfg.finite_check, is_ok=True,
                           on_fail=lambda: _name_norm_fault(W, A, B, base_sq))
    if watched is not None:
        watched.check()
    return wnorm


def _check_base_sq(base_sq, d_out: int, device) -> None:
    check_tensor("base_sq", base_sq, ndim=1, dtypes=(torch.float32,))
    if base_sq.shape[0] != d_out or base_sq.device != device:
        raise ValueError(
            f"base_sq must be float32 [d_out] = [{d_out}] on {device}, "
            f"got shape {tuple(base_sq.shape)} on {base_sq.device}"
        )


def _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, check: bool, cfg: OpConfig) -> torch.Tensor:
    """:func:`factored_row_norm` under the configuration ``cfg``."""
    d_out, d_in, r = check_lora_factors(W, A, B)
    s_raw = check_scale(scale)
    cols = chunk_columns(d_out, d_in, chunk_bytes)
    if base_sq is not None:
        _check_base_sq(base_sq, d_out, W.device)
    with torch.no_grad(), _autocast_off(W.device.type):
        wnorm = _factored_core(W, A, B, scale_constants(s_raw), cols, chunk_bytes, base_sq, cfg)[0]
    if check and not torch.compiler.is_compiling() and not bool(torch.isfinite(wnorm).all()):
        _name_norm_fault(W, A, B, base_sq)
    return wnorm


def _name_norm_fault(W, A, B, base_sq) -> None:
    """Raise ``ValueError`` naming why a factored norm was not finite (syncs: the error path)."""
    for name, t in (("W", W), ("A", A), ("B", B)):
        check_finite(name, t)
    if base_sq is not None:
        try:
            check_finite("base_sq", base_sq)
        except ValueError as e:
            raise ValueError(f"{e} although W is finite: given corrupt, or a squared row norm of W "
                             "overflowed float32 (exceeds 3.4e38; rescale W)") from None
    raise ValueError(
        "factored row norm overflowed float32 (inputs are finite): the squared row norm "
        "exceeds 3.4e38; rescale W or the adapter"
    )


def _torch_tail_terms(U: torch.Tensor, B: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cross, ba)`` fp32 ``[d_out]`` of the torch tail: over row blocks of ``B`` (fp32 copies
    under ``ROW_CHUNK_BYTES``), ``cross = rowsum(B*U)`` and ``ba = rowsum((B G) * B)``."""
    d_out, r = B.shape
    cross = torch.empty(d_out, dtype=torch.float32, device=B.device)
    ba = torch.empty(d_out, dtype=torch.float32, device=B.device)
    rows = max(1, ROW_CHUNK_BYTES // (3 * 4 * r))
    for start in range(0, d_out, rows):
        Bc = B[start : start + rows].float()
        cross[start : start + rows] = (Bc * U[start : start + rows]).sum(dim=1)
        ba[start : start + rows] = ((Bc @ G) * Bc).sum(dim=1)
        del Bc
    return cross, ba


def _factored_core(W, A, B, consts, cols: int, chunk_bytes, base_sq, cfg: OpConfig, m=None, eps=None):
    """``(wnorm, den, bad)`` of the factored norm, unchecked (callers hold no_grad, autocast off).

    With ``m`` and the tail kernel: ``den = max(wnorm, eps)`` and ``bad``, an int32
    device flag (one entry per program of the kernel), some entry nonzero iff some
    ``wnorm`` or ``m / den`` is not finite
    (:func:`dora_num.ops.kernels.norm_tail.norm_tail`); otherwise both are None.
    """
    s, two_s, s_sq = consts
    acc_base = base_row_norm_sq(W, chunk_bytes=chunk_bytes) if base_sq is None else base_sq
    if s == 0.0:
        zeros = torch.zeros_like(acc_base)
        return norm_assembly(TorchFP32CorrectSqrt, acc_base, zeros, zeros, 0.0, 0.0), None, None
    U, G = _products(W, A, cols, cfg)
    if uses_tail_kernel(W.device, cfg):
        from .kernels.norm_tail import norm_tail

        return norm_tail(U, B, G, acc_base, two_s, s_sq, m=m, eps=eps, config=cfg)
    cross, ba = _torch_tail_terms(U, B, G)
    del U
    return norm_assembly(TorchFP32CorrectSqrt, acc_base, cross, ba, two_s, s_sq), None, None


def factored_terms(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, *,
                   chunk_bytes: int | None = None, base_sq: torch.Tensor | None = None):
    """``(base_sq, cross, ba, two_s, s_sq)``: what the factored norm's torch tail assembles.

    The fp32 ``[d_out]`` terms ``base_sq = rowsum(W*W)`` (or the given cached one),
    ``cross = rowsum(B * W A^T)``, ``ba = rowsum((B A A^T) * B)`` and the fp32 constants
    ``2s``, ``s^2`` of :func:`~dora_num.numerics.formulas.scale_constants`, computed by the
    same code and in the same order as :func:`factored_row_norm` with the torch tail
    (``OpConfig.norm_tail="torch"``), whose result is
    ``norm_assembly(TorchFP32CorrectSqrt, *factored_terms(...))`` bit for bit.  (The Triton
    tail sums ``cross`` and ``ba`` in another order, within the same bound.)  For studies
    of the assembly (notebook 02).  No gradient; inputs are not checked for finiteness.
    """
    d_out, d_in, r = check_lora_factors(W, A, B)
    s, two_s, s_sq = scale_constants(check_scale(scale))
    cols = chunk_columns(d_out, d_in, chunk_bytes)
    if base_sq is not None:
        _check_base_sq(base_sq, d_out, W.device)
    with torch.no_grad(), _autocast_off(W.device.type):
        acc_base = base_row_norm_sq(W, chunk_bytes=chunk_bytes) if base_sq is None else base_sq
        if s == 0.0:
            zeros = torch.zeros_like(acc_base)
            return acc_base, zeros, zeros.clone(), 0.0, 0.0
        U, G = _products(W, A, cols, get_config())
        cross, ba = _torch_tail_terms(U, B, G)
    return acc_base, cross, ba, two_s, s_sq


# --------------------------------------------------------------------------
# Cache of base_sq for a frozen W, and the weight norm as a custom op
# --------------------------------------------------------------------------

_CACHE_ATTR = "_dora_num_base_sq"


def cached_base_row_norm_sq(W: torch.Tensor, *, chunk_bytes: int | None = None) -> torch.Tensor:
    """``rowsum(W*W)`` (fp32), cached on the tensor ``W`` itself.

    The cache key is W's storage pointer, version counter (bumped by every
    in-place write), shape, dtype and device: any change recomputes.  Keeping
    the cache on the tensor object means it dies with W and is shared by every
    module that wraps the same frozen weight.
    """
    check_tensor("W", W, ndim=2)
    key = (W.data_ptr(), W._version, tuple(W.shape), W.dtype, W.device)
    hit = getattr(W, _CACHE_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    val = base_row_norm_sq(W.detach(), chunk_bytes=chunk_bytes)
    setattr(W, _CACHE_ATTR, (key, val))
    return val


def clear_base_sq_cache(W: torch.Tensor) -> None:
    """Drop the cached ``rowsum(W*W)`` of :func:`cached_base_row_norm_sq` from ``W`` (if any), so
    that ``W`` carries no state of this package (:func:`dora_num.peft.restore`)."""
    if hasattr(W, _CACHE_ATTR):
        delattr(W, _CACHE_ATTR)


@torch.library.custom_op("dora_num::weight_norm", mutates_args=())
def _weight_norm_op(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float,
                    chunk_bytes: int, check: bool, config: str) -> torch.Tensor:
    """``config``: the :attr:`~dora_num.ops.config.OpConfig.key` traced with the graph."""
    base_sq = cached_base_row_norm_sq(W, chunk_bytes=chunk_bytes)
    return _factored_row_norm(W, A, B, scale, chunk_bytes, base_sq, check, OpConfig.from_key(config))


@_weight_norm_op.register_fake
def _(W, A, B, scale, chunk_bytes, check, config):
    return W.new_empty((W.shape[0],), dtype=torch.float32)


def weight_norm_cached(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, *,
                       chunk_bytes: int | None = None, check: bool = True) -> torch.Tensor:
    """Factored ``||W + sBA||_row`` with the cached ``base_sq`` (detached).

    Eager: the cache lives on ``W`` itself (not on a detached alias, which is a new
    tensor object every call).  Under ``torch.compile``: the custom op
    ``dora_num::weight_norm`` (no graph break), which consults the same cache on
    the tensor it is given at run time.
    """
    return _weight_norm_cached(W, A, B, scale, chunk_bytes, check, get_config())


def _weight_norm_cached(W, A, B, scale, chunk_bytes, check: bool, cfg: OpConfig) -> torch.Tensor:
    if torch.compiler.is_compiling():
        Wd = W if not W.requires_grad else W.detach()
        cb = resolve_chunk_bytes(W.shape[0], W.shape[1], chunk_bytes)
        return _weight_norm_op(Wd, A.detach(), B.detach(), float(scale), int(cb), bool(check), cfg.key)
    base_sq = cached_base_row_norm_sq(W, chunk_bytes=chunk_bytes)
    return _factored_row_norm(W.detach(), A.detach(), B.detach(), scale, chunk_bytes, base_sq, check, cfg)


def magnitude_scale_and_flag(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, m: torch.Tensor, *,
                             chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(g, bad)``: :class:`~dora_num.ops.layer.DoRALinear`'s ``g`` and a finiteness flag,
    without a device sync.

    ``g = m / max(||W + sBA||_row, eps)`` (fp32, differentiable in ``m``; the norm
    detached, ``base_sq`` cached on W), bitwise the ``g`` of :func:`magnitude_scale`
    on :func:`weight_norm_cached` given the same ``wnorm``.  ``bad`` is a device tensor,
    nonzero iff some ``wnorm`` or ``g`` is not finite, for the caller to read once, late
    (as the layer does; ``bool(bad.any())`` syncs).  ``bad`` is None under
    ``torch.compile``, where the norm op checks ``wnorm`` and the compose op ``g`` at run
    time.  No value checks of the inputs (the flag is the check; on failure call
    :func:`magnitude_scale` on :func:`factored_row_norm` to have the input at fault
    named).  On CUDA the norm's tail, the clamp and the flag are one Triton launch
    (:mod:`dora_num.ops.kernels.norm_tail`) and ``g`` one division; where the tail runs:
    :func:`uses_tail_kernel`.
    """
    return _magnitude_scale_and_flag(W, A, B, scale, m, chunk_bytes, get_config())


def _magnitude_scale_and_flag(W, A, B, scale, m, chunk_bytes, cfg: OpConfig, with_den: bool = False,
                              trusted: bool = False):
    """``(g, bad)``, or with ``with_den`` ``(g, bad, den)``, ``den = max(wnorm, eps)`` the fp32
    ``[d_out]`` that ``g = m.float() / den`` divides by (None under ``torch.compile``).
    ``trusted``: the caller (:class:`~dora_num.ops.layer.DoRALinear`, which built W, A, B and m
    and validated them) skips the argument checks but the shapes' consistency."""
    if torch.compiler.is_compiling():  # the op checks wnorm at run time (as the flag does in eager)
        wnorm = _weight_norm_cached(W, A, B, scale, chunk_bytes, True, cfg)
        g = magnitude_scale(m, wnorm, check=False)
        return (g, None, None) if with_den else (g, None)
    if trusted and A.shape[1] == W.shape[1] and B.shape == (W.shape[0], A.shape[0]) and m.shape == W.shape[:1]:
        d_out, d_in = W.shape
    else:
        d_out, d_in, _ = check_lora_factors(W, A, B)
        check_tensor("m", m, ndim=1)
        if m.shape[0] != d_out or m.device != W.device:
            raise ValueError(f"m must be [d_out] = [{d_out}] on {W.device}, got {tuple(m.shape)} on {m.device}")
    eps = default_eps(m.dtype)
    base_sq = cached_base_row_norm_sq(W, chunk_bytes=chunk_bytes)
    tail_m = m.detach() if m.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
    with torch.no_grad(), _autocast_off(W.device.type):
        wnorm, den, bad = _factored_core(W.detach(), A.detach(), B.detach(), scale_constants(check_scale(scale)),
                                         chunk_columns(d_out, d_in, chunk_bytes), chunk_bytes, base_sq,
                                         cfg, m=tail_m, eps=eps)
    if den is None:  # the torch tail
        den = torch.clamp_min(wnorm, eps)  # formulas.magnitude_scale's maximum under TorchFP32
        g = m.float() / den  # and its division: bitwise magnitude_scale(m, wnorm, eps=eps)
        bad = ~(torch.isfinite(wnorm).all() & torch.isfinite(g.detach()).all())
        return (g, bad, den) if with_den else (g, bad)
    # den = max(wnorm, eps) is the maximum of formulas.magnitude_scale, taken (exactly) in the
    # kernel; this is its division (tests: bitwise equal to magnitude_scale(m, wnorm)).
    g = m.float() / den
    return (g, bad, den) if with_den else (g, bad)


def default_eps(dtype: torch.dtype) -> float:
    """The ``eps`` of :func:`magnitude_scale` for a magnitude of this dtype."""
    return 1e-6 if dtype in (torch.float16, torch.bfloat16) else 1e-12


def magnitude_scale(m: torch.Tensor, wnorm: torch.Tensor, *, eps: float | None = None,
                    check: bool = True) -> torch.Tensor:
    """``g = m / max(wnorm, eps)`` in fp32 (differentiable in ``m``; ``wnorm`` detached).

    ``eps`` defaults by the dtype of ``m``: ``1e-12`` for fp32/fp64 (as
    ``torch.nn.functional.normalize``), ``1e-6`` for bf16/fp16 magnitudes.  A row
    with ``wnorm = 0`` (an all-zero row of ``W + sBA``, where PEFT divides by
    zero) thus gets the finite ``g = m / eps``; at DoRA init such a row has
    ``m = 0`` and so ``g = 0``.
    """
    check_tensor("m", m, ndim=1)
    check_tensor("wnorm", wnorm, ndim=1, dtypes=(torch.float32, torch.float64))
    if m.shape != wnorm.shape:
        raise ValueError(f"m has shape {tuple(m.shape)} but wnorm has {tuple(wnorm.shape)}")
    if m.device != wnorm.device:
        raise ValueError(f"m is on {m.device} but wnorm on {wnorm.device}")
    if eps is None:
        eps = default_eps(m.dtype)
    if not (eps > 0):
        raise ValueError(f"eps must be positive, got {eps}")
    if check and not torch.compiler.is_compiling():  # value checks sync; skipped while tracing
        check_finite("m", m.detach())
        check_finite("wnorm", wnorm)
    return formulas.magnitude_scale(TorchFP32, m.float(), wnorm.detach().float(), eps)
