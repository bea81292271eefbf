"""``compose``: the differentiable DoRA compose ``delta = (g-1) base + g (s lora)``, its tiers and dispatch.

Three tiers, one function, the contract's forward bit for bit on each (docs/contract.md): ``eager``
(the torch reference in :class:`ComposeFunction`, whose backward is the documented sequence),
``fused forward`` (one Triton pass) and ``fused training`` (Triton forward and backward, ``dg`` by a
deterministic two-stage sum).  ``path="auto"`` picks the fused tiers on CUDA (training above
``FUSED_TRAIN_MIN_ELEMENTS``); the tier taken is counted (:func:`dispatch_counts`).  Under
``torch.compile`` the tiers run inside the opaque custom ops ``dora_num::compose_fwd``/``compose_bwd``;
with ``OpConfig.traced_ops`` on (the default) the fused tiers on CUDA are the ``triton_op``s
``dora_num::compose_fused`` / ``compose_bwd_fused`` instead, whose kernels Inductor launches from its
generated code (:func:`traceable`).  No host read of ``g`` in either.  In full: docs/operator.md.
"""

from __future__ import annotations

import collections
import logging

import torch

from ..numerics.formulas import scale_constants
from . import finite as _finite
from . import reference as ref
from .config import COMPOSE_PATHS, OpConfig, get_config, traces_kernels
from .validation import check_compose_args, check_finite, check_scale

PATHS = COMPOSE_PATHS
TIERS = ("eager", "fused_forward", "fused_training")

# Crossover of the training tier (forward + backward through autograd), from the GPU
# suite on the H200 (data/gpu/compose_bench.csv.xz, op="train").  Where the step is bound by
# the device (>= 8192x4096 elements) the fused tier wins everywhere: 2.4-10.4x (bf16),
# 2.6-10.5x (fp16), 1.4-3.1x (fp32).  Where both tiers are bound by the host (the rest)
# bf16/fp16 fused still wins by 1.16-2.17x; fp32 reads 0.77-1.41x, inconclusive (fp32
# eager launches fewer kernels: no casts).  The threshold is the smallest shape
# measured; below it (unmeasured, launch-bound) eager is kept.
FUSED_TRAIN_MIN_ELEMENTS = 512 * 512

_log = logging.getLogger("dora_num.dispatch")
_COUNTS: collections.Counter = collections.Counter()


def dispatch_counts() -> dict[str, int]:
    """How often each tier was taken since the last :func:`reset_dispatch_counts`."""
    return {t: _COUNTS[t] for t in TIERS}


def reset_dispatch_counts() -> None:
    _COUNTS.clear()


def _kernels():
    from .kernels import compose as kc  # imported lazily: triton is heavy

    return kc


def fused_available(device: torch.device, config: OpConfig | None = None) -> bool:
    """The Triton kernels can run on ``device`` (CUDA, or CPU under the interpreter:
    ``OpConfig.interpret``, i.e. ``TRITON_INTERPRET=1``)."""
    if (get_config() if config is None else config).interpret:
        return device.type == "cpu"
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    return True


# --------------------------------------------------------------------------
# Implementations shared by the autograd Function and the custom ops
# --------------------------------------------------------------------------

def _fwd_impl(base, lora, g, s: float, write_inner: bool, fused: bool, cfg: OpConfig, out=None,
              add_base: bool = False, g_flag=None):
    """``(delta, inner)``, or ``(base + delta, inner)`` with ``add_base`` (delta rounded first).
    ``g_flag`` (fused only): filled by the kernel with g's finiteness flag
    (:func:`~dora_num.ops.kernels.compose.compose_fwd`)."""
    if fused:
        res, inner = _kernels().compose_fwd(base, lora, g, s, write_inner=write_inner, out=out, add_base=add_base,
                                            config=cfg, g_flag=g_flag)
        return res, inner
    res = ref.compose_stable_ref(base, lora, g, s)
    if add_base:
        res = base + res
    if out is not None:
        out.copy_(res)
        res = out
    inner = ref.compose_inner_ref(base, lora, s) if write_inner else None
    return res, inner


