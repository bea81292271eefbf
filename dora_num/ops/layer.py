"""``DoRALinear``: a frozen ``nn.Linear`` with a DoRA adapter.

``y = x W^T + b + delta``, ``delta = (g-1) * (x W^T) + g * s * (x A^T B^T)``,
``g = m / ||W + s B A||_row`` with the norm detached (DoRA paper, section 4.3; PEFT
does the same; ``m / eps`` only on a zero row).  Initialisation follows PEFT's LoRA
defaults: ``A ~ kaiming_uniform(a=sqrt(5))``, ``B = 0``, ``m = ||W||_row`` (fp32) computed
by the layer's own norm (:func:`~dora_num.ops.norm.initial_magnitude`: ``eps`` on a zero
row), so ``g == 1`` exactly at init on every row, rows with tiny or subnormal norms included,
and without a bias the layer's output equals the base layer's bit for bit (with a bias and a
16-bit base the output add rounds ``x W^T`` first: within one rounding of it).  This holds
when the forward recomputes the norm with the code, device and configuration of the init
(moving the layer to another device recomputes the norm in another summation order).
``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

``on_cancellation`` (default ``"recompute"``): what the factored norm's cancellation guard does
with rows it cannot guarantee (:mod:`dora_num.ops.guard`): recompute them in float64,
``"warn"`` (once per layer), ``"raise"`` (also at construction, where the initial
magnitude's norm has a row the guard cannot certify: e.g. a row of W with subnormal
entries), or ``"off"``.  The guard's decision joins the late
finiteness flag of ``g``; when it fires the forward recomputes ``g`` and the compose (the rare
path, a sync).  Under ``OpConfig.finite_check="off"`` (a timing switch) the flag is not read,
so the guard does not act either.

The norm is the factored one (:func:`~dora_num.ops.norm.factored_row_norm`); the
forward takes ``g`` from :func:`~dora_num.ops.norm.magnitude_scale_and_flag` (on CUDA
the norm's tail, the clamp and a finiteness flag are one Triton launch, the flag read
once at the end of the forward), and under ``torch.compile`` through the custom op of
:func:`~dora_num.ops.norm.weight_norm_cached`, so the layer compiles with
``fullgraph=True``.  ``rowsum(W*W)`` is cached for the frozen W and recomputed when W
changes (its storage, version counter, shape or dtype).  Without bias and dropout
the output add ``base + delta`` runs in the compose's pass (bitwise the same;
``OpConfig.fold_output_add``).

Seams for studies (instead of replacing this module's functions):

- ``norm=``: ``"cached"`` (the default above), ``"factored"`` (the factored norm
  without the cache of ``rowsum(W*W)``) or ``"dense"``
  (:func:`~dora_num.ops.norm.dense_row_norm`, which materialises ``W + sBA``); the
  magnitude's initial value comes from the same norm.  (``"dense"`` does not compile
  with ``fullgraph=True``: it checks its inputs' values eagerly; measured with torch 2.13,
  ``"cached"`` and ``"factored"`` do.)
- ``compose_fn=``: called instead of :func:`dora_num.ops.compose.compose`, with its
  signature ``compose_fn(base, lora, g, scale, *, path, out)``; it returns ``delta``
  and the layer adds ``base`` (and the bias) itself.
- ``forward(x, g=...)``: a given fp32 ``g [out_features]`` is used as it is (the
  layer's own norm is not computed; ``g`` is still checked for finiteness).

The switches of :mod:`dora_num.ops.config` are read once per forward.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as Fn
from torch import nn

from .compose import PATHS, _compose
from .config import OpConfig, get_config
from .guard import FLAG_NONFINITE, CancellationWarning, check_on_cancellation
from .norm import (_factored_row_norm, _magnitude_scale_and_flag, _weight_norm_cached, cached_base_row_norm_sq,
                   dense_row_norm, initial_magnitude, magnitude_scale)
from .validation import check_tensor

NORMS = ("cached", "factored", "dense")


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
        on_cancellation: str = "recompute",
    ):
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
        self.on_cancellation = check_on_cancellation(on_cancellation)
        self._warned_cancellation = False  # on_cancellation="warn": once per layer
        self._warned_many = False  # the guard recomputing many rows: once per layer
        W = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=W.dtype, device=W.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=W.dtype, device=W.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        # m = the denominator of g from the very norm the forward recomputes: g == 1 exactly at init
        self.magnitude = nn.Parameter(initial_magnitude(self.weight_norm()))

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float | None = None, **kwargs) -> "DoRALinear":
        """Wrap ``linear`` (kept, frozen) with a freshly initialised DoRA adapter."""
        return cls(linear, rank, alpha, **kwargs)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def base_sq(self) -> torch.Tensor:
        """Cached ``rowsum(W*W)`` (fp32), recomputed if W changed
        (:func:`~dora_num.ops.norm.cached_base_row_norm_sq`: the cache lives on W)."""
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
        return self._row_norm(get_config(), True)

    def magnitude_scale(self) -> torch.Tensor:
        """``g = m / max(wnorm, eps)`` (fp32, differentiable in m), checked: a non-finite
        input raises naming it."""
        return magnitude_scale(self.magnitude, self.weight_norm())

    def _g_and_flag(self, cfg: OpConfig):
        """``(g, bad, pending)`` without the per-input value checks (their syncs).
        ``norm="cached"``: ``bad`` is the device flag of
        :func:`~dora_num.ops.norm.magnitude_scale_and_flag` (codes of :mod:`dora_num.ops.guard`)
        and ``pending`` its cancellation guard (:class:`~dora_num.ops.norm.PendingGuard`); the
        other norms give ``bad=None`` (then the flag is computed from ``g``) and guard inside the
        norm (``norm="factored"``: a sync).  The forward reads the flag once, late
        (:class:`_FiniteCheck`): on a non-finite code the checked path runs and raises naming the
        input at fault; on the guard's code :meth:`_guarded` recomputes ``g`` and the compose."""
        if self.norm == "cached":
            return _magnitude_scale_and_flag(self.base.weight, self.lora_A, self.lora_B, self.scale, self.magnitude,
                                             self.chunk_bytes, cfg, self.on_cancellation)
        return magnitude_scale(self.magnitude, self._row_norm(cfg, False), check=False), None, None

    def _guarded_g(self, pending) -> torch.Tensor:
        """``g`` with the rows the cancellation guard flagged recomputed (or the error/warning of
        ``on_cancellation``; "warn" warns once per layer)."""
        where = f"DoRALinear({self.in_features}->{self.out_features}, r={self.rank})"
        g = pending.g(where=where, warn=not self._warned_cancellation)
        if self.on_cancellation == "warn":
            self._warned_cancellation = True
        n = pending.n_flagged()
        if n > self.out_features // 8 and not self._warned_many:  # once: the recompute is the slow path
            self._warned_many = True
            warnings.warn(f"{where}: the cancellation guard recomputes {n} of {self.out_features} rows in float64 "
                          "(a device sync and O(rows d_in r) work per forward): the factored norm's guaranteed "
                          "error bound exceeds 2^-6 on them (strong cancellation, or updates as large as W at a "
                          "large rank).  on_cancellation='off' skips the guard.", CancellationWarning, stacklevel=3)
        return g

    def _raise_not_finite(self, g_given: bool) -> None:
        if g_given:
            raise ValueError("the given g contains non-finite values")
        self.magnitude_scale()  # raises ValueError naming W, A, B, m or wnorm
        raise ValueError("g = m / max(wnorm, eps) contains non-finite values")

    def _check_input(self, x, W: torch.Tensor) -> None:
        """Metadata checks of ``x`` (no device sync): name ``x`` instead of a matmul error."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x has dtype {x.dtype}; DoRALinear needs floating-point inputs")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., in_features] with "
                             f"in_features = {self.in_features}")
        if x.device != W.device:
            raise ValueError(f"x is on {x.device} but the layer's weight is on {W.device}")
        if x.dtype != W.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x has dtype {x.dtype} but the layer's weight has {W.dtype} "
                            "(cast x, or run under torch.autocast)")

    def _check_g(self, g, W: torch.Tensor) -> None:
        """Metadata checks of a given ``g`` (no device sync)."""
        check_tensor("g", g, ndim=1, dtypes=(torch.float32,))
        if g.shape[0] != self.out_features or g.device != W.device:
            raise ValueError(f"g must be float32 [out_features] = [{self.out_features}] on {W.device}, "
                             f"got {tuple(g.shape)} on {g.device}")

    def forward(self, x: torch.Tensor, *, g: torch.Tensor | None = None) -> torch.Tensor:
        """``y = x W^T + b + delta``; ``g`` given: used as it is instead of the layer's own."""
        cfg = get_config()
        W = self.base.weight
        bias = self.base.bias
        self._check_input(x, W)
        g_given = g is not None
        # g first: its flag is then ready long before the forward reads it (the GPU runs
        # the norm while the host queues the products below)
        if g_given:
            self._check_g(g, W)
            bad = pending = None
        else:
            g, bad, pending = self._g_and_flag(cfg)
        finite = None
        if not torch.compiler.is_compiling() and cfg.finite_check != "off":
            finite = _FiniteCheck(g, bad)
            if cfg.finite_check == "sync":  # the A/B baseline: read now, draining the device
                if not finite.ok():
                    g = self._flagged(finite, g_given, pending)
                finite = None
        x_lora = self.dropout(x)
        base = Fn.linear(x, W)
        # PEFT semantics with active dropout: the compose sees x_lora in both terms.
        base_c = base if x_lora is x else Fn.linear(x_lora, W)
        out = self._lora_and_compose(x_lora, base, base_c, g, bias, cfg)
        if finite is not None and not finite.ok():  # every kernel of this forward is queued by now
            # the rare path: the guard flagged rows (else this raises): the compose again with
            # the recomputed g (the lora product too: an inference compose wrote over its buffer)
            out = self._lora_and_compose(x_lora, base, base_c, self._flagged(finite, g_given, pending), bias, cfg)
        return out

    def _lora_and_compose(self, x_lora, base, base_c, g, bias, cfg: OpConfig) -> torch.Tensor:
        lora = Fn.linear(Fn.linear(x_lora, self.lora_A), self.lora_B).to(base_c.dtype)
        inference = not (torch.is_grad_enabled()
                         and (base_c.requires_grad or lora.requires_grad or g.requires_grad))
        # Inference: the compose writes over the lora buffer (no new allocation).  Without
        # bias and dropout the output add base + delta happens in the compose's pass
        # (add_base: bitwise the same two roundings; one launch and, in the backward,
        # autograd's accumulation of base's two gradients fewer).
        out_buf = lora if inference and lora.is_contiguous() else None
        if self.compose_fn is None:
            fold = cfg.fold_output_add and bias is None and base_c is base
            out = _compose(base_c, lora, g, self.scale, path=self.compose_path, out=out_buf, config=cfg,
                           check_g=False, add_base=fold)
        else:
            fold = False
            out = self.compose_fn(base_c, lora, g, self.scale, path=self.compose_path, out=out_buf)
        if not fold:
            out = (base if bias is None else base + bias.to(base.dtype)) + out
        return out

    def _flagged(self, finite: "_FiniteCheck", g_given: bool, pending) -> torch.Tensor:
        """A raised flag: raise naming the input at fault, or (only the cancellation guard's code)
        the guarded ``g``."""
        if pending is None or int(finite.flag.max()) >= FLAG_NONFINITE:
            self._raise_not_finite(g_given)
        return self._guarded_g(pending)

    def extra_repr(self) -> str:
        seams = (f", norm={self.norm!r}" if self.norm != "cached" else "") + (
            f", compose_fn={getattr(self.compose_fn, '__qualname__', self.compose_fn)}"
            if self.compose_fn is not None else "")
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, scale={self.scale:.6g}, use_rslora={self.use_rslora}, "
            f"compose_path={self.compose_path!r}" + seams
        )


