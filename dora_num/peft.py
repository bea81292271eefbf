"""PEFT drop-in: a ``PeftModel``'s DoRA ``Linear`` layers on this package's operator, in place.

:func:`accelerate` replaces, for every PEFT DoRA ``lora.Linear`` it can serve, the
adapter's entry of the layer's ``lora_variant`` table (PEFT's extension point for LoRA
variants: ``peft.tuners.lora.layer.LoraVariant``, whose ``forward`` PEFT's
``Linear.forward`` calls with the base result) by a :class:`DoRAKernelVariant`.  Its
forward runs :class:`~dora_num.DoRALinear` built by :meth:`~dora_num.DoRALinear.from_peft`
on PEFT's own parameters (the same ``nn.Parameter`` objects) and PEFT's base result
(``forward(x, base_out=result)``: the base product is not recomputed), so the factored
norm with the cached ``rowsum(W*W)``, the compose kernels and their dispatch serve the
layer while everything else stays PEFT's:

- the state dict is untouched (the variant is not a module), so ``save_pretrained``
  writes bitwise the files it writes without :func:`accelerate`, and ``from_pretrained``,
  ``load_adapter`` and the HF ``Trainer`` see a plain ``PeftModel``;
- merging (``merge_and_unload``, ``merge_adapter``, ``unmerge_adapter``) is PEFT's own
  (the variant inherits ``DoraLinearVariant``'s merge methods);
- ``set_adapter``, ``disable_adapter()`` and merged layers are handled by PEFT's
  ``Linear.forward`` before the variant is reached.

PEFT's arithmetic kept: the dropout (PEFT's module; in training with ``p > 0`` the
compose takes ``dropout(x) W^T`` as its base, as PEFT's DoRA does), ``base = result - b``,
the scale read from ``layer.scaling`` at each call (``set_scale``/``scale_layer`` work).
What differs is how ``g`` and the compose are evaluated (this package's numerical
contract); outputs and gradients are held to PEFT's through their distances to the fp64
oracle (``tests/test_peft.py``).

Not served (the module keeps PEFT's path; :func:`accelerate` reports which and why):
Embedding and Conv DoRA, quantized or otherwise non-``nn.Linear`` base layers,
``fan_in_fan_out`` (transformers' ``Conv1D``), DoRA combined with another LoRA variant,
``lora_bias``, ``ephemeral_gpu_offload``.  At call time a layer with more than one
active adapter (``set_adapter([...])``, where PEFT stacks the adapters, each taking the
previous result as its base) and a call with extra variant arguments (aLoRA offsets)
take PEFT's path too (logged once per layer).  Adapters added after :func:`accelerate`
(``load_adapter``, ``add_adapter``) get PEFT's variant: call :func:`accelerate` again.
:func:`restore` puts PEFT's variant objects back (the very objects) and drops the norm
cache from the base weights.
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
    if type(variant) is not variants.DoraLinearVariant:
        return f"the adapter's variant is {type(variant).__name__}, not plain DoRA: not supported"
    base = module.get_base_layer()
    if getattr(module, "fan_in_fan_out", False):
        return f"fan_in_fan_out=True (base {type(base).__name__} stores W transposed): not supported"
    if not isinstance(base, nn.Linear) or type(base).forward is not nn.Linear.forward:
        return f"base layer {type(base).__module__}.{type(base).__name__} is not torch.nn.Linear: not supported"
    W = base.weight
    if W.dtype not in (torch.float32, torch.bfloat16, torch.float16) or type(W) not in (nn.Parameter, torch.Tensor):
        return f"base weight is a {type(W).__name__} of dtype {W.dtype} (quantized or not floating): not supported"
    if module.lora_bias.get(adapter, False) or module.lora_B[adapter].bias is not None:
        return "lora_bias=True: not supported"
    if getattr(module, "ephemeral_gpu_offload", False):
        return "ephemeral_gpu_offload=True: not supported"
    for name, t in (("lora_A", module.lora_A[adapter].weight), ("lora_B", module.lora_B[adapter].weight),
                    ("lora_magnitude_vector", module.lora_magnitude_vector[adapter].weight)):
        if t.dtype not in ADAPTER_DTYPES or t.device != W.device:
            return f"{name} is {t.dtype} on {t.device} (base weight {W.dtype} on {W.device}): not supported"
    return None


class DoRAKernelVariant(_peft_modules()[1].DoraLinearVariant):
    """PEFT's ``DoraLinearVariant`` with its forward on :class:`~dora_num.DoRALinear`.

    ``original``: the PEFT variant object it replaces (restored by :func:`restore`; used
    for the calls this one does not serve).  ``layer``: the :class:`~dora_num.DoRALinear`
    on PEFT's parameters (:meth:`~dora_num.DoRALinear.from_peft`), re-bound at each call
    if PEFT replaced a parameter object, the dropout module or the scale.  Merging and
    unmerging are PEFT's (inherited static methods)."""

    def __init__(self, original, layer: DoRALinear, name: str):
        self.original = original
        self.layer = layer
        self.name = name
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
        for attr, p in (("lora_A", module.lora_A[adapter].weight), ("lora_B", module.lora_B[adapter].weight),
                        ("magnitude", module.lora_magnitude_vector[adapter].weight)):
            if getattr(lyr, attr) is not p:
                setattr(lyr, attr, p)
        if lyr.base is not module.get_base_layer():
            lyr.base = module.get_base_layer()
        drop = module.lora_dropout[adapter]
        if lyr.dropout is not drop:
            lyr.dropout = drop
        s = module.scaling[adapter]
        if lyr.scale != s:
            lyr.scale = float(s)
        return lyr

    def forward(self, module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        if any(v is not None for v in kwargs.values()):
            return self._fallback(f"extra arguments {sorted(kwargs)}", module, active_adapter, x, result, kwargs)
        if sum(1 for a in module.active_adapters if a in module.lora_A) > 1:
            return self._fallback("more than one active adapter (PEFT stacks them)", module, active_adapter, x,
                                  result, kwargs)
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
    """What :func:`accelerate` did, one row per PEFT DoRA (layer, adapter)."""

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


def accelerate(peft_model: nn.Module, *, verbose: bool = True, **layer_kwargs) -> AccelerationReport:
    """Run every PEFT DoRA ``Linear`` of ``peft_model`` that can be served on this package's
    operator, in place (module docstring); returns the :class:`AccelerationReport` (also
    logged on ``dora_num.peft``, and printed with ``verbose``).

    ``layer_kwargs`` go to :class:`~dora_num.DoRALinear` (e.g. ``compose_path``,
    ``chunk_bytes``).  Idempotent: layers already accelerated are reported again, adapters
    added since are accelerated now.
    """
    report = AccelerationReport()
    for name, mod, adapter in _dora_layers(peft_model):
        current = mod.lora_variant.get(adapter)
        if isinstance(current, DoRAKernelVariant):
            report.rows.append(ModuleDecision(name, adapter, ACCELERATED, "already accelerated"))
            continue
        why = unsupported_reason(mod, adapter)
        if why is not None:
            report.rows.append(ModuleDecision(name, adapter, KEPT, why))
            continue
        lyr = DoRALinear.from_peft(mod, adapter, **layer_kwargs)
        mod.lora_variant[adapter] = DoRAKernelVariant(current, lyr, name)
        active = [a for a in mod.active_adapters if a in mod.lora_A]
        note = "" if len(active) <= 1 else f"{len(active)} adapters active now: PEFT's path while more than one is"
        report.rows.append(ModuleDecision(name, adapter, ACCELERATED, note))
    for _, mod, _ in _dora_layers(peft_model):
        if any(isinstance(v, DoRAKernelVariant) for v in mod.lora_variant.values()):
            _set_input_cast(mod)
    if not report.rows:
        _log.warning("dora_num.peft.accelerate: the model has no PEFT DoRA layers")
    _log.info("%s", report.summary())
    for r in report.kept:
        _log.warning("dora_num.peft.accelerate: %s [%s] kept on PEFT's path: %s", r.name, r.adapter, r.reason)
    if verbose:
        print(report)
    return report


def restore(peft_model: nn.Module) -> int:
    """Undo :func:`accelerate`: PEFT's own variant objects back in every layer, the norm cache
    dropped from the base weights.  Returns the number of layer adapters restored."""
    n = 0
    for _, mod, adapter in _dora_layers(peft_model):
        current = mod.lora_variant.get(adapter)
        if isinstance(current, DoRAKernelVariant):
            mod.lora_variant[adapter] = current.original
            clear_base_sq_cache(mod.get_base_layer().weight)
            n += 1
        _restore_input_cast(mod)
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