def _bwd_impl(grad, inner, g, s: float, need_dlora: bool, need_dbase: bool, need_dg: bool, fused: bool,
              cfg: OpConfig, base=None, lora=None, add_grad: bool = False, stateless: bool = False):
    """``(dlora, dbase, dg)``; with ``add_grad`` (the backward of ``add_base``) ``dbase`` is
    ``grad + dbase``, the two terms base receives, summed as autograd would.  ``stateless``: no
    buffer kept between calls (the compiled op: :func:`~dora_num.ops.kernels.compose.compose_bwd`)."""
    if fused:
        return _kernels().compose_bwd(grad, inner, g, s, need_dlora=need_dlora, need_dbase=need_dbase,
                                      need_dg=need_dg, base=base, lora=lora, add_grad=add_grad, config=cfg,
                                      stateless=stateless)
    if need_dg and inner is None:
        inner = ref.compose_inner_ref(base, lora, s)
    dlora, dbase, dg = ref.compose_backward_ref(grad, inner, g, s, need_dg=need_dg)
    if add_grad:
        dbase = grad + dbase
    return (dlora if need_dlora else None), (dbase if need_dbase else None), dg


# ``OpConfig.recompute_inner`` (default on): the fused training tier does not write
# ``inner`` in the forward; it saves base and lora (4 bytes per element for bf16, the same
# memory as an fp32 inner) and the backward recomputes ``inner`` in registers with the
# forward's two operations (the same bits).  Traffic per element, bf16: forward 6 B +
# backward 10 B, against 10 B + 10 B when inner is written and re-read; the
# inner-writing forward stays available (``recompute_inner=False``) and is measured
# beside it by the GPU suite.

class ComposeFunction(torch.autograd.Function):
    """Stable compose with the contract's explicit backward; ``fused`` picks the Triton kernels.

    ``ComposeFunction.apply(base, lora, g, s, fused=False, add_base=False, config=None, g_flag=None)``:
    ``s`` fp32-exact (:func:`~dora_num.numerics.formulas.scale_constants`), ``config`` the
    :class:`~dora_num.ops.config.OpConfig` of forward and backward (default
    :func:`~dora_num.ops.config.get_config` when the forward runs), ``g_flag`` an int32 buffer the
    fused forward fills with g's finiteness flag (the public :func:`compose`).
    """

    @staticmethod
    def forward(ctx, base, lora, g, s: float, fused: bool = False, add_base: bool = False,
                config: OpConfig | None = None, g_flag: torch.Tensor | None = None):
        cfg = get_config() if config is None else config
        recompute = fused and cfg.recompute_inner and g.requires_grad
        out, inner = _fwd_impl(base, lora, g, s, g.requires_grad and not recompute, fused, cfg, add_base=add_base,
                               g_flag=g_flag)
        if recompute:
            ctx.save_for_backward(None, g, base, lora)
        else:
            ctx.save_for_backward(inner, g, None, None)
        ctx.s = s
        ctx.fused = fused
        ctx.add_base = add_base
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, grad):
        inner, g, base, lora = ctx.saved_tensors
        need = ctx.needs_input_grad
        dlora, dbase, dg = _bwd_impl(grad, inner, g, ctx.s, need[1], need[0], need[2], ctx.fused, ctx.cfg,
                                     base, lora, add_grad=ctx.add_base)
        return dbase, dlora, dg, None, None, None, None, None


# --------------------------------------------------------------------------
# torch.library custom ops (what torch.compile sees)
# --------------------------------------------------------------------------

_EMPTY = (0,)


def _writes_inner(need_dg: bool, fused: bool, cfg: OpConfig) -> bool:
    return need_dg and not (fused and cfg.recompute_inner)


@torch.library.custom_op("dora_num::compose_fwd", mutates_args=())
def _compose_fwd_op(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float,
                    need_dg: bool, fused: bool, config: str, add_base: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, inner)``; ``inner`` is empty unless ``need_dg`` on the eager tier (or with
    ``recompute_inner`` off), since the fused backward recomputes it.  ``config``: the
    :attr:`~dora_num.ops.config.OpConfig.key` traced with the graph; ``add_base``: ``out = base + delta``
    from the same pass, as eagerly.  No check of ``g`` here (it would read the device): the compiled
    layer's norm flag covers its ``g``."""
    cfg = OpConfig.from_key(config)
    out, inner = _fwd_impl(base, lora, g, s, _writes_inner(need_dg, fused, cfg), fused, cfg, add_base=add_base)
    if inner is None:
        inner = base.new_empty(_EMPTY, dtype=torch.float32)
    return out, inner


@_compose_fwd_op.register_fake
def _(base, lora, g, s, need_dg, fused, config, add_base=False):
    write_inner = _writes_inner(need_dg, fused, OpConfig.from_key(config))
    inner = base.new_empty(base.shape if write_inner else _EMPTY, dtype=torch.float32)
    return torch.empty_like(base), inner