class _FiniteCheck:
    """The finiteness flag of ``g``, started when ``g`` is computed and read at the end of the forward.

    ``bad`` is the device flag of :func:`~dora_num.ops.norm.magnitude_scale_and_flag`
    (None: computed here from ``g``).  On CUDA it is copied to pinned host memory
    behind an event on ``g``'s device and stream, so reading it waits for the work
    queued up to ``g`` (the earlier layers included), while this layer's products and
    compose are already queued behind it: the device is not drained to an empty
    queue in the middle of the forward, as a ``bool(...)`` right after ``g`` would
    (``OpConfig.finite_check="sync"``).  At 4096->4096, r=384, 4096 tokens, bf16, the
    layer's step was bound by the host and an interleaved A/B on the H200 measured
    1.90 ms per step for this check, 1.90 ms for the sync right after ``g`` and 1.70 ms
    without a check (``data/gpu/layer_check_ab.log``; at 8192->8192, 2048 tokens: 2.18,
    2.29, 2.10 ms).  The pinned flag is allocated per call (the host caching allocator
    makes that cheap), so replicas of a module on other threads do not share it.  On
    other devices the flag is read directly.  Under ``torch.compile`` the compose
    custom op checks ``g`` and the norm op ``wnorm``.
    """

    __slots__ = ("flag", "event")

    def __init__(self, g: torch.Tensor, bad: torch.Tensor | None = None):
        if bad is None:
            bad = ~torch.isfinite(g.detach()).all()
        if g.device.type != "cuda":
            self.flag, self.event = bad, None
            return
        self.flag = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
        self.flag.copy_(bad, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(g.device))  # the stream the copy was queued on

    def ok(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return not bool(self.flag.any())
