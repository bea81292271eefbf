"""The products ``U = W A^T`` and ``G = A A^T`` of the factored row norm
(:mod:`dora_num.ops.norm`), and the error model they follow (:func:`product_model`).

16-bit W on CUDA: tensor-core products (exact products, fp32 accumulation), directly when A has
W's dtype, through the exact split of A into 16-bit pieces otherwise (fp32 adapters, as PEFT keeps
them: :func:`split_pieces`, :func:`split_mm`; bounds in :mod:`dora_num.numerics.split_products`).
Elsewhere fp32 GEMMs while they are IEEE fp32; where torch's switches make them TF32 (CUDA:
``allow_tf32``, ``set_float32_matmul_precision("high")``) or bf16 (oneDNN on the CPU under
``"medium"``), float64 accumulation over column chunks, rounded once to fp32.  So those switches
never change ``U`` or ``G`` unnoticed: :func:`product_model` names the route and the bounds follow
it; :func:`fp32_matmul_precision` reads the switches (also for the dense norm's and the torch
tail's own fp32 GEMMs).  Also the two things every pass over W shares: its fp32 column chunks under a
byte budget (:func:`chunk_columns`) and autocast switched off (:func:`autocast_off`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ..numerics import split_products as _SP
from ..numerics.standard_model import tc_blocks
from .config import OpConfig, get_config

_MM_OUT_DTYPE_OK: dict = {}  # (device type, index, dtype) -> whether torch.mm(..., out_dtype=fp32) runs there
SPLIT_DTYPES = (torch.bfloat16, torch.float16)
# fp16 pieces: A is scaled by 2^k so that max|A| 2^k lies in [2^14, 2^15) (the first piece then
# cannot overflow fp16's 65504), k clamped to [-126, 126] so that 2^k and 2^-k are normal fp32.
_FP16_TOP = 15
_K_LIMIT = 126
# G's float64 accumulation reads A in column chunks of at most this many bytes (float64): r = 384 at
# d_in = 28,672 is 88 MB in one piece, 8 chunks of 11 MB here
_GRAM_CHUNK_BYTES = 16 * 2**20
CHUNK_ALIGN = 64  # columns; chunk widths are multiples of this (coalesced, tensor-core friendly)
DEFAULT_CHUNK_BYTES = 256 * 2**20


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


def autocast_off(device_type: str):
    """Autocast off for ``device_type`` where it is on, else a no-op (constructing a
    ``torch.autocast`` context costs ~4-10 us of Python on the hot path; while tracing,
    ``torch.autocast`` itself).  Every pass of the factored norm over W, A, B runs under it."""
    if torch.is_autocast_enabled(device_type):
        if torch.compiler.is_compiling():
            return torch.autocast(device_type, enabled=False)
        return _AutocastDisabled(device_type)
    return contextlib.nullcontext()


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


class ProductModel(NamedTuple):
    """How the factored norm forms ``U`` and ``G`` on given inputs (:func:`product_model`): the
    error model of lemma 4 and 4' (docs/bounds.md).  ``u``: ``"fp64"`` (float64 accumulation,
    one rounding to fp32), ``"tensor_core"`` (16-bit W and A of one dtype, exact products, an fp32
    accumulator charged ``2u`` per addition with flushed partial sums), ``"split"`` (A split into
    ``pieces`` pieces of ``split_format``, tensor-core products of those).  ``G`` is float64-accumulated
    in every model."""

    u: str
    pieces: int | None = None
    split_format: str = "bf16"

    @property
    def label(self) -> str:
        """The model in words, for reports."""
        if self.u == "fp64":
            return "U, G: float64 accumulation, rounded once to fp32"
        if self.u == "fp32":
            return "U, G: IEEE fp32 GEMMs (TF32 and bf16 GEMMs off), any order"
        if self.u == "tensor_core":
            return f"U, G: tensor cores ({self.split_format} products exact, fp32 accumulation, 2u per addition)"
        return (f"U, G: A split into {self.pieces} {self.split_format} pieces, tensor cores (fp32 accumulation, "
                "2u per addition)")


def product_model(W: torch.Tensor, A: torch.Tensor, cfg: OpConfig | None = None) -> ProductModel:
    """The :class:`ProductModel` :func:`_products` follows for ``W``, ``A`` under ``cfg`` (default
    :func:`~dora_num.ops.config.get_config`) and torch's current matmul switches: the single place
    where the route is chosen.  16-bit W on CUDA: ``"tensor_core"`` (A of W's dtype) or ``"split"``;
    otherwise ``"fp32"`` while :func:`fp32_matmul_precision` is ``"ieee"`` on W's device, and
    ``"fp64"`` where TF32 or bf16 GEMMs are switched on (the fp32 GEMM would no longer be one)."""
    cfg = get_config() if cfg is None else cfg
    fmt = "fp16" if W.dtype == torch.float16 else "bf16"
    if takes_w_whole(W):
        if A.dtype == W.dtype:
            return ProductModel("tensor_core", None, fmt)
        return ProductModel("split", int(cfg.split_pieces), fmt)
    if fp32_matmul_precision(W.device.type) == "ieee":
        return ProductModel("fp32")
    return ProductModel("fp64")


def takes_w_whole(W: torch.Tensor) -> bool:
    """Whether :func:`product_model` takes a tensor-core route for ``W`` (``"tensor_core"`` or ``"split"``: a
    16-bit W on CUDA where ``torch.mm`` gives an fp32 output), whose products take W whole.  Decided from
    W's device, its dtype and the probe alone, so that TorchDynamo can trace it (a traced op asks it): the
    routes of any other W read torch's matmul-precision switches, whose getters Dynamo cannot trace."""
    return W.device.type == "cuda" and W.dtype in SPLIT_DTYPES and _tensor_core_fp32_out(W.dtype, W.device.index or 0)


def fp32_matmul_precision(device_type: str) -> str:
    """What an fp32 GEMM on ``device_type`` computes under torch's current switches: ``"ieee"``
    (fp32 products), ``"tf32"`` (inputs rounded to 10 fraction bits) or ``"bf16"`` (inputs rounded to
    bf16: oneDNN on the CPU under ``set_float32_matmul_precision("medium")``).  Reads the
    per-backend settings (``torch.backends.cuda.matmul.fp32_precision``,
    ``torch.backends.mkldnn.matmul.fp32_precision``, ``allow_tf32``), never
    ``torch.get_float32_matmul_precision()``, which raises once the legacy and new APIs are mixed."""
    b = torch.backends
    if device_type == "cuda":
        p = str(getattr(b.cuda.matmul, "fp32_precision", "none"))
        if p == "none":
            p = str(getattr(b, "fp32_precision", "none"))
        return "tf32" if (p == "tf32" or bool(b.cuda.matmul.allow_tf32)) else "ieee"
    mk = getattr(b, "mkldnn", None)
    p = str(getattr(getattr(mk, "matmul", None), "fp32_precision", "none")) if mk is not None else "none"
    if p == "none":
        p = str(getattr(mk, "fp32_precision", "none")) if mk is not None else "none"
    if p == "none":
        p = str(getattr(b, "fp32_precision", "none"))
    return p if p in ("tf32", "bf16") else "ieee"


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` with fp32 accumulation and fp32 output for 16-bit CUDA inputs, or None
    where this torch has no such kernel (probed once per device and dtype: two cards of one host may differ)."""
    key = (a.device.type, a.device.index or 0, a.dtype)
    if a.device.type != "cuda" or _MM_OUT_DTYPE_OK.get(key) is False:
        return None
    try:
        out = torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        _MM_OUT_DTYPE_OK[key] = False
        return None
    _MM_OUT_DTYPE_OK[key] = True
    return out


def split_pieces(A: torch.Tensor, dtype: torch.dtype, pieces: int, traced: bool = False,
                 cfg: OpConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    exact emulation the bound and the tests use.  ``traced`` (the body of a traced op on CUDA): the pieces
    come from one Triton launch, :func:`dora_num.ops.kernels.products.split_cuda` (the same values: each
    step is exact or correctly rounded), because Inductor, compiling these steps as torch operations, drops
    the cast and upcast pair and so every later piece.
    """
    if dtype not in SPLIT_DTYPES:
        raise ValueError(f"split_pieces: dtype must be bfloat16 or float16, got {dtype}")
    if pieces not in (2, 3):
        raise ValueError(f"split_pieces: pieces must be 2 or 3, got {pieces!r}")
    R = A.float()
    scale = inv = None
    if dtype == torch.float16:
        k = (_FP16_TOP - _frexp_exponent(R.abs().amax())).clamp(-_K_LIMIT, _K_LIMIT).to(torch.int32)
        scale, inv = _pow2(k), _pow2(-k)
    if traced:  # a compiled graph's split: one Triton launch (the same values)
        from .kernels.products import split_cuda

        return split_cuda(A, dtype, pieces, scale, config=cfg, traced=True), inv
    if scale is not None:
        R = R * scale
    P = torch.empty((pieces,) + tuple(A.shape), dtype=dtype, device=A.device)
    for p in range(pieces):
        P[p].copy_(R)  # round to nearest even
        if p + 1 < pieces:
            R = torch.sub(R, P[p])  # fp32 (type promotion upcasts P[p] exactly): exact
    return P, inv


def _frexp_exponent(x: torch.Tensor) -> torch.Tensor:
    """int32 ``e`` with ``x < 2^e`` for a 0-dim fp32 ``x >= 0``: ``torch.frexp(x).exponent`` for normal ``x``
    and for ``0`` (``e = 0``), and ``-126`` for a subnormal ``x`` (frexp's is lower; :func:`split_pieces`
    clamps ``15 - e`` to 126 either way).  From the bits: in a compiled graph Inductor lowers ``frexp`` to
    libdevice's ``ilogb``, linked with FTZ, which takes a subnormal for zero."""
    e = (x.view(torch.int32) >> 23) - 126
    return torch.where(x == 0, torch.zeros_like(e), e)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` as fp32 for an int32 device tensor ``k`` in ``[-126, 127]``, built from its exponent
    bits (exact; ``torch.ldexp`` goes through ``pow``, which need not be)."""
    return ((k + 127) << 23).view(torch.float32)


def _mm_cpu_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit operands in fp32 (their products are exact in fp32; CPU and tests)."""
    return a.float() @ b.float()


def _mm32_once(a: torch.Tensor, b: torch.Tensor, mm=None) -> torch.Tensor:
    if mm is not None:
        return mm(a, b)
    out = _mm_fp32_out(a, b)
    return _mm_cpu_fp32(a, b) if out is None else out


def tensor_core_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit operands with fp32 output exactly as the factored norm forms one block of ``U`` or
    ``G`` (``torch.mm(a, b, out_dtype=float32)`` on CUDA): the product the accumulation probe
    (:func:`dora_num.numerics.accumulation.run_probes`) measures."""
    return _mm32_once(a, b)


class TensorCoreGemm(NamedTuple):
    """One tensor-core GEMM of the factored norm: ``product`` (``"U"``, ``"G"``, ``"U split"``, ``"G split"``:
    the labels of the accumulation probe's records), the 16-bit format, ``a [M, K] @ b [K, N]`` and the
    row stride ``lead`` of ``a`` and of ``b``'s transpose (``d_in``: a column block of W, A or the split's
    pieces)."""

    product: str
    fmt: str
    M: int
    N: int
    K: int
    lead: int

    @property
    def label(self) -> str:
        return f"{self.fmt} {self.product} [{self.M} x {self.K}] @ [{self.K} x {self.N}]"


def tensor_core_gemms(W: torch.Tensor, A: torch.Tensor, model: ProductModel) -> list[TensorCoreGemm]:
    """The distinct tensor-core GEMMs :func:`_products` runs for ``W [d_out, d_in]``, ``A [r, d_in]`` under
    ``model`` (none for the ``"fp32"`` and ``"fp64"`` routes): ``U`` through :func:`_mm32` (``W A^T``; the
    split: ``W S^T`` with ``S`` the ``pieces r`` rows of A's pieces), ``G`` likewise (``A A^T``, ``S S^T``),
    each in the column blocks of :func:`~dora_num.numerics.standard_model.tc_blocks`."""
    if model.u not in ("tensor_core", "split"):
        return []
    d_out, d = W.shape
    n = A.shape[0] * (model.pieces if model.u == "split" else 1)
    tag = " split" if model.u == "split" else ""
    ks = sorted({b1 - b0 for b0, b1 in tc_blocks(d)}, reverse=True)
    return [TensorCoreGemm(p + tag, model.split_format, m, n, k, d) for p, m in (("U", d_out), ("G", n)) for k in ks]


def _mm32(a: torch.Tensor, b: torch.Tensor, mm=None) -> torch.Tensor:
    """``a @ b`` of 16-bit operands with fp32 output: ``mm`` if given (the tests' tensor-core
    emulation), else the tensor-core product (:func:`_mm_fp32_out`), else fp32 products.  Over an inner
    dimension longer than ``TC_BLOCK_K`` in column blocks (``numerics.standard_model.tc_blocks``), each a
    fresh product added in sequence: the accumulation charge of lemma 4 is then per block
    (``tc_additions``).  Extra memory beyond one block: one product of the output's shape."""
    blocks = tc_blocks(a.shape[1])
    if len(blocks) == 1:
        return _mm32_once(a, b, mm)
    out = None
    for b0, b1 in blocks:
        part = _mm32_once(a[:, b0:b1], b[b0:b1], mm)
        out = part if out is None else out.add_(part)
    return out


def block_sum(src: torch.Tensor, n_rows: int, n_cols: int, pa: int, pb: int, traced: bool = False,
              cfg: OpConfig | None = None) -> torch.Tensor:
    """fp32 ``[n_rows, n_cols]``: the ``pa x pb`` blocks of ``src`` (``[pa n_rows, pb n_cols]``) added in
    row-major block order, one fp32 rounding per addition: the Triton kernel of
    :mod:`dora_num.ops.kernels.products` on CUDA (``traced``: launched by Inductor), elsewhere torch's
    additions in the same order (the same bits).  A fixed order, so that a compiled graph (whose own
    reduction would order the blocks otherwise) forms the eager bits."""
    cfg = get_config() if cfg is None else cfg
    if src.device.type == "cuda" and not cfg.interpret:
        from .kernels.products import block_sum_cuda

        return block_sum_cuda(src if src.is_contiguous() else src.contiguous(), n_rows, n_cols, pa, pb,
                              config=cfg, traced=traced)
    out = None
    for a in range(pa):
        for b in range(pb):
            blk = src[a * n_rows:(a + 1) * n_rows, b * n_cols:(b + 1) * n_cols]
            out = blk.clone() if out is None else out + blk
    return out


def split_mm(W: torch.Tensor, A: torch.Tensor, pieces: int, mm=None, split=None, traced: bool = False,
             cfg: OpConfig | None = None) -> torch.Tensor:
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
    ``(P, inv)`` of :func:`split_pieces` if already computed (shared with :func:`split_gram`).  The
    blocks are added in order (:func:`block_sum`; ``traced``: the kernel launched by Inductor).
    """
    P, inv = split_pieces(A, W.dtype, pieces) if split is None else split
    p, r, d = P.shape
    S = P.view(p * r, d)
    U = block_sum(_mm32(W, S.T, mm), W.shape[0], r, 1, p, traced, cfg)
    return U if inv is None else U.mul_(inv)


def split_gram(A: torch.Tensor, dtype: torch.dtype, pieces: int, mm=None, split=None,
               traced: bool = False, cfg: OpConfig | None = None) -> torch.Tensor:
    r"""``G = A A^T`` fp32 ``[r, r]`` from tensor-core products only: with ``S = [P_1; ...; P_p]``
    (:func:`split_pieces` in ``dtype``), ``S S^T`` (fp32 accumulation and output,
    ``[p r, p r]``) and its ``p^2`` blocks summed in fp32 (then scaled by ``inv`` twice).
    ``|G^ - G| <= gamma_{2 d + p^2 - 1} |S~||S~|^T + res |A~|^T + |A~| res^T + res res^T``
    with ``S~ = inv sum_p |P_p|`` and ``A~ = inv sum_p P_p``
    (:func:`dora_num.numerics.split_products.split_gram_error`).  Independent of torch's TF32
    switches (an fp32 ``A @ A.T`` is not, under ``allow_tf32``).  ``mm``, ``split``, ``traced``: as
    :func:`split_mm`."""
    P, inv = split_pieces(A, dtype, pieces) if split is None else split
    p, r, d = P.shape
    S = P.view(p * r, d)
    G = block_sum(_mm32(S, S.T, mm), r, r, p, p, traced, cfg)
    return G if inv is None else G.mul_(inv).mul_(inv)


# the bf16 pieces of B and G in split_bg, by B's dtype: numerics.split_products.BG_PIECES and G_PIECES
BG_PIECES = {dt: _SP.BG_PIECES[name] for dt, name in ((torch.float32, "fp32"), (torch.float16, "fp16"),
                                                      (torch.bfloat16, "bf16"))}


def split_bg(B: torch.Tensor, G: torch.Tensor, mm=None, traced: bool = False,
             cfg: OpConfig | None = None) -> torch.Tensor:
    r"""``B G`` fp32 ``[d_out, r]`` (the norm tail's product, ``ba = rowsum((B G) * B)``) from tensor-core
    products only: ``B`` in ``pB`` bf16 pieces (:data:`BG_PIECES`: 3 for fp32, 2 for fp16, 1 for bf16: every
    fp16 and bf16 value exactly, fp32 values of at least ``2^-110``), the fp32 ``G`` in 3 (:func:`split_pieces`),
    one product
    ``[PB_1 ... PB_pB] R`` with ``R``'s block ``(p, q)`` the piece ``PG_q`` (``[d_out, pB r] @ [pB r, 3 r]``,
    fp32 accumulation and output), then its three column blocks summed in order (:func:`block_sum`).  Every
    element product is exact in fp32 (8 + 8 significand bits), so the error is the accumulation of
    ``pB r`` products and two block sums, ``gamma_{tc_additions(pB r) + 2}`` of ``sum |PB| sum |PG|``, plus
    what the split left (fp32 values below ``2^-110``) and flushed subnormals
    (:func:`dora_num.numerics.split_products.split_bg_error`).  The right operand is passed as the
    transpose of a row-major ``[3 r, pB r]`` matrix, the layout of ``U``'s and ``G``'s products.  ``mm``,
    ``traced``, ``cfg``: as :func:`split_mm`.  Extra memory: ``d_out * 3 r * 4`` bytes and the pieces."""
    if B.dim() != 2 or G.shape != (B.shape[1], B.shape[1]):
        raise ValueError(f"split_bg: B must be [d_out, r] and G [r, r], got {tuple(B.shape)} and {tuple(G.shape)}")
    if B.dtype not in BG_PIECES or G.dtype != torch.float32:
        raise ValueError(f"split_bg: B must be fp32, fp16 or bf16 and G fp32, got {B.dtype} and {G.dtype}")
    d_out, r = B.shape
    pB = BG_PIECES[B.dtype]
    PB = B[None] if pB == 1 else split_pieces(B, torch.bfloat16, pB, traced, cfg)[0]
    pG = _SP.G_PIECES
    PG = split_pieces(G, torch.bfloat16, pG, traced, cfg)[0]
    left = PB.permute(1, 0, 2).reshape(d_out, pB * r)  # [B_1 ... B_pB]
    right_t = PG.transpose(1, 2).repeat(1, 1, pB).reshape(pG * r, pB * r)  # row q r + l, column p r + k: PG_q[k, l]
    return block_sum(_mm32(left, right_t.T, mm), d_out, r, 1, pG, traced, cfg)


def clear_mm_probes() -> None:
    """Forget which dtypes :func:`_tensor_core_fp32_out` has probed, as in a fresh process (the next use
    of each probes again; the answers cannot change within a process, so this only reopens the path a
    first probe takes)."""
    _MM_OUT_DTYPE_OK.clear()


@torch._dynamo.assume_constant_result
def _tensor_core_fp32_out(dtype: torch.dtype, index: int = 0) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` runs for ``dtype`` on CUDA device ``index`` (probed once
    per device, on a one-element product).  A constant to TorchDynamo, which runs it when it traces: a probe that
    first ran while tracing would otherwise fail the guard on the probes' dict that the same trace
    installed (measured: fp16 W compiled before any eager call, "Guard failed on the same frame")."""
    key = ("cuda", index, dtype)
    if key not in _MM_OUT_DTYPE_OK:
        one = torch.ones(1, 1, dtype=dtype, device=torch.device("cuda", index))
        _mm_fp32_out(one, one)
    return bool(_MM_OUT_DTYPE_OK.get(key))


def _chunked_fp64(X: torch.Tensor, Y: torch.Tensor, cols: int) -> torch.Tensor:
    """``X Y^T`` fp32 ``[m, n]``: float64 products of column chunks (``cols`` wide) of ``X`` and ``Y``
    (any float dtypes; every 16/32-bit product is exact in float64), accumulated in float64 and
    rounded once to fp32.  Each chunk product is formed fresh and added to the accumulator, so a
    product passes through at most ``d - 1 + ceil(d / cols)`` float64 additions (charged
    ``gamma64_{2d}``).  No fp32 GEMM: TF32 and bf16 matmul switches do not apply."""
    d = X.shape[1]
    acc = torch.zeros(X.shape[0], Y.shape[0], dtype=torch.float64, device=X.device)
    for start in range(0, d, cols):
        acc += X[:, start : start + cols].double() @ Y[:, start : start + cols].double().T
    return acc.float()


def _u_product(W: torch.Tensor, A: torch.Tensor, cols: int | None, pieces: int = 3,
               model: ProductModel | None = None):
    """``U = W A^T`` fp32 ``[d_out, r]`` by the route of ``model`` (:func:`product_model`), without
    an fp32 copy of W where possible.

    - ``"tensor_core"`` (W, A of one 16-bit dtype on CUDA): one product with fp32 accumulation and
      fp32 output (``torch.mm(..., out_dtype=float32)``); each ``W_jk A_ik`` is exact in fp32 (8+8 or
      11+11 significand bits), so the only error is the accumulation, ``gamma_{2 d_in}`` (``2u`` per
      addition covers an accumulator that truncates; in column blocks beyond ``d_in = TC_BLOCK_K``,
      :func:`_mm32`).  Extra memory: U itself (and one block product beyond ``TC_BLOCK_K``).
    - ``"split"`` (16-bit W on CUDA, A of another dtype): :func:`split_mm`, ``pieces`` tensor-core
      products.  Extra memory: ``d_out * pieces * r * 4`` bytes and the pieces of A.
    - ``"fp32"`` (IEEE fp32 GEMMs): W and A fp32, one product (no copy); otherwise fp32 column chunks
      of W under the byte budget (``cols``), accumulated with ``addmm_``: ``gamma_{d_in}``.
    - ``"fp64"`` (TF32 or bf16 GEMMs switched on): :func:`_chunked_fp64`, ``u + gamma64_{2 d_in}``.
    """
    model = product_model(W, A) if model is None else model
    if model.u == "tensor_core":
        return _mm32(W, A.T)
    if model.u == "split":
        return split_mm(W, A, pieces)
    if model.u == "fp32" and W.dtype == torch.float32 and A.dtype == torch.float32:
        return W @ A.T
    if cols is None:  # the remaining routes chunk W: a traced body (cols None) never reaches them
        raise ValueError(f"U by the {model.u!r} route is formed over column chunks of W: cols is required")
    if model.u == "fp64":
        return _chunked_fp64(W, A, cols)
    U = torch.zeros(W.shape[0], A.shape[0], dtype=torch.float32, device=W.device)
    for start in range(0, W.shape[1], cols):
        U.addmm_(W[:, start : start + cols].float(), A[:, start : start + cols].float().T)
    return U


class Products(NamedTuple):
    """What :func:`_products` returns: ``U``, ``G`` (fp32) and how they were formed."""

    U: torch.Tensor
    G: torch.Tensor
    pieces: int | None  # the split's piece count, None without the split
    inv: torch.Tensor | None  # fp16 pieces: the split's run-time scale 2^-k (0-dim fp32)
    model: ProductModel | None = None


def _products(W: torch.Tensor, A: torch.Tensor, cols: int | None, cfg: OpConfig, traced: bool = False) -> Products:
    """:class:`Products` of the factored norm by the route of :func:`product_model` (``U``:
    :func:`_u_product`; ``G``: :func:`_gram` by the same route, the split's pieces shared).  ``cols``: the
    column chunk's width, None where the route takes W whole (:func:`takes_w_whole`).  ``traced``:
    the body of a traced op (:mod:`dora_num.ops.weight_norm`), whose kernels Inductor launches."""
    model = product_model(W, A, cfg)
    if model.u == "split":
        pieces = split_pieces(A, W.dtype, model.pieces, traced, cfg)  # once, for both products
        return Products(split_mm(W, A, model.pieces, split=pieces, traced=traced, cfg=cfg),
                        split_gram(A, W.dtype, model.pieces, split=pieces, traced=traced, cfg=cfg), model.pieces, pieces[1],
                        model)
    return Products(_u_product(W, A, cols, model=model), _gram(A, model), None, None, model)


def _gram(A: torch.Tensor, model: ProductModel) -> torch.Tensor:
    """``G = A A^T`` fp32 ``[r, r]`` by the route of ``model``: the tensor-core product of 16-bit A,
    an fp32 GEMM (``"fp32"``), or float64 accumulation over column chunks of A rounded once
    (``"fp64"``; chunks of at most ``_GRAM_CHUNK_BYTES``)."""
    if model.u == "tensor_core":
        return _mm32(A, A.T)
    if model.u == "fp64":
        r, d = A.shape
        return _chunked_fp64(A, A, max(1, min(d, _GRAM_CHUNK_BYTES // (8 * max(r, 1)))))
    Af = A.float()
    return Af @ Af.T


def factored_products(W: torch.Tensor, A: torch.Tensor, *, chunk_bytes: int | None = None,
                      cfg: OpConfig | None = None) -> Products:
    """The :class:`Products` (``U``, ``G``, the split's pieces and ``inv``, the model) the factored norm
    forms for ``W``, ``A`` (the same call as :func:`dora_num.ops.norm.factored_row_norm`'s; for studies and
    the reviewer's kit, which re-derive the guard's decision from them).  No gradient, autocast off."""
    cfg = get_config() if cfg is None else cfg
    with torch.no_grad(), autocast_off(W.device.type):
        return _products(W, A, chunk_columns(W.shape[0], W.shape[1], chunk_bytes), cfg)
