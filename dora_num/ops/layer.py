"""``DoRALinear``: a frozen ``nn.Linear`` with a DoRA adapter.

``y = x W^T + b + delta``, ``delta = (g-1) (x W^T) + g s (x A^T B^T)``, ``g = m / ||W + s B A||_row``
with the norm detached (``m / eps`` only on a zero row).  PEFT's initialisation (``B = 0``, ``m`` the
layer's own norm), so ``g == 1`` exactly at init and the layer is bitwise its base layer, bias or not.
The norm is the cached factored one with its cancellation guard (:mod:`dora_num.ops.weight_norm`: one
Triton launch and a flag read late on CUDA; under ``torch.compile`` a custom op whose only state is
the layer's buffers); the compose is :mod:`dora_num.ops.compose`, in training one node with the up-projection that keeps ``x A^T``
instead of ``lora`` (:mod:`dora_num.ops.lora_compose`).  Adapters keep their dtype (fp32 by default,
as PEFT keeps them); under autocast the products run in the autocast dtype and the compose in fp32.
Seams (``norm=``, ``compose_fn=``, ``forward(x, g=..., base_out=...)``), the dtype rules, the PEFT
drop-in and merging in full: docs/operator.md.  :func:`check_flags` reads what compiled forwards
flagged.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as Fn
from torch import nn

from ..numerics.formulas import scale_constants
from . import finite as _finite
from .compose import PATHS, _compose, _select_tier, count_tier
from .lora_compose import lora_compose, lora_dtype
from .config import OpConfig, get_config, override
from . import guard as _guard
from .guard import CancellationWarning, check_on_cancellation
from .magnitude import initial_magnitude, magnitude_div, magnitude_scale
from .norm import _factored_row_norm, clear_base_cache, dense_row_norm, uses_tail_kernel
from .weight_norm import (_flag_not_finite_op, _magnitude_scale_and_flag, _weight_norm_cached,
                          cached_base_row_norm_sq, new_flag, weight_den)
from .validation import check_tensor

NORMS = ("cached", "factored", "dense")
ADAPTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MERGE_ROW_BYTES = 64 * 2**20  # fp32 temporaries of one row block of W + sBA in merged_weight()


def _as_dtype(t: torch.Tensor, dtype: torch.dtype, cast: bool) -> torch.Tensor:
    """``t`` in ``dtype`` when ``cast`` (autocast off); under autocast F.linear casts itself."""
    return t.to(dtype) if cast and t.dtype != dtype else t


def _adapter_param(name: str, t, shape: tuple, device) -> nn.Parameter:
    """A given adapter tensor as a parameter: the same object if it is one (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or nn.Parameter, got {type(t).__name__}")
    if t.dtype not in ADAPTER_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; adapters must be one of "
                        + ", ".join(str(d).removeprefix("torch.") for d in ADAPTER_DTYPES))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; the layer needs {list(shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the base weight is on {device}")
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t)


class DoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float | None = None,
        *,
        use_rslora: bool = False,
        lora_dropout: float = 0.0,
        compose_path: str = "auto",
        chunk_bytes: int | None = None,
        norm: str = "cached",
        compose_fn=None,
        adapter_dtype: torch.dtype | None = torch.float32,
        lora_A: torch.Tensor | None = None,
        lora_B: torch.Tensor | None = None,
        magnitude: torch.Tensor | None = None,
        on_cancellation: str = "recompute",
    ):
        """``adapter_dtype``: dtype of freshly initialised ``A``, ``B``, ``m`` (None: ``A`` and ``B``
        in W's dtype and ``m`` in float32, the layout of the project's recorded studies: ``m``
        enters the fp32 ``g`` and is kept fp32 like the norm).
        ``lora_A``, ``lora_B``, ``magnitude``: given adapter tensors, all three or none, used as
        they are (an ``nn.Parameter`` is kept as the same object; dtypes kept; shapes
        ``[rank, in]``, ``[out, rank]``, ``[out]`` on W's device)."""
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if compose_path not in PATHS:
            raise ValueError(f"compose_path must be one of {PATHS}, got {compose_path!r}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if compose_fn is not None and not callable(compose_fn):
            raise TypeError(f"compose_fn must be callable, got {type(compose_fn).__name__}")
        given = [t is not None for t in (lora_A, lora_B, magnitude)]
        if any(given) and not all(given):
            raise ValueError("lora_A, lora_B and magnitude are given together or not at all")
        m_dtype = torch.float32 if adapter_dtype is None else adapter_dtype
        if adapter_dtype is None:
            adapter_dtype = base.weight.dtype
        if adapter_dtype not in ADAPTER_DTYPES:
            raise TypeError(f"adapter_dtype must be one of "
                            + ", ".join(str(d).removeprefix("torch.") for d in ADAPTER_DTYPES)
                            + f", got {adapter_dtype!r}")
        alpha = float(rank if alpha is None else alpha)
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.rank = rank
        self.alpha = alpha
        self.use_rslora = bool(use_rslora)
        self.scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        self.compose_path = compose_path
        self.chunk_bytes = chunk_bytes
        self.norm = norm
        self.compose_fn = compose_fn
        self._unmerged_weight: torch.Tensor | None = None  # the original W while merged
        self.on_cancellation = check_on_cancellation(on_cancellation)
        self._warned_cancellation = False  # on_cancellation="warn": once per layer
        self._warned_many = False  # the guard recomputing many rows: once per layer
        self.name: str | None = None  # the module path in the model (set by wrap / accelerate), for messages
        self._forwards = 0  # forward calls outside a backward pass: the step a non-finite error names
        W = base.weight
        self.dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        # the running flag a compiled forward raises (finiteness, the guard); check_flags reads it
        self.register_buffer("_flags", new_flag(W.device), persistent=False)
        self._new_base_cache()
        if all(given):
            self.lora_A = _adapter_param("lora_A", lora_A, (rank, base.in_features), W.device)
            self.lora_B = _adapter_param("lora_B", lora_B, (base.out_features, rank), W.device)
            self.magnitude = _adapter_param("magnitude", magnitude, (base.out_features,), W.device)
            return
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=adapter_dtype, device=W.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=adapter_dtype, device=W.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        # m = the denominator of g from the very norm the forward recomputes: g == 1 exactly at init
        self.magnitude = nn.Parameter(initial_magnitude(self.weight_norm(), dtype=m_dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float | None = None, **kwargs) -> "DoRALinear":
        """Wrap ``linear`` (kept, frozen) with a freshly initialised DoRA adapter."""
        return cls(linear, rank, alpha, **kwargs)

    @classmethod
    def from_peft(cls, layer: nn.Module, adapter: str = "default", **kwargs) -> "DoRALinear":
        """A layer on adapter ``adapter`` of a PEFT DoRA ``lora.Linear``, sharing its parameters.

        ``base`` is PEFT's base ``nn.Linear``, ``lora_A``/``lora_B``/``magnitude`` are PEFT's
        own ``nn.Parameter`` objects (not copies: an optimizer step on either is seen by
        both), ``dropout`` is PEFT's dropout module of that adapter (its train/eval mode
        follows the PEFT model) and ``scale`` PEFT's ``scaling[adapter]``.  The
        ``requires_grad`` flags are left as PEFT set them.  The returned module is not
        registered anywhere (PEFT's state dict is unchanged).  Which PEFT layers can be
        served at all: :func:`dora_num.peft.unsupported_reason`.
        """
        try:
            base = layer.get_base_layer()
            A = layer.lora_A[adapter].weight
            B = layer.lora_B[adapter].weight
            m = layer.lora_magnitude_vector[adapter].weight
            r, alpha, rslora = layer.r[adapter], layer.lora_alpha[adapter], layer.use_rslora.get(adapter, False)
            dropout, scale = layer.lora_dropout[adapter], layer.scaling[adapter]
        except (AttributeError, KeyError, TypeError) as e:
            raise TypeError(f"{type(layer).__name__} is not a PEFT DoRA Linear with adapter {adapter!r} "
                            f"({type(e).__name__}: {e})") from None
        flags = [p.requires_grad for p in base.parameters()]
        obj = cls(base, int(r), float(alpha), use_rslora=bool(rslora), lora_A=A, lora_B=B, magnitude=m, **kwargs)
        for p, f in zip(base.parameters(), flags):
            p.requires_grad_(f)
        obj.dropout = dropout
        obj.scale = float(scale)
        return obj

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def _new_base_cache(self) -> None:
        """Fresh (stale) buffers for the compiled forward's cache of ``rowsum(W*W)`` and W's zero rows
        (``_base_sq``, ``_zero_rows``: op inputs of ``dora_num::weight_den``, formed again inside it only
        when W changed, :func:`~dora_num.ops.norm.refresh_base_cache`); not in the state dict."""
        W = self.base.weight
        self.register_buffer("_base_sq", torch.empty(W.shape[0], dtype=torch.float32, device=W.device),
                             persistent=False)
        self.register_buffer("_zero_rows", torch.empty(W.shape[0], dtype=torch.bool, device=W.device),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda(): the cache would follow W's move as a converted copy (.half() would
        # even make it fp16); start it again on W's device instead
        super()._apply(fn, recurse)
        if "_base_sq" in self._buffers:
            self._new_base_cache()
        return self

    def base_sq(self) -> torch.Tensor:
        """Cached ``rowsum(W*W)`` (fp32), recomputed if W changed
        (:func:`~dora_num.ops.weight_norm.cached_base_row_norm_sq`: the cache lives on W)."""
        return cached_base_row_norm_sq(self.base.weight, chunk_bytes=self.chunk_bytes)

    def _row_norm(self, cfg: OpConfig, check: bool) -> torch.Tensor:
        W, A, B = self.base.weight, self.lora_A, self.lora_B
        if self.norm == "cached":
            return _weight_norm_cached(W, A, B, self.scale, self.chunk_bytes, check, cfg, self.on_cancellation)
        if self.norm == "factored":
            return _factored_row_norm(W.detach(), A.detach(), B.detach(), self.scale, self.chunk_bytes, None,
                                      check, cfg, self.on_cancellation)
        return dense_row_norm(W.detach(), A.detach(), B.detach(), self.scale)

    def weight_norm(self) -> torch.Tensor:
        """``||W + s B A||_row`` (fp32, detached), by the layer's ``norm``."""
        if self.merged:
            raise RuntimeError("the layer is merged (W holds g * (W + sBA)): unmerge() first")
        return self._row_norm(get_config(), True)

    @torch.no_grad()
    def reset_magnitude(self) -> None:
        """Set ``m`` (in place, keeping its dtype) to DoRA's initial value from the layer's own norm
        on its current device (:func:`~dora_num.ops.norm.initial_magnitude`), so that ``g == 1``
        exactly there (fp32 ``m``).  For a layer built on one device and trained on another (the
        norm's summation order differs between devices: ``g`` would be ``1 +- 1`` ulp on some rows).
        With ``B = 0`` (a fresh adapter) this is ``||W||_row``."""
        self.magnitude.copy_(initial_magnitude(self.weight_norm(), dtype=self.magnitude.dtype))

    def magnitude_scale(self) -> torch.Tensor:
        """``g = m / wnorm`` (``m / eps`` on a zero row) (fp32, differentiable in m), checked: a non-finite
        input raises naming it."""
        return magnitude_scale(self.magnitude, self.weight_norm())

    # ------------------------------------------------------------------
    # Merge for inference
    # ------------------------------------------------------------------

    @property
    def merged(self) -> bool:
        """Whether W currently holds the merged weight ``g * (W + sBA)``."""
        return self._unmerged_weight is not None

    @torch.no_grad()
    def merged_weight(self, g: torch.Tensor | None = None) -> torch.Tensor:
        """``W' = fl_t(g * (W + s B A))`` in W's dtype ``t``, from fp32 intermediates.

        Per row block (fp32 temporaries under ``MERGE_ROW_BYTES``), autocast off:
        ``P = B A`` (fp32 product), ``V = W + s P`` (``s = fl32(scale)``), ``g V``, one
        rounding to ``t``.  ``g``: the layer's own (:meth:`magnitude_scale`, checked) unless
        given.  Raises ``ValueError`` if ``W'`` is not finite (PEFT's ``safe_merge`` check).
        Error bound: :func:`dora_num.numerics.merge_bound.merged_linear_bound`.
        """
        g = self.magnitude_scale().detach() if g is None else g.detach()
        W, A, B = self.base.weight.detach(), self.lora_A.detach(), self.lora_B.detach()
        s = scale_constants(self.scale)[0]
        out = torch.empty_like(W)
        rows = max(1, MERGE_ROW_BYTES // (8 * max(W.shape[1], 1)))
        with torch.autocast(W.device.type, enabled=False):
            Af = A.float()
            for i in range(0, W.shape[0], rows):
                V = W[i:i + rows].float() + s * (B[i:i + rows].float() @ Af)
                out[i:i + rows] = (g[i:i + rows, None].float() * V).to(W.dtype)
        if not bool(torch.isfinite(out).all()):
            raise ValueError("the merged weight g * (W + sBA) is not finite in "
                             f"{str(W.dtype).removeprefix('torch.')} (overflow); keep the layer unmerged")
        return out

    @torch.no_grad()
    def merge(self, g: torch.Tensor | None = None) -> None:
        """Write :meth:`merged_weight` (of ``g``, default the layer's own) into W in place,
        keeping a copy of the original W.

        The copy makes :meth:`unmerge` exact (bitwise): ``W'`` is rounded to W's dtype, so
        ``W'/g - sBA`` differs from ``W`` by about ``u |W|`` and W cannot be recovered from it.
        Memory: one more W per merged layer.  While merged the forward is the base
        layer's (adapters get no gradient); the adapter parameters are unchanged, so
        export still writes them."""
        if self.merged:
            raise RuntimeError("the layer is already merged")
        Wm = self.merged_weight(g)
        W = self.base.weight
        self._unmerged_weight = W.detach().clone()
        W.data.copy_(Wm)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the original W bit for bit (the copy kept by :meth:`merge`)."""
        if not self.merged:
            raise RuntimeError("the layer is not merged")
        self.base.weight.data.copy_(self._unmerged_weight)
        self._unmerged_weight = None

    def _g_and_flag(self, cfg: OpConfig):
        """``(g, bad, aux, slot)`` without the per-input value checks (their syncs).  ``norm="cached"``:
        ``bad`` is the device flag of :func:`~dora_num.ops.weight_norm.magnitude_scale_and_flag` (codes
        and counts of :func:`dora_num.ops.guard.decode`; on a hit of the norm cache the flag
        computed with the cached norm, so every call with a non-finite ``g`` is reported) and
        ``aux`` the tail kernel's guard rows (None on the torch tail); the other norms give a bool
        ``bad`` from ``g`` (their guard acts inside the norm).  The forward hands the flag to
        :func:`dora_num.ops.finite.watch` (:meth:`_on_flag`): on a non-finite code the checked
        path runs and raises naming the input at fault; the guard's codes are reported.

        The norm cache (``OpConfig.norm_cache``): ``den`` (``wnorm``, ``eps`` on a zero row) is kept with the
        storage pointers and version counters of W, A, B and m and the configuration; on a hit
        ``g`` is ``m.float() / den`` again, bitwise what the norm would give (it is a
        deterministic function of those inputs), and ``bad`` None once the flag of that norm was
        read clean (``slot``: the :class:`~dora_num.ops.finite.Checked` where the forward keeps the
        :class:`~dora_num.ops.finite.Watched` of the flag; None without the cache).  By default
        (``"recompute"``) a hit counts only inside a backward pass, so the recompute of a
        checkpointed forward skips the norm while every ordinary forward computes it: an optimizer that does not bump version counters
        (fused AdamW, the HF Trainer's default) cannot make it stale.  ``"always"`` also reuses
        it across forwards (repeated inference with a frozen adapter); after an update that
        bypasses the version counter there, call :meth:`clear_norm_cache`."""
        W, A, B, m = self.base.weight, self.lora_A, self.lora_B, self.magnitude
        if torch.compiler.is_compiling() and self.norm != "dense":  # the custom op: the eager norm's bits
            # "cached": rowsum(W*W) and the zero rows from the layer's buffers, formed again only when W changed
            base = (self._base_sq, self._zero_rows) if self.norm == "cached" else None
            if base is not None and not all(t.device == W.device and t.shape == W.shape[:1] for t in base):
                base = None  # a base weight that moved without the layer (a PEFT model's .to): formed in the call
            den = weight_den(W, A, B, self.scale, m, acc=self._flags, base=base, chunk_bytes=self.chunk_bytes,
                             on_cancellation=self.on_cancellation, config=cfg)
            return magnitude_div(m, den, cfg), None, None, None
        if self.norm == "cached":
            use_cache = cfg.norm_cache != "off"
            if use_cache:
                key = (W.data_ptr(), W._version, A.data_ptr(), A._version, B.data_ptr(), B._version,
                       m.data_ptr(), m._version, cfg.key)
                hit = self.__dict__.get("_norm_cache")
                # "recompute": only inside a backward pass (a checkpointed forward's recompute),
                # where no optimizer step can have run since the forward that stored it
                reuse = cfg.norm_cache == "always" or torch._C._current_graph_task_id() != -1
                if reuse and hit is not None and hit[0] == key:
                    # the flag of the cached norm, read again unless it was read clean already (g is
                    # then bitwise the g that was checked: the same m over the same den)
                    checked = hit[4].clean
                    return m.float() / hit[1], None if checked else hit[2], hit[3], hit[4]
            g, bad, den, aux = _magnitude_scale_and_flag(W, A, B, self.scale, m, self.chunk_bytes, cfg,
                                                         self.on_cancellation, trusted=True, where=self._where(),
                                                         warn=not self._warned_cancellation)
            if use_cache and den is not None:
                slot = _finite.Checked()  # where the forward keeps the Watched of this flag
                self.__dict__["_norm_cache"] = (key, den, bad, aux, slot)
                return g, bad, aux, slot
            return g, bad, aux, None
        g = magnitude_scale(m, self._row_norm(cfg, False), check=False)
        return g, ~torch.isfinite(g.detach()).all(), None, None

    def clear_norm_cache(self) -> None:
        """Forget the cached denominator of ``g`` (:meth:`_g_and_flag`): needed only after W, A, B
        or m were changed in a way that bypasses their version counters (``.data``).  Also marks the
        compiled forward's cache of ``rowsum(W*W)`` stale."""
        self.__dict__.pop("_norm_cache", None)
        if "_base_sq" in self._buffers:
            clear_base_cache(self._base_sq)

    def _where(self, step: int | None = None) -> str:
        """The layer in messages: its module path (``name``) if set, its shape, and the forward call
        ``step`` (the layer's own count of forwards outside a backward pass) if given."""
        what = f"DoRALinear({self.in_features}->{self.out_features}, r={self.rank})"
        name = self.__dict__.get("name")
        where = f"{name} ({what})" if name else what
        return where if step is None else f"{where}, forward call {step}"

    def _on_flag(self, host_flag: torch.Tensor, g_given: bool, aux, where: str) -> bool:
        """A set flag of the forward (:func:`dora_num.ops.finite.watch`): raise naming the input at
        fault where something is not finite; else report what the cancellation guard did (the values
        were recomputed already): ``on_cancellation="warn"`` once per layer, ``"raise"``, rows still
        not certified, and (once) a guard that recomputes more than an eighth of the rows."""
        code, n = (_guard.FLAG_NONFINITE, 0) if host_flag.dtype == torch.bool else _guard.decode(host_flag)
        if code >= _guard.FLAG_NONFINITE:
            self._raise_not_finite(g_given, where)
        if n > self.out_features // 8 and not self._warned_many:  # once: the recompute is the slow path
            self._warned_many = True
            warnings.warn(f"{where}: the cancellation guard recomputes {n} of {self.out_features} rows in float64 "
                          "(O(rows d_in r) work per forward): the factored norm's guaranteed error bound exceeds "
                          "2^-6 on them (the update cancelling the rows, fp32 terms that underflow, or updates as large as W "
                          "at a large rank: the guard's report names which).  "
                          "on_cancellation='off' skips the guard.", CancellationWarning, stacklevel=2)
        if aux is not None:
            _guard.report_kernel(code, aux, self.on_cancellation, where=where, warn=not self._warned_cancellation)
        if self.on_cancellation == "warn" and code >= _guard.FLAG_CANCELLATION:
            self._warned_cancellation = True
        return True

    def _on_flags(self, host: torch.Tensor) -> bool:
        """The running flag a compiled forward raised, read on the host (:func:`check_flags`):
        ``[code, rows flagged, calls]`` since the last read.  A non-finite code raises naming the input
        at fault (by the eager, checked norm of the parameters as they are now); the guard's codes are
        reported as :meth:`_on_flag` does, its rows named by the eager norm in the layer's mode."""
        code, n, calls = (int(v) for v in host.tolist())
        if calls == 0 or (code == _guard.FLAG_OK and n == 0):
            return True
        where = f"{self._where()} (compiled; {calls} call(s) since the last check_flags)"
        if code >= _guard.FLAG_NONFINITE:
            try:
                with override(finite_check="sync"):
                    self.magnitude_scale()  # raises ValueError naming W, A, B, m or wnorm
            except ValueError as e:
                raise type(e)(f"{where}: {e}") from None
            raise _finite.NotFiniteError(f"{where}: g was not finite (a g given to forward(x, g=...), or W, A, B "
                                         "or m at the time, which are finite now)")
        if n > calls * (self.out_features // 8) and not self._warned_many:
            self._warned_many = True
            warnings.warn(f"{where}: the cancellation guard recomputed {n / calls:.0f} of {self.out_features} rows "
                          "per call in float64 (on_cancellation='off' skips the guard)", CancellationWarning,
                          stacklevel=3)
        tail_kernel = uses_tail_kernel(self.base.weight.device, get_config())  # the torch tail reported in the call
        if tail_kernel and code >= _guard.FLAG_CANCELLATION and (self.on_cancellation in ("warn", "raise")
                                                                 or code >= _guard.FLAG_UNRESOLVED):
            # name the rows: the eager norm in the layer's own mode (it warns or raises as the kernel's code says)
            with override(finite_check="sync"):
                W, A, B = self.base.weight, self.lora_A, self.lora_B
                _factored_row_norm(W.detach(), A.detach(), B.detach(), self.scale, self.chunk_bytes, None, True,
                                   get_config(), self.on_cancellation)
        return True

    def _raise_not_finite(self, g_given: bool, where: str) -> None:
        """Raise ``ValueError`` naming the layer (``where``: its path and the forward call whose flag was
        set) and the input at fault."""
        if g_given:
            raise ValueError(f"{where}: the given g contains non-finite values")
        try:
            with override(finite_check="sync"):  # the error path: the norm's own check reads its flag now
                self.magnitude_scale()  # raises ValueError naming W, A, B, m or wnorm
        except ValueError as e:
            raise type(e)(f"{where}: {e}") from None
        raise ValueError(f"{where}: g = m / wnorm contains non-finite values")

    def _check_input(self, x, W: torch.Tensor, base_out=None) -> None:
        """Metadata checks of ``x`` (and ``base_out``; no device sync): name them instead of a
        matmul error."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x has dtype {x.dtype}; DoRALinear needs floating-point inputs")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., in_features] with "
                             f"in_features = {self.in_features}")
        if x.device != W.device:
            raise ValueError(f"x is on {x.device} but the layer's weight is on {W.device}")
        if base_out is not None:
            if not isinstance(base_out, torch.Tensor) or base_out.shape != (*x.shape[:-1], self.out_features) \
                    or base_out.device != x.device:
                raise ValueError(f"base_out must be the base layer's output [..., out_features] = "
                                 f"{[*x.shape[:-1], self.out_features]} on {x.device}, got "
                                 f"{tuple(base_out.shape) if isinstance(base_out, torch.Tensor) else base_out!r}")
            return  # x may be in the adapter dtype (PEFT casts it); the base product is not formed from it
        if x.dtype != W.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x has dtype {x.dtype} but the layer's weight has {W.dtype} "
                            "(cast x, or run under torch.autocast)")

    def _check_g(self, g, W: torch.Tensor) -> None:
        """Metadata checks of a given ``g`` (no device sync)."""
        check_tensor("g", g, ndim=1, dtypes=(torch.float32,))
        if g.shape[0] != self.out_features or g.device != W.device:
            raise ValueError(f"g must be float32 [out_features] = [{self.out_features}] on {W.device}, "
                             f"got {tuple(g.shape)} on {g.device}")

    def forward(self, x: torch.Tensor, *, g: torch.Tensor | None = None,
                base_out: torch.Tensor | None = None) -> torch.Tensor:
        """``y = x W^T + b + delta``; ``g`` given: used as it is instead of the layer's own;
        ``base_out`` given: the base layer's output ``x W^T + b``, not recomputed (module
        docstring).  Merged: the base layer's forward.

        LoRA products (``x A^T B^T``) follow PEFT: under ``torch.autocast`` they are autocast's
        (``F.linear`` casts x, A and B to the autocast dtype: bf16 GEMMs with fp32 accumulation,
        as PEFT's ``lora_B(lora_A(x))``); without autocast x is cast to A's dtype (PEFT's
        ``_cast_input_dtype``), so fp32 adapters give fp32 products, and the compose and the
        output add run in the wider dtype and are rounded once to W's dtype (PEFT's
        ``result.to(torch_result_dtype)``).  Finiteness of ``g``: :mod:`dora_num.ops.finite`
        (``OpConfig.finite_check``; default ``"deferred"`` on CUDA, no host wait)."""
        if self._unmerged_weight is not None:
            return self.base(x) if base_out is None else base_out
        cfg = get_config()
        compiling = torch.compiler.is_compiling()
        if not compiling:
            _finite.poll()
            # a checkpointed forward's recompute runs in the backward (on CUDA on the autograd
            # engine's thread, which does not see an override of the forward's thread): it takes
            # the configuration of this layer's last forward outside a backward, else it could
            # record other operations and save other tensors than the forward it replays
            if torch._C._current_graph_task_id() == -1:
                self.__dict__["_forward_cfg"] = cfg
                self.__dict__["_forwards"] = self.__dict__.get("_forwards", 0) + 1
            else:
                cfg = self.__dict__.get("_forward_cfg", cfg)
        W = self.base.weight
        bias = self.base.bias
        self._check_input(x, W, base_out)
        g_given = g is not None
        # g first: its flag is then ready long before it is read (the GPU runs the norm while
        # the host queues the products below)
        if g_given:
            self._check_g(g, W)
            bad = ~torch.isfinite(g).all() if not compiling and cfg.finite_check != "off" else None
            if compiling:
                _flag_not_finite_op(g.detach(), self._flags)
            aux = None
        else:
            g, bad, aux, slot = self._g_and_flag(cfg)
        watched = None
        if bad is not None and not compiling and cfg.finite_check != "off":
            where = self._where(self.__dict__.get("_forwards"))  # this call's step, for a deferred report
            watched = _finite.watch(bad, f"{where}: g", cfg.finite_check, handle=True,
                                    on_fail=lambda host: self._on_flag(host, g_given, aux, where))
            if not g_given and slot is not None:
                slot.watched = watched
        x_lora = self.dropout(x)
        cast = not torch.is_autocast_enabled(x.device.type)  # under autocast F.linear casts
        if base_out is None and bias is not None:  # the base output as the base layer forms it: at init the
            base_out = Fn.linear(x, W, bias)  # layer returns base_out + 0, bit for bit the base layer's
        if base_out is None:
            base = Fn.linear(x, W)
        else:  # PEFT's arithmetic: its DoRA variant subtracts the bias from the base result
            base = base_out if bias is None else base_out - bias.to(base_out.dtype)
        # PEFT semantics with active dropout: the compose sees x_lora in both terms.
        separate = x_lora is not x
        out = self._lora_and_compose(x, x_lora, W, bias, base, base_out, g, separate, cast, cfg)
        if watched is not None and watched.event is not None and cfg.finite_check == "late":
            watched.check()  # every kernel of this forward is queued by now (on the CPU it was read already)
        return out

    def _lora_and_compose(self, x, x_lora, W, bias, base, base_out, g, separate: bool, cast: bool,
                          cfg: OpConfig) -> torch.Tensor:
        """The forward's LoRA products, compose and output add (module docstring for the dtypes)."""
        A, B = self.lora_A, self.lora_B
        base_c = Fn.linear(_as_dtype(x_lora, W.dtype, cast), W) if separate else base
        xa = Fn.linear(_as_dtype(x_lora, A.dtype, cast), A)
        if (cfg.recompute_lora and self.compose_fn is None and torch.is_grad_enabled()
                and (base_c.requires_grad or xa.requires_grad or B.requires_grad or g.requires_grad)):
            cdt = lora_dtype(xa, B, base_c)
            if cdt is not None:  # one node keeping x A^T instead of lora (ops/lora_compose.py)
                fold = cfg.fold_output_add and bias is None and not separate
                s = scale_constants(self.scale)[0]
                tier = _select_tier(base_c, xa, g, self.compose_path, cfg)
                if not torch.compiler.is_compiling():
                    count_tier(tier)
                out = lora_compose(base_c, xa, B, g, s, cdt, tier != "eager", fold, cfg)
                if not fold:
                    out = (base_out if base_out is not None else (base if bias is None else base + bias.to(base.dtype))) + out
                return out
        lora = Fn.linear(_as_dtype(xa, B.dtype, cast), B)
        out_dtype = base_c.dtype
        if lora.dtype != base_c.dtype:  # adapters wider than W, autocast off: compose in the wider dtype
            cdt = torch.promote_types(lora.dtype, base_c.dtype)
            base_c, lora = base_c.to(cdt), lora.to(cdt)
        inference = not (torch.is_grad_enabled()
                         and (base_c.requires_grad or lora.requires_grad or g.requires_grad))
        # Inference: the compose writes over the lora buffer (no new allocation).  Without
        # bias and dropout the output add base + delta happens in the compose's pass
        # (add_base: bitwise the same two roundings; one launch and, in the backward,
        # autograd's accumulation of base's two gradients fewer).
        # (compiled: the op's own output; a copy into lora would be one more pass)
        out_buf = lora if inference and lora.is_contiguous() and not torch.compiler.is_compiling() else None
        if self.compose_fn is None:
            fold = cfg.fold_output_add and bias is None and not separate
            out = _compose(base_c, lora, g, self.scale, path=self.compose_path, out=out_buf, config=cfg,
                           check_g=False, add_base=fold)
        else:
            fold = False
            out = self.compose_fn(base_c, lora, g, self.scale, path=self.compose_path, out=out_buf)
        if not fold:
            res = base_out if base_out is not None else (base if bias is None else base + bias.to(base.dtype))
            out = res + out
        if out.dtype != out_dtype:  # the promoted sum, rounded once to W's dtype
            out = out.to(out_dtype)
        return out

    def extra_repr(self) -> str:
        seams = (f", norm={self.norm!r}" if self.norm != "cached" else "") + (
            f", compose_fn={getattr(self.compose_fn, '__qualname__', self.compose_fn)}"
            if self.compose_fn is not None else "")
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, scale={self.scale:.6g}, use_rslora={self.use_rslora}, "
            f"compose_path={self.compose_path!r}, adapter_dtype={str(self.lora_A.dtype).removeprefix('torch.')}"
            + seams + (", merged" if self.merged else "")
        )


def _dora_layers(module: nn.Module):
    """Every :class:`DoRALinear` in ``module``: its submodules and the layers of PEFT DoRA layers put on
    this package's operator (:func:`dora_num.peft.accelerate`)."""
    seen = set()
    for m in module.modules():
        cands = [m] if isinstance(m, DoRALinear) else [
            getattr(v, "layer", None) for v in getattr(m, "lora_variant", {}).values()]
        for lyr in cands:
            if isinstance(lyr, DoRALinear) and id(lyr) not in seen:
                seen.add(id(lyr))
                yield lyr


def check_flags(module: nn.Module, *, wait: bool = True) -> int:
    """Read (and reset) the running flags that compiled forwards of the :class:`DoRALinear` layers in
    ``module`` raised, and raise or warn as an eager forward would have: a non-finite ``g``
    (:class:`~dora_num.ops.finite.NotFiniteError` naming the input at fault), the cancellation guard's
    reports (``on_cancellation``).  A compiled graph cannot read the device without a sync, so it only
    raises the flag (:func:`dora_num.ops.weight_norm.new_flag`); call this where a read is acceptable
    (after an optimizer step, every few steps).  ``wait=False`` reads without waiting: the flags are
    copied to the host behind an event and read at the next call of this package's operator, of
    ``check_flags`` or of :func:`~dora_num.ops.finite.check_pending` (one step late, no sync).
    Returns the number of layers read.  Eager forwards report at once (:mod:`dora_num.ops.finite`)."""
    _finite.poll()
    n = 0
    for lyr in _dora_layers(module):
        acc = lyr._flags
        n += 1
        if wait or acc.device.type != "cuda":
            host = acc.to("cpu", copy=True)
            acc.zero_()
            lyr._on_flags(host)
        else:
            _finite.watch(acc, f"{lyr._where()}: compiled forward", "deferred", on_fail=lyr._on_flags)
            acc.zero_()  # after the copy: both are queued on the current stream, in this order
    return n
