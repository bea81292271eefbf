"""``DoRALinear``: a frozen ``nn.Linear`` with a DoRA adapter.

``y = x W^T + b + delta``, ``delta = (g-1) * (x W^T) + g * s * (x A^T B^T)``,
``g = m / max(||W + s B A||_row, eps)`` with the norm detached (DoRA paper,
section 4.3; PEFT does the same).  Initialisation follows PEFT's LoRA defaults:
``A ~ kaiming_uniform(a=sqrt(5))``, ``B = 0``, ``m = ||W||_row`` (fp32), so the
layer equals the base layer at init and ``g = 1`` up to the rounding of ``m``.
``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

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

import torch
import torch.nn.functional as Fn
from torch import nn

from . import finite as _finite
from .compose import PATHS, _compose
from .config import OpConfig, get_config
from .norm import (_factored_row_norm, _magnitude_scale_and_flag, _weight_norm_cached, cached_base_row_norm_sq,
                   dense_row_norm, magnitude_scale)
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
        W = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=W.dtype, device=W.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=W.dtype, device=W.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        self.magnitude = nn.Parameter(self.weight_norm().clone())

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
            return _weight_norm_cached(W, A, B, self.scale, self.chunk_bytes, check, cfg)
        if self.norm == "factored":
            return _factored_row_norm(W.detach(), A.detach(), B.detach(), self.scale, self.chunk_bytes, None,
                                      check, cfg)
        return dense_row_norm(W.detach(), A.detach(), B.detach(), self.scale)

    def weight_norm(self) -> torch.Tensor:
        """``||W + s B A||_row`` (fp32, detached), by the layer's ``norm``."""
        return self._row_norm(get_config(), True)

    def magnitude_scale(self) -> torch.Tensor:
        """``g = m / max(wnorm, eps)`` (fp32, differentiable in m), checked: a non-finite
        input raises naming it."""
        return magnitude_scale(self.magnitude, self.weight_norm())

    def _g_and_flag(self, cfg: OpConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(g, bad)`` without the per-input value checks (their syncs).  ``norm="cached"``:
        ``bad`` is the device flag of :func:`~dora_num.ops.norm.magnitude_scale_and_flag` (on a
        hit of the norm cache the flag computed with the cached norm, so every call with a
        non-finite ``g`` is reported); the other norms give ``bad`` from ``g``.  The forward hands the flag to
        :func:`dora_num.ops.finite.watch`, and on failure the checked path runs and raises
        naming the input at fault.

        The norm cache (``OpConfig.norm_cache``): ``den = max(wnorm, eps)`` is kept with the
        storage pointers and version counters of W, A, B and m (every in-place update, an
        optimizer step included, bumps them) and the configuration; while they match, ``g`` is
        ``m.float() / den`` again, bitwise what the norm would give (it is a deterministic
        function of those inputs).  So the recompute of a checkpointed forward, and repeated
        inference with a frozen adapter, skip the norm.  An update through ``.data`` bypasses
        the version counter: call :meth:`clear_norm_cache` after one."""
        W, A, B, m = self.base.weight, self.lora_A, self.lora_B, self.magnitude
        if self.norm == "cached":
            use_cache = cfg.norm_cache and not torch.compiler.is_compiling()
            if use_cache:
                key = (W.data_ptr(), W._version, A.data_ptr(), A._version, B.data_ptr(), B._version,
                       m.data_ptr(), m._version, cfg.key)
                hit = self.__dict__.get("_norm_cache")
                if hit is not None and hit[0] == key:
                    return m.float() / hit[1], hit[2]  # the flag of the cached norm, checked again
            g, bad, den = _magnitude_scale_and_flag(W, A, B, self.scale, m, self.chunk_bytes, cfg, with_den=True,
                                                    trusted=True)
            if use_cache and den is not None:
                self.__dict__["_norm_cache"] = (key, den, bad)
            return g, bad
        g = magnitude_scale(m, self._row_norm(cfg, False), check=False)
        return g, ~torch.isfinite(g.detach()).all()

    def clear_norm_cache(self) -> None:
        """Forget the cached ``max(wnorm, eps)`` (:meth:`_g_and_flag`): needed only after W, A, B
        or m were changed in a way that bypasses their version counters (``.data``)."""
        self.__dict__.pop("_norm_cache", None)

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
        """``y = x W^T + b + delta``; ``g`` given: used as it is instead of the layer's own.

        LoRA products (``x A^T B^T``) follow PEFT: under ``torch.autocast`` they are autocast's
        (``F.linear`` casts x, A and B to the autocast dtype: bf16 GEMMs with fp32 accumulation,
        as PEFT's ``lora_B(lora_A(x))``); without autocast x is cast to A's dtype (PEFT's
        ``_cast_input_dtype``), so fp32 adapters give fp32 products, rounded to the activation
        dtype before the compose (whose inputs share one dtype).  Finiteness of ``g``:
        :mod:`dora_num.ops.finite` (``OpConfig.finite_check``; default ``"deferred"`` on CUDA,
        no host wait)."""
        cfg = get_config()
        compiling = torch.compiler.is_compiling()
        if not compiling:
            _finite.poll()
        W = self.base.weight
        bias = self.base.bias
        self._check_input(x, W)
        g_given = g is not None
        # g first: its flag is then ready long before it is read (the GPU runs the norm while
        # the host queues the products below)
        if g_given:
            self._check_g(g, W)
            bad = ~torch.isfinite(g).all() if not compiling and cfg.finite_check != "off" else None
        else:
            g, bad = self._g_and_flag(cfg)
        watched = None
        if bad is not None and not compiling and cfg.finite_check != "off":
            watched = _finite.watch(bad, f"DoRALinear({self.in_features}->{self.out_features}, r={self.rank}): g",
                                    cfg.finite_check, on_fail=lambda: self._raise_not_finite(g_given))
        x_lora = self.dropout(x)
        base = Fn.linear(x, W)
        # PEFT semantics with active dropout: the compose sees x_lora in both terms.
        base_c = base if x_lora is x else Fn.linear(x_lora, W)
        A = self.lora_A
        x_a = x_lora if x_lora.dtype == A.dtype or torch.is_autocast_enabled(x.device.type) else x_lora.to(A.dtype)
        lora = Fn.linear(Fn.linear(x_a, A), self.lora_B)
        if lora.dtype != base_c.dtype:
            lora = lora.to(base_c.dtype)
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
        if watched is not None:  # "late": every kernel of this forward is queued by now
            watched.check()
        return out

    def extra_repr(self) -> str:
        seams = (f", norm={self.norm!r}" if self.norm != "cached" else "") + (
            f", compose_fn={getattr(self.compose_fn, '__qualname__', self.compose_fn)}"
            if self.compose_fn is not None else "")
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, scale={self.scale:.6g}, use_rslora={self.use_rslora}, "
            f"compose_path={self.compose_path!r}" + seams
        )
