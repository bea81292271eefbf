"""PEFT drop-in: a ``PeftModel``'s DoRA ``Linear`` layers on this package's operator, in place.

:func:`accelerate` replaces the adapter's entry of each served layer's ``lora_variant`` table (PEFT's
extension point) by a :class:`DoRAKernelVariant`, whose forward runs :class:`~dora_num.DoRALinear` on
PEFT's own parameters and PEFT's base result; the state dict, ``save_pretrained``, merging, adapter
switching and PEFT's training/eval rule for dropout stay PEFT's.  Layers it cannot serve keep PEFT's
path and are reported with the reason; :func:`restore` undoes it.  Every known difference from PEFT,
with the test that shows it, and how the module works in full: docs/peft.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from .ops.layer import ADAPTER_DTYPES, DoRALinear
from .ops.weight_norm import clear_base_sq_cache

_log = logging.getLogger("dora_num.peft")

ACCELERATED = "accelerated"
KEPT = "kept (PEFT's path)"
REINIT_MAGNITUDE = ("keep", "fresh")
_STATE = "_dora_num_acceleration"  # attribute of an accelerated PeftModel: the options of accelerate
_PICK_UP = ("add_adapter", "load_adapter")  # PeftModel methods whose new adapters are accelerated
_NO_DROPOUT = nn.Identity()


def _peft_modules():
    from peft.tuners.lora import layer as lora_layer
    from peft.tuners.lora import variants

    return lora_layer, variants


def unsupported_reason(module: nn.Module, adapter: str) -> str | None:
    """Why adapter ``adapter`` of the PEFT DoRA layer ``module`` cannot run on this package's
    operator, or None if it can."""
    lora_layer, variants = _peft_modules()
    cls = f"{type(module).__module__}.{type(module).__qualname__}"
    if isinstance(module, lora_layer.Embedding):
        return "Embedding DoRA (lora.Embedding): not supported"
    if isinstance(module, lora_layer._ConvNd):
        return f"Conv DoRA ({type(module).__name__}): not supported"
    if type(module) is not lora_layer.Linear:
        return (f"{cls} is not PEFT's plain lora.Linear (a quantized base layer such as bitsandbytes, HQQ, "
                "torchao, GPTQ, or another custom layer): not supported")
    variant = module.lora_variant.get(adapter)
    if type(variant) is not variants.DoraLinearVariant and not isinstance(variant, DoRAKernelVariant):
        return f"the adapter's variant is {type(variant).__name__}, not plain DoRA: not supported"
    base = module.get_base_layer()
    if getattr(module, "fan_in_fan_out", False):
        return f"fan_in_fan_out=True (base {type(base).__name__} stores W transposed): not supported"
    if not isinstance(base, nn.Linear) or type(base).forward is not nn.Linear.forward:
        return f"base layer {type(base).__module__}.{type(base).__name__} is not torch.nn.Linear: not supported"
    W = base.weight
    if W.dtype == torch.float64 and type(W) in (nn.Parameter, torch.Tensor):
        return ("base weight is float64: dora_num's g is float32 (docs/contract.md, promise 1), far less "
                "accurate than PEFT's float64 evaluation: not served")
    if W.dtype not in (torch.float32, torch.bfloat16, torch.float16) or type(W) not in (nn.Parameter, torch.Tensor):
        return f"base weight is a {type(W).__name__} of dtype {W.dtype} (quantized or not floating): not supported"
    if module.lora_bias.get(adapter, False) or module.lora_B[adapter].bias is not None:
        return "lora_bias=True: not supported"
    if getattr(module, "ephemeral_gpu_offload", False):
        return "ephemeral_gpu_offload=True: not supported"
    for name, t in _adapter_tensors(module, adapter):
        if t.dtype not in ADAPTER_DTYPES or t.device != W.device:
            return f"{name} is {t.dtype} on {t.device} (base weight {W.dtype} on {W.device}): not supported"
    return None


def _adapter_tensors(module, adapter: str):
    return (("lora_A", module.lora_A[adapter].weight), ("lora_B", module.lora_B[adapter].weight),
            ("lora_magnitude_vector", module.lora_magnitude_vector[adapter].weight))


def _signature(module, adapter: str) -> tuple:
    """What :func:`unsupported_reason` depends on that a ``.to(...)`` can change: dtypes and devices."""
    W = module.get_base_layer().weight
    return (type(W), W.dtype, W.device) + tuple((t.dtype, t.device) for _, t in _adapter_tensors(module, adapter))


class _DropoutBranch(nn.Module):
    """PEFT's training branch of its DoRA variant: ``x = dropout(x)`` in the dropout module's own
    mode and the compose's base recomputed from it (``base_result=None``), also where that dropout
    returns ``x`` itself (its module in eval mode): :class:`~dora_num.DoRALinear` recomputes the
    base when its dropout returns another tensor, so ``x`` comes back as a view."""

    def __init__(self, dropout: nn.Module):
        super().__init__()
        self.dropout = dropout

    def forward(self, x):
        y = self.dropout(x)
        return x.view_as(x) if y is x else y


class DoRAKernelVariant(_peft_modules()[1].DoraLinearVariant):
    """PEFT's ``DoraLinearVariant`` with its forward on :class:`~dora_num.DoRALinear`.

    ``original``: the PEFT variant object it replaces (restored by :func:`restore`; used
    for the calls this one does not serve).  ``layer``: the :class:`~dora_num.DoRALinear`
    on PEFT's parameters (:meth:`~dora_num.DoRALinear.from_peft`; its ``name`` is the
    module path and the adapter), re-bound at each call if PEFT replaced a parameter
    object or the scale.  ``served``: the dtypes and devices it was accelerated with; a
    call that finds others asks :func:`unsupported_reason` again.  Merging and unmerging
    are PEFT's (inherited static methods)."""

    def __init__(self, original, layer: DoRALinear, name: str, served: tuple):
        self.original = original
        self.layer = layer
        self.name = name
        self.served = served
        self._branch: _DropoutBranch | None = None
        self._warned: set = set()

    def _fallback(self, why: str, module, active_adapter, x, result, kwargs):
        if why not in self._warned:
            self._warned.add(why)
            _log.warning("dora_num.peft: %s takes PEFT's path: %s", self.name, why)
        # the input cast this package skipped (_set_input_cast), done as PEFT would have done it
        x = _peft_cast(module, x, module.lora_A[active_adapter].weight.dtype)
        return self.original.forward(module, active_adapter=active_adapter, x=x, result=result, **kwargs)

    def _bind(self, module, adapter: str) -> DoRALinear:
        lyr = self.layer
        for attr, (_, p) in zip(("lora_A", "lora_B", "magnitude"), _adapter_tensors(module, adapter)):
            if getattr(lyr, attr) is not p:
                setattr(lyr, attr, p)
        if lyr.base is not module.get_base_layer():
            lyr.base = module.get_base_layer()
        s = module.scaling[adapter]
        if lyr.scale != s:
            lyr.scale = float(s)
        # PEFT's DoraLinearVariant.forward: no dropout where the LoRA layer is not training
        drop = module.lora_dropout[adapter]
        if isinstance(drop, nn.Identity) or not module.training:
            want = _NO_DROPOUT
        else:
            if self._branch is None or self._branch.dropout is not drop:
                self._branch = _DropoutBranch(drop)
            want = self._branch
        if lyr.dropout is not want:
            lyr.dropout = want
        return lyr

    def forward(self, module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        if any(v is not None for v in kwargs.values()):
            return self._fallback(f"extra arguments {sorted(kwargs)}", module, active_adapter, x, result, kwargs)
        if sum(1 for a in module.active_adapters if a in module.lora_A) > 1:
            return self._fallback("more than one active adapter (PEFT stacks them)", module, active_adapter, x,
                                  result, kwargs)
        sig = _signature(module, active_adapter)
        if sig != self.served:
            why = unsupported_reason(module, active_adapter)
            if why is not None:
                return self._fallback(f"changed since accelerate: {why}", module, active_adapter, x, result,
                                      kwargs)
            self.served = sig
        return self._bind(module, active_adapter)(x, base_out=result)


_CAST_ATTR = "_dora_num_cast_input_dtype"  # PEFT's cast_input_dtype_enabled before accelerate changed it


def _peft_cast(module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as PEFT's ``_cast_input_dtype`` would have given it, were the cast still enabled."""
    if getattr(module, _CAST_ATTR, True) and x.dtype != dtype:
        return x.to(dtype)
    return x


def _set_input_cast(module) -> None:
    """Skip PEFT's cast of the input to the adapter dtype where it is a no-op for this package's
    layer: every adapter of ``module`` served here with dropout off.  PEFT casts ``x`` to fp32 for fp32
    adapters; under autocast the LoRA products cast it back (two passes over ``[T, d_in]`` and a saved
    fp32 copy), and without autocast :class:`~dora_num.DoRALinear` casts it itself (exact): outputs and
    gradients are bitwise the same (tests/test_compiled_peft.py)."""
    served = [isinstance(module.lora_variant.get(a), DoRAKernelVariant) for a in module.lora_A]
    no_dropout = all(isinstance(module.lora_dropout[a], nn.Identity) for a in module.lora_A)
    if not hasattr(module, _CAST_ATTR):
        setattr(module, _CAST_ATTR, getattr(module, "cast_input_dtype_enabled", True))
    original = getattr(module, _CAST_ATTR)
    module.cast_input_dtype_enabled = original and not (served and all(served) and no_dropout)


def _restore_input_cast(module) -> None:
    if hasattr(module, _CAST_ATTR):
        module.cast_input_dtype_enabled = getattr(module, _CAST_ATTR)
        delattr(module, _CAST_ATTR)


@dataclass(frozen=True)
class ModuleDecision:
    """One (layer, adapter) of a PEFT model: whether it runs on this package's operator."""

    name: str
    adapter: str
    status: str
    reason: str = ""


@dataclass
class AccelerationReport:
    """What :func:`accelerate` did (or :func:`acceleration_report` found), one row per PEFT DoRA
    (layer, adapter)."""

    rows: list = field(default_factory=list)

    @property
    def accelerated(self) -> list:
        return [r for r in self.rows if r.status == ACCELERATED]

    @property
    def kept(self) -> list:
        return [r for r in self.rows if r.status != ACCELERATED]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([r.__dict__ for r in self.rows], columns=["name", "adapter", "status", "reason"])

    def summary(self) -> str:
        return (f"dora_num.peft.accelerate: {len(self.accelerated)} of {len(self.rows)} DoRA layer adapters on "
                f"dora_num's operator, {len(self.kept)} kept on PEFT's path")

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  kept: {r.name} [{r.adapter}]: {r.reason}" for r in self.kept]
        lines += [f"  note: {r.name} [{r.adapter}]: {r.reason}" for r in self.accelerated if r.reason]
        return "\n".join(lines)


def _dora_layers(model: nn.Module):
    """``(name, module, adapter)`` of every PEFT LoRA layer adapter with ``use_dora``."""
    from peft.tuners.lora.layer import LoraLayer

    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer):
            for adapter in sorted(getattr(mod, "use_dora", {})):
                if mod.use_dora[adapter]:
                    yield name, mod, adapter


@torch.no_grad()
def _fresh_adapter_note(lyr: DoRALinear, reinit_magnitude: str) -> str:
    """A fresh adapter (every B zero): PEFT's m is PEFT's norm of W, g = m / (dora_num's norm) is 1 within
    an ulp.  ``"fresh"``: m re-initialised from dora_num's norm (g == 1 exactly here); returns the note."""
    if bool(lyr.lora_B.detach().any()):
        return ""
    m = lyr.magnitude
    if reinit_magnitude == "fresh":
        before = m.detach().clone()
        lyr.reset_magnitude()
        changed = int((m.detach() != before).sum())
        return (f"fresh adapter (B = 0): m re-initialised from dora_num's norm (reinit_magnitude='fresh'), "
                f"{changed} of {m.numel()} entries changed, g == 1 exactly")
    g = lyr.magnitude_scale()
    off = int((g != 1).sum())
    if not off:
        return ""
    return (f"fresh adapter (B = 0): g = m / wnorm differs from 1 on {off} of {g.numel()} rows by at most "
            f"{float((g - 1).abs().max()):.3g} (PEFT's m over dora_num's norm); reinit_magnitude='fresh' makes it 1")


def accelerate(peft_model: nn.Module, *, verbose: bool = True, reinit_magnitude: str = "keep",
               **layer_kwargs) -> AccelerationReport:
    """Run every PEFT DoRA ``Linear`` of ``peft_model`` that can be served on this package's
    operator, in place (module docstring); returns the :class:`AccelerationReport` (also
    logged on ``dora_num.peft``, and printed with ``verbose``).

    ``reinit_magnitude``: what to do with a fresh adapter (every B zero), whose ``g = m / wnorm``
    is 1 within an ulp (PEFT's ``m`` is PEFT's norm of W, ``wnorm`` this package's): ``"keep"``
    (default: PEFT's ``m`` untouched; accelerate changes no parameter, so ``save_pretrained`` writes
    PEFT's bytes; the report notes the rows where ``g != 1``) or ``"fresh"`` (``m`` re-initialised
    from this package's norm, so ``g == 1`` exactly on this device and the model is bitwise its base
    model at initialisation, as PEFT's is; the report says how many entries of ``m`` changed).
    ``layer_kwargs`` go to :class:`~dora_num.DoRALinear` (e.g. ``compose_path``, ``norm``).
    Idempotent: layers already accelerated are checked again (one that changed into something
    not served gets PEFT's variant back and is reported kept), adapters added since are
    accelerated now.  On a ``PeftModel``, its ``add_adapter`` and ``load_adapter`` then accelerate
    the adapters they add, with these options (``load_adapter``: ``m`` as loaded).
    """
    if reinit_magnitude not in REINIT_MAGNITUDE:
        raise ValueError(f"reinit_magnitude must be one of {REINIT_MAGNITUDE}, got {reinit_magnitude!r}")
    report = AccelerationReport()
    for name, mod, adapter in _dora_layers(peft_model):
        current = mod.lora_variant.get(adapter)
        why = unsupported_reason(mod, adapter)
        if isinstance(current, DoRAKernelVariant):
            if why is None:
                report.rows.append(ModuleDecision(name, adapter, ACCELERATED, "already accelerated"))
                continue
            mod.lora_variant[adapter] = current.original
            clear_base_sq_cache(mod.get_base_layer().weight)
            report.rows.append(ModuleDecision(name, adapter, KEPT, f"changed since accelerate: {why}"))
            continue
        if why is not None:
            report.rows.append(ModuleDecision(name, adapter, KEPT, why))
            continue
        lyr = DoRALinear.from_peft(mod, adapter, **layer_kwargs)
        lyr.name = f"{name} [{adapter}]"
        notes = [_fresh_adapter_note(lyr, reinit_magnitude)]
        mod.lora_variant[adapter] = DoRAKernelVariant(current, lyr, name, _signature(mod, adapter))
        active = [a for a in mod.active_adapters if a in mod.lora_A]
        if len(active) > 1:
            notes.append(f"{len(active)} adapters active now: PEFT's path while more than one is")
        report.rows.append(ModuleDecision(name, adapter, ACCELERATED, "; ".join(n for n in notes if n)))
    for _, mod, _ in _dora_layers(peft_model):
        if hasattr(mod, _CAST_ATTR) or any(isinstance(v, DoRAKernelVariant) for v in mod.lora_variant.values()):
            _set_input_cast(mod)
    if not report.rows:
        _log.warning("dora_num.peft.accelerate: the model has no PEFT DoRA layers")
    _install_pick_up(peft_model, dict(layer_kwargs, reinit_magnitude=reinit_magnitude))
    _log.info("%s", report.summary())
    for r in report.kept:
        _log.warning("dora_num.peft.accelerate: %s [%s] kept on PEFT's path: %s", r.name, r.adapter, r.reason)
    if verbose:
        print(report)
    return report


class _PickUpNewAdapters:
    """A ``PeftModel``'s ``add_adapter`` / ``load_adapter`` after :func:`accelerate`: PEFT's method,
    then :func:`accelerate` with the options it was called with (``load_adapter``: ``m`` kept as
    loaded), so that adapters added later run on this package's operator too.  (An instance
    attribute of the model, removed by :func:`restore`; ``load_adapter``'s own call of
    ``add_adapter`` is not picked up separately.)"""

    def __init__(self, model: nn.Module, method: str):
        self.model, self.method = model, method

    def __call__(self, *args, **kwargs):
        model = self.model
        options = model.__dict__.get(_STATE)
        outer = options is not None and not options.get("_busy", False)
        if outer:
            options["_busy"] = True
        try:
            out = getattr(type(model), self.method)(model, *args, **kwargs)
        finally:
            if outer:
                options["_busy"] = False
        if outer:
            kw = {k: v for k, v in options.items() if k != "_busy"}
            if self.method == "load_adapter":
                kw["reinit_magnitude"] = "keep"
            report = accelerate(model, verbose=False, **kw)
            _log.info("dora_num.peft: after %s: %s", self.method, report.summary())
        return out


def _install_pick_up(model: nn.Module, options: dict) -> None:
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return
    model.__dict__[_STATE] = dict(options)
    for method in _PICK_UP:
        if not isinstance(model.__dict__.get(method), _PickUpNewAdapters):
            model.__dict__[method] = _PickUpNewAdapters(model, method)


def acceleration_report(peft_model: nn.Module) -> AccelerationReport:
    """Where every PEFT DoRA (layer, adapter) of ``peft_model`` runs now, changing nothing: on this
    package's operator, or on PEFT's path and why (not supported; changed since :func:`accelerate`;
    not accelerated, e.g. added to a model that is not a ``PeftModel``)."""
    report = AccelerationReport()
    for name, mod, adapter in _dora_layers(peft_model):
        current = mod.lora_variant.get(adapter)
        why = unsupported_reason(mod, adapter)
        if isinstance(current, DoRAKernelVariant):
            report.rows.append(ModuleDecision(name, adapter, ACCELERATED) if why is None else
                               ModuleDecision(name, adapter, KEPT, f"changed since accelerate: {why}"))
        else:
            report.rows.append(ModuleDecision(name, adapter, KEPT, why or "not accelerated: call accelerate"))
    return report


def restore(peft_model: nn.Module) -> int:
    """Undo :func:`accelerate`: PEFT's own variant objects back in every layer, the model's own
    ``add_adapter``/``load_adapter`` back, the norm cache dropped from the base weights.  Returns
    the number of layer adapters restored.  A restored model holds no object of this package (it
    pickles and loads without it)."""
    n = 0
    for _, mod, adapter in _dora_layers(peft_model):
        current = mod.lora_variant.get(adapter)
        if isinstance(current, DoRAKernelVariant):
            mod.lora_variant[adapter] = current.original
            clear_base_sq_cache(mod.get_base_layer().weight)
            n += 1
        _restore_input_cast(mod)
    for key in (_STATE, *_PICK_UP):
        peft_model.__dict__.pop(key, None)
    return n


def clear_caches(model: nn.Module) -> int:
    """Drop every cache this package keeps for ``model`` (the cached ``rowsum(W*W)`` and zero-row
    mask on each base weight, each accelerated layer's cached norm); returns the number of weights
    cleared.  Needed only after a base weight or an adapter was changed in a way autograd's version
    counter does not see (``weight.data.mul_(...)``, ``weight.data = ...``: the caches are keyed on
    the storage address and the version counter, and an assignment through ``.data`` can reuse the
    address).  In-place updates of the parameters themselves (optimizers, ``with torch.no_grad():
    W.mul_(...)``) and PEFT's merge/unmerge through :func:`restore` need no call."""
    n = 0
    for _, mod, adapter in _dora_layers(model):
        current = mod.lora_variant.get(adapter)
        if isinstance(current, DoRAKernelVariant):
            current.layer.clear_norm_cache()
    for m in model.modules():
        if isinstance(m, DoRALinear):
            m.clear_norm_cache()
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            clear_base_sq_cache(w)
            n += 1
    return n


def is_accelerated(module: nn.Module, adapter: str = "default") -> bool:
    """Whether adapter ``adapter`` of the PEFT layer ``module`` runs on this package's operator."""
    return isinstance(getattr(module, "lora_variant", {}).get(adapter), DoRAKernelVariant)