@torch.library.custom_op("dora_num::compose_bwd", mutates_args=())
def _compose_bwd_op(grad: torch.Tensor, inner: torch.Tensor, base: torch.Tensor, lora: torch.Tensor,
                    g: torch.Tensor, s: float, need_dlora: bool, need_dbase: bool, need_dg: bool,
                    fused: bool, config: str, add_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``inner`` empty means: recompute it from ``base`` and ``lora``; ``add_grad``: ``dbase`` also holds
    ``grad`` (the backward of the forward's ``add_base``)."""
    have_inner = inner.numel() > 0 or grad.numel() == 0
    dlora, dbase, dg = _bwd_impl(grad, inner if need_dg and have_inner else None, g, s, need_dlora, need_dbase,
                                 need_dg, fused, OpConfig.from_key(config),
                                 base if need_dg and not have_inner else None,
                                 lora if need_dg and not have_inner else None, add_grad=add_grad, stateless=True)
    empty = grad.new_empty(_EMPTY)
    return (dlora if dlora is not None else empty, dbase if dbase is not None else empty,
            dg if dg is not None else grad.new_empty(_EMPTY, dtype=torch.float32))


@_compose_bwd_op.register_fake
def _(grad, inner, base, lora, g, s, need_dlora, need_dbase, need_dg, fused, config, add_grad=False):
    return (torch.empty_like(grad) if need_dlora else grad.new_empty(_EMPTY),
            torch.empty_like(grad) if need_dbase else grad.new_empty(_EMPTY),
            grad.new_empty((grad.shape[-1],) if need_dg else _EMPTY, dtype=torch.float32))


def _op_setup_context(ctx, inputs, output):
    base, lora, g, s, need_dg, fused, config, add_base = inputs
    recompute = fused and OpConfig.from_key(config).recompute_inner and need_dg
    if recompute:
        ctx.save_for_backward(output[1], g, base, lora)
    else:
        ctx.save_for_backward(output[1], g, None, None)
    ctx.s = s
    ctx.fused = fused
    ctx.need_dg = need_dg
    ctx.config = config
    ctx.add_base = add_base


def _op_backward(ctx, grad_out, grad_inner):
    inner, g, base, lora = ctx.saved_tensors
    need = ctx.needs_input_grad
    if base is None:
        base = lora = grad_out.new_empty(_EMPTY)
    dlora, dbase, dg = _compose_bwd_op(grad_out.contiguous(), inner, base, lora, g, ctx.s, bool(need[1]),
                                       bool(need[0]), bool(need[2]) and ctx.need_dg, ctx.fused, ctx.config,
                                       bool(ctx.add_base and need[0]))
    return (dbase if need[0] else None, dlora if need[1] else None, dg if need[2] else None, None, None, None,
            None, None)


_compose_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# The fused tiers on CUDA as ``triton_op``s: Inductor traces their bodies and launches the kernels
# from its generated code (``wrap_triton``), so a compiled step runs no Python of ours for them;
# the same kernels with the same arguments as eagerly (the bits: predicted equal, ``mul_rn``; the GPU test of
# tests/ops/test_compiled.py holds them to eager).  The eager tier, the
# interpreter and an ``inner`` written in the forward keep the opaque ops above.

def traceable(fused: bool, cfg: OpConfig, device: torch.device) -> bool:
    """Whether a compiled compose on ``device`` takes the traced ops: the fused tiers, with ``inner``
    recomputed in the backward, where :func:`~dora_num.ops.config.traces_kernels` (``OpConfig.traced_ops``
    on, the default; CUDA, not the interpreter)."""
    return fused and cfg.recompute_inner and traces_kernels(device, cfg)


@torch.library.triton_op("dora_num::compose_fused", mutates_args=())
def _compose_fused_op(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float, add_base: bool,
                      config: str) -> torch.Tensor:
    """The fused forward (``base +`` it with ``add_base``), one launch, traced."""
    return _kernels().compose_fwd(base, lora, g, s, add_base=add_base, config=OpConfig.from_key(config),
                                  traced=True)[0]


@torch.library.triton_op("dora_num::compose_bwd_fused", mutates_args=())
def _compose_bwd_fused_op(grad: torch.Tensor, base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float,
                          need_dlora: bool, need_dbase: bool, need_dg: bool, add_grad: bool,
                          config: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward, ``inner`` recomputed from ``base`` and ``lora``, traced; entries not asked for
    are empty."""
    dlora, dbase, dg = _kernels().compose_bwd(grad, None, g, s, need_dlora=need_dlora, need_dbase=need_dbase,
                                              need_dg=need_dg, base=base if need_dg else None,
                                              lora=lora if need_dg else None, add_grad=add_grad,
                                              config=OpConfig.from_key(config), stateless=True, traced=True)
    return (dlora if dlora is not None else grad.new_empty(_EMPTY),
            dbase if dbase is not None else grad.new_empty(_EMPTY),
            dg if dg is not None else grad.new_empty(_EMPTY, dtype=torch.float32))


def compose_bwd_op(grad, base, lora, g, s: float, need_dlora: bool, need_dbase: bool, need_dg: bool, fused: bool,
                   config: str, add_grad: bool):
    """The compiled compose backward, ``inner`` recomputed from ``base`` and ``lora`` (empty where
    ``need_dg`` is off): the traced op where :func:`traceable`, else the opaque one."""
    if traceable(fused, OpConfig.from_key(config), grad.device):
        return _compose_bwd_fused_op(grad, base, lora, g, s, need_dlora, need_dbase, need_dg, add_grad, config)
    return _compose_bwd_op(grad, grad.new_empty(_EMPTY, dtype=torch.float32), base, lora, g, s, need_dlora,
                           need_dbase, need_dg, fused, config, add_grad)


def _fused_setup_context(ctx, inputs, output):
    base, lora, g, s, add_base, config = inputs
    ctx.save_for_backward(g, base, lora)
    ctx.s, ctx.add_base, ctx.config = s, add_base, config


def _fused_backward(ctx, grad):
    g, base, lora = ctx.saved_tensors
    need = ctx.needs_input_grad
    dlora, dbase, dg = _compose_bwd_fused_op(grad.contiguous(), base, lora, g, ctx.s, bool(need[1]), bool(need[0]),
                                             bool(need[2]), bool(ctx.add_base and need[0]), ctx.config)
    return (dbase if need[0] else None, dlora if need[1] else None, dg if need[2] else None, None, None, None)


_compose_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup_context)


# --------------------------------------------------------------------------
# Public function and dispatch
# --------------------------------------------------------------------------

def count_tier(tier: str, base: torch.Tensor | None = None) -> None:
    """Count one eager compose on ``tier`` (:func:`dispatch_counts`), and log it at debug level."""
    _COUNTS[tier] += 1
    if base is not None and _log.isEnabledFor(logging.DEBUG):
        _log.debug("compose: tier=%s shape=%s dtype=%s", tier, tuple(base.shape), base.dtype)


def _resolve_path(path: str, cfg: OpConfig) -> str:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return cfg.compose_path if path == "auto" else path


def _select_tier(base, lora, g, path: str, cfg: OpConfig) -> str:
    path = _resolve_path(path, cfg)
    training = torch.is_grad_enabled() and (base.requires_grad or lora.requires_grad or g.requires_grad)
    if path == "eager":
        return "eager"
    if path == "fused":
        if not fused_available(base.device, cfg):
            raise RuntimeError(f"path='fused' needs a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests: the "
                               "interpreter truncates bf16 casts, so bf16 results differ from the GPU's by up to "
                               f"1 ulp; docs/platform.md); base is on {base.device}")
        return "fused_training" if training else "fused_forward"
    if base.device.type != "cuda" or not fused_available(base.device, cfg):
        return "eager"
    if not training:
        return "fused_forward"
    return "fused_training" if base.numel() >= FUSED_TRAIN_MIN_ELEMENTS else "eager"


def select_tier(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, path: str = "auto") -> str:
    """The tier :func:`compose` takes for these arguments (one of :data:`TIERS`) under the
    current configuration."""
    return _select_tier(base, lora, g, path, get_config())


def compose(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, scale: float, *, path: str = "auto",
            out: torch.Tensor | None = None, return_flag: bool = False):
    """DoRA compose ``delta = (g-1)*base + g*(s*lora)``, autograd-aware.

    ``path``: ``"eager"`` (torch reference), ``"fused"`` (Triton kernels) or
    ``"auto"`` (module docstring).  Every path computes the same function bit for
    bit in the forward (numerical contract, docs/contract.md).  ``g`` must be
    fp32 and finite; non-finite activations propagate as in any torch layer (use
    :func:`compose_stable` to have them rejected).  Empty inputs return empty.
    ``out`` (inference only: no input may need a gradient) receives the result
    and may alias ``base`` or ``lora`` (in-place; contiguous).  Non-contiguous
    inputs are copied to contiguous by the fused tiers.  The switches of
    :mod:`dora_num.ops.config` are read once, here.

    Finiteness of ``g`` without a device sync (:mod:`dora_num.ops.finite`): on CUDA the check
    follows ``OpConfig.finite_check`` (default ``"deferred"``: a non-finite ``g`` raises
    :class:`~dora_num.ops.finite.NotFiniteError` at a later call of the operator or at
    :func:`~dora_num.ops.finite.check_pending`, and this call returns the non-finite
    result); on the CPU it raises here.  ``return_flag=True`` checks nothing and returns
    ``(out, bad)``, ``bad`` a 0-dim device bool, true iff ``g`` has a NaN or Inf, for the
    caller to read when it chooses.
    """
    check_compose_args(base, lora, g)
    cfg = get_config()
    if not torch.compiler.is_compiling():
        _finite.poll()
    if torch.compiler.is_compiling():  # no read of the device in a graph: the flag is the caller's to read
        res = _compose(base, lora, g, scale, path=path, out=out, config=cfg, check_g=False)
        return (res, _finite.any_not_finite(g)) if return_flag else res
    # On the fused tiers the kernel writes g's flag (no launch of its own); else two torch ops.
    flag = None
    tier = _select_tier(base, lora, g, path, cfg)
    if (return_flag or cfg.finite_check != "off") and tier != "eager":
        flag = torch.empty(_kernels().g_flag_size(base.shape[-1], cfg), dtype=torch.int32, device=base.device)
    res = _compose(base, lora, g, scale, path=path, out=out, config=cfg, check_g=False, g_flag=flag, tier=tier)
    if return_flag:
        return res, (flag.any() if flag is not None else _finite.any_not_finite(g))
    if cfg.finite_check != "off":
        bad, is_ok = (flag, False) if flag is not None else (_finite.all_finite(g), True)
        watched = _finite.watch(bad, "compose: g", cfg.finite_check, is_ok=is_ok,
                                on_fail=lambda _: check_finite("g", g.detach()))
        if watched is not None:
            watched.check()
    return res


def _compose(base, lora, g, scale, *, path: str, out, config: OpConfig, check_g: bool,
             add_base: bool = False, g_flag: torch.Tensor | None = None, tier: str | None = None) -> torch.Tensor:
    """:func:`compose` without its argument checks, under ``config``, for callers that built
    the arguments themselves (:class:`~dora_num.ops.layer.DoRALinear`).  ``check_g=False``
    also skips the finite check of ``g`` (the layer checks its ``g`` once, itself);
    ``add_base`` returns ``base + delta``, bitwise torch's add of the two tensors, from the
    same pass (the layer's output add).  ``tier``: :func:`_select_tier`'s, if the caller has it.
    A call that records no gradient runs the forward without the autograd Function (the same
    operations; its host cost is what a small compose is bound by)."""
    s, _, _ = scale_constants(check_scale(scale))
    if tier is None:
        tier = _select_tier(base, lora, g, path, config)
    fused = tier != "eager"
    if torch.compiler.is_compiling():  # tier fixed at trace time; counters and logs are eager-only
        if traceable(fused, config, base.device):
            res = _compose_fused_op(base, lora, g, s, add_base, config.key)
        else:
            res = _compose_fwd_op(base, lora, g, s, bool(g.requires_grad), fused, config.key, add_base)[0]
        return res if out is None else out.copy_(res)
    else:
        count_tier(tier, base)
    if out is not None:
        if torch.is_grad_enabled() and (base.requires_grad or lora.requires_grad or g.requires_grad):
            raise ValueError("out= is for inference only; an input requires a gradient")
        if check_g:
            check_finite("g", g)
        return _fwd_impl(base, lora, g, s, False, fused, config, out=out, add_base=add_base,
                         g_flag=g_flag if fused else None)[0]
    if check_g:
        check_finite("g", g.detach())
    # nothing records a gradient (and no forward-mode AD level is open, where the Function's
    # missing jvp is an error to raise, not a tangent to drop): the forward without the Function
    if (not (torch.is_grad_enabled() and (base.requires_grad or lora.requires_grad or g.requires_grad))
            and torch.autograd.forward_ad._current_level < 0):
        return _fwd_impl(base, lora, g, s, False, fused, config, add_base=add_base,
                         g_flag=g_flag if fused else None)[0]
    return ComposeFunction.apply(base, lora, g, s, fused, add_base, config, g_flag if fused else None)
