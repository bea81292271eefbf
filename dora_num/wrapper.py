"""DoRA on any torch / HF model in one call (:func:`wrap`), and merging for inference.

:func:`wrap` puts a :class:`~dora_num.DoRALinear` on every targeted ``nn.Linear`` in place, matching
``target_modules`` with PEFT's own function; a wrapped transformers model saves in PEFT's adapter
format.  :func:`merge` merges every layer (the original weights kept: :func:`unmerge` restores them bit
for bit) and reports each merged output's error beside its a-priori bound (lemma 10 of
docs/bounds.md); :func:`merge_and_unload` returns the plain model.  In full: docs/peft.md.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from .adapters.peft_io import (SPEC_ATTR, AdapterError, AdapterSpec, SavePeftFormat, UnsupportedAdapterError,
                                dora_linear_modules, install_save_pretrained)
from .ops.layer import DoRALinear
from .ops.products import fp32_matmul_precision
from .ops.weight_norm import clear_base_sq_cache

_log = logging.getLogger("dora_num.wrapper")
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class TrainableParameters:
    """Parameter counts of a model (as PEFT's ``print_trainable_parameters``)."""

    trainable: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return f"trainable params: {self.trainable:,d} || all params: {self.total:,d} || trainable%: {self.percent:.4f}"


def trainable_parameters(model: nn.Module) -> TrainableParameters:
    """Counts of the (distinct) trainable and all parameters of ``model``."""
    params = {id(p): p for p in model.parameters()}.values()
    return TrainableParameters(sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))


def _all_linear_names(model: nn.Module) -> list[str]:
    """PEFT's ``"all-linear"``: every ``nn.Linear`` except a ``PreTrainedModel``'s output embedding."""
    exclude = set()
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    if out is not None:
        exclude |= {n for n, m in model.named_modules() if m is out}
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in exclude]


def _matcher(target_modules, exclude_modules, modules_to_save):
    from peft.tuners.tuners_utils import check_target_module_exists

    cfg = SimpleNamespace(target_modules=target_modules, exclude_modules=exclude_modules,
                          modules_to_save=modules_to_save, target_parameters=None, layers_to_transform=None,
                          layers_pattern=None)
    return lambda name: bool(check_target_module_exists(cfg, name))


def _check_names(what: str, value) -> None:
    if value is None:
        return
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"{what} is not a valid regular expression: {e}") from None
        return
    if not isinstance(value, (list, tuple, set)) or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"{what} must be a regex string or a list of module names, got {value!r}")


def wrap(model: nn.Module, target_modules, *, r: int = 8, alpha: float = 8, use_rslora: bool = False,
         lora_dropout: float = 0.0, adapter_dtype: torch.dtype | None = torch.float32, modules_to_save=None,
         exclude_modules=None, verbose: bool = True, **layer_kwargs) -> nn.Module:
    """Put DoRA on ``model`` in place (module docstring) and return it.

    ``r``, ``alpha`` (PEFT's ``lora_alpha``, default 8 as PEFT's), ``use_rslora``,
    ``lora_dropout``: as PEFT's ``LoraConfig``; ``adapter_dtype``: dtype of A, B and m (default
    float32 whatever the base dtype, as PEFT's ``autocast_adapter_dtype=True``; None: each
    layer's W dtype).  ``layer_kwargs`` go to :class:`~dora_num.DoRALinear`.  Prints (with
    ``verbose``) and logs the trainable-parameter count (:func:`trainable_parameters`).  A
    transformers model's ``save_pretrained`` then writes the adapter in PEFT's format (module
    docstring); :func:`merge_and_unload` gives the plain model.
    A targeted module that is not an ``nn.Linear`` raises :class:`UnsupportedAdapterError`;
    no module matched raises ``ValueError``.
    """
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        targets_spec = _all_linear_names(model)
    else:
        _check_names("target_modules", target_modules)
        if target_modules is None:
            raise ValueError("target_modules is required (names, suffixes, a regex or 'all-linear')")
        targets_spec = list(target_modules) if not isinstance(target_modules, str) else target_modules
    _check_names("exclude_modules", exclude_modules)
    _check_names("modules_to_save", modules_to_save)
    if isinstance(modules_to_save, str):
        modules_to_save = [modules_to_save]
    match = _matcher(targets_spec, exclude_modules, list(modules_to_save) if modules_to_save else None)
    if dora_linear_modules(model):
        raise AdapterError("the model already has DoRALinear modules: wrap a base model")
    names = [n for n, _ in model.named_modules() if n and match(n)]
    if not names:
        raise ValueError(f"target_modules {target_modules!r} match no module of the model")
    for n in names:
        mod = model.get_submodule(n)
        if not isinstance(mod, nn.Linear) or type(mod).forward is not nn.Linear.forward:
            raise UnsupportedAdapterError(f"module {n!r} is a {type(mod).__module__}.{type(mod).__name__}: "
                                          "unsupported module type (DoRALinear wraps torch.nn.Linear)")
    save_mods = []
    for pat in modules_to_save or ():
        hits = [n for n, _ in model.named_modules() if n and re.fullmatch(rf"(.*\.)?{re.escape(pat)}", n)]
        if not hits:
            raise ValueError(f"modules_to_save entry {pat!r} matches no module of the model")
        save_mods += hits
    for p in model.parameters():
        p.requires_grad_(False)
    for n in names:
        lin = model.get_submodule(n)
        layer = DoRALinear(lin, r, alpha, use_rslora=use_rslora, lora_dropout=lora_dropout,
                           adapter_dtype=adapter_dtype, **layer_kwargs)
        layer.name = n
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    extra = {}
    for mname in save_mods:
        for pname, p in model.get_submodule(mname).named_parameters():
            p.requires_grad_(True)
            extra[f"base_model.model.{mname}.{pname}"] = f"{mname}.{pname}"
    setattr(model, SPEC_ATTR, AdapterSpec(config=None, extra=extra,
                                          modules_to_save=sorted(modules_to_save) if modules_to_save else None))
    install_save_pretrained(model)
    counts = trainable_parameters(model)
    _log.info("dora_num.wrapper: %d DoRALinear modules; %s", len(names), counts)
    if verbose:
        print(counts)
    return model


# --------------------------------------------------------------------------
# Merge for inference, with a fidelity report
# --------------------------------------------------------------------------

def gemm_units(dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """``(u_in, u_acc)`` of a GEMM with operands of ``dtype`` on ``device`` under torch's current
    flags (:mod:`dora_num.numerics.merge_bound`): fp32 accumulation, except cuBLAS's reduced
    precision reductions for 16-bit dtypes (when allowed) and TF32 inputs for fp32 (when allowed)."""
    u32 = 2.0**-24
    if dtype == torch.float64:
        return 0.0, 2.0**-53
    if torch.device(device).type != "cuda":  # the CPU's fp32 GEMM under a bf16 switch rounds its inputs to bf16
        return (2.0**-8 if dtype == torch.float32 and fp32_matmul_precision("cpu") == "bf16" else 0.0), u32
    m = torch.backends.cuda.matmul
    if dtype == torch.bfloat16:
        return 0.0, 2.0**-8 if m.allow_bf16_reduced_precision_reduction else u32
    if dtype == torch.float16:
        return 0.0, 2.0**-11 if m.allow_fp16_reduced_precision_reduction else u32
    return (2.0**-11 if fp32_matmul_precision("cuda") != "ieee" else 0.0), u32


@dataclass(frozen=True)
class MergeRow:
    """One merged layer: errors are max-abs over the probe outputs ``[N, d_out]``."""

    name: str
    dtype: str
    probe_rows: int
    max_abs_unmerged: float
    err_merged_vs_unmerged: float
    bound: float  # max of the elementwise bound
    worst_ratio: float  # max over elements of |y_m - y_u| / bound (<= 1: the bound holds)
    err_merged_vs_fp64: float
    err_unmerged_vs_fp64: float

    @property
    def rel_err(self) -> float:
        return self.err_merged_vs_unmerged / self.max_abs_unmerged if self.max_abs_unmerged else 0.0

    @property
    def rel_bound(self) -> float:
        return self.bound / self.max_abs_unmerged if self.max_abs_unmerged else 0.0

    @property
    def within_bound(self) -> bool:
        return self.worst_ratio <= 1.0


@dataclass
class MergeReport:
    rows: list = field(default_factory=list)

    @property
    def within_bound(self) -> bool:
        return all(r.within_bound for r in self.rows)

    def to_frame(self):
        import pandas as pd

        df = pd.DataFrame([r.__dict__ for r in self.rows])
        if len(df):
            df["rel_err"] = [r.rel_err for r in self.rows]
            df["rel_bound"] = [r.rel_bound for r in self.rows]
        return df

    def __str__(self) -> str:
        head = f"{'layer':40s} {'dtype':8s} {'rel err':>9s} {'rel bound':>9s} {'err/bound':>9s} {'vs fp64 m/u':>19s}"
        lines = [head] + [f"{r.name[-40:]:40s} {r.dtype:8s} {r.rel_err:9.2e} {r.rel_bound:9.2e} {r.worst_ratio:9.3f} "
                          f"{r.err_merged_vs_fp64:9.2e}/{r.err_unmerged_vs_fp64:9.2e}" for r in self.rows]
        lines.append("all within bound" if self.within_bound else "BOUND VIOLATED (a bug: please report)")
        return "\n".join(lines)


def _capture_inputs(model, mods: dict, example_inputs, rows: int) -> dict:
    got: dict = {}

    def hook(name):
        def fn(_mod, args):
            if name not in got:
                got[name] = args[0].detach().reshape(-1, args[0].shape[-1])[:rows].clone()
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                model(*example_inputs)
            else:
                model(example_inputs)
    finally:
        for h in handles:
            h.remove()
    missing = sorted(set(mods) - set(got))
    if missing:
        raise ValueError(f"example_inputs did not reach {len(missing)} DoRA layer(s), e.g. {missing[:3]}")
    return got


@torch.no_grad()
def _merge_layer(name: str, layer: DoRALinear, x: torch.Tensor) -> MergeRow:
    from .numerics.formulas import scale_constants
    from .numerics.merge_bound import merged_linear_bound
    from .oracles import dora_linear_ref64

    W, bias, A, B = layer.base.weight, layer.base.bias, layer.lora_A, layer.lora_B
    x = x.to(device=W.device, dtype=W.dtype)
    was_training = layer.training
    layer.eval()
    with torch.autocast(W.device.type, enabled=False):
        g = layer.magnitude_scale().detach()
        y_u = layer(x, g=g)
        lora_dt = torch.promote_types(A.dtype, B.dtype)
        compose_dt = torch.promote_types(lora_dt, W.dtype)
        layer.merge(g)  # with this very g
        y_m = layer(x)
    layer.train(was_training)
    s = scale_constants(layer.scale)[0]
    t = lambda v: None if v is None else v.detach().double().cpu()  # noqa: E731
    bound = torch.from_numpy(merged_linear_bound(
        t(x).numpy(), t(layer._unmerged_weight).numpy(), None if bias is None else t(bias).numpy(), t(A).numpy(),
        t(B).numpy(), t(g).numpy(), s, base_dtype=W.dtype, compose_dtype=compose_dt,
        gemm_base=gemm_units(W.dtype, W.device), gemm_compose=gemm_units(compose_dt, W.device),
        gemm_fp32=gemm_units(torch.float32, W.device)))
    diff = (y_m.double().cpu() - y_u.double().cpu()).abs()
    y64 = dora_linear_ref64(t(x), t(layer._unmerged_weight), t(bias), t(A), t(B), t(layer.magnitude), s,
                            round_scale=False)
    with torch.no_grad():
        ratio = float((diff / bound).max()) if diff.numel() else 0.0
    return MergeRow(name, str(W.dtype).removeprefix("torch."), x.shape[0], float(y_u.double().abs().max()),
                    float(diff.max()), float(bound.max()), ratio, float((y_m.double().cpu() - y64).abs().max()),
                    float((y_u.double().cpu() - y64).abs().max()))


def merge(model: nn.Module, example_inputs=None, *, probe_rows: int = 64, seed: int = 0,
          verbose: bool = False) -> MergeReport:
    """Merge every unmerged :class:`~dora_num.DoRALinear` of ``model`` (in place) and report the
    fidelity of each (module docstring).  ``example_inputs``: a tensor, a tuple of positional
    arguments or a dict of keyword arguments for ``model``; each layer's probe is its first
    ``probe_rows`` input rows in that forward (run before merging).  Without it, each layer is
    probed on ``probe_rows`` standard Gaussian rows (seeded).  A layer whose merged output
    leaves the bound is reported (``MergeReport.within_bound``) and logged as an error."""
    mods = {n: m for n, m in dora_linear_modules(model).items() if not m.merged}
    if not mods:
        raise ValueError("the model has no unmerged DoRALinear modules")
    if example_inputs is not None:
        probes = _capture_inputs(model, mods, example_inputs, probe_rows)
    else:
        gen = torch.Generator().manual_seed(seed)
        probes = {n: torch.randn(probe_rows, m.in_features, generator=gen) for n, m in mods.items()}
    report = MergeReport()
    for n, m in mods.items():
        report.rows.append(_merge_layer(n, m, probes[n]))
    if not report.within_bound:
        _log.error("dora_num.wrapper.merge: a merged layer left its error bound:\n%s", report)
    if verbose:
        print(report)
    return report


def unmerge(model: nn.Module) -> int:
    """Unmerge every merged :class:`~dora_num.DoRALinear` (original W back, bitwise); returns how many."""
    n = 0
    for m in dora_linear_modules(model).values():
        if m.merged:
            m.unmerge()
            n += 1
    return n


def merge_and_unload(model: nn.Module, example_inputs=None, *, probe_rows: int = 64, seed: int = 0,
                     verbose: bool = False) -> nn.Module:
    """The plain model: every :class:`~dora_num.DoRALinear` merged (:func:`merge`, with its fidelity
    report, for the layers not merged yet) and replaced by its base ``nn.Linear``, which holds the merged
    weight ``W' = fl_t(g (W + sBA))`` in the base dtype ``t`` (PEFT's ``merge_and_unload``).  In place;
    returns ``model``, with the :class:`MergeReport` as ``model.dora_num_merge_report`` (None where
    every layer was merged already: :func:`merge` returned its report).  The adapter record and the
    PEFT-format ``save_pretrained`` are removed, so ``save_pretrained`` / ``from_pretrained`` of the
    original class give back these outputs bit for bit.  The original weights kept by the merge are
    dropped (no :func:`unmerge` after this).  ``example_inputs``, ``probe_rows``, ``seed``,
    ``verbose``: as :func:`merge`."""
    mods = dora_linear_modules(model)
    if not mods:
        raise ValueError("the model has no DoRALinear modules: nothing to merge and unload")
    report = None
    if any(not m.merged for m in mods.values()):
        report = merge(model, example_inputs, probe_rows=probe_rows, seed=seed, verbose=verbose)
    for n, m in mods.items():
        clear_base_sq_cache(m.base.weight)
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, m.base)
    for key in (SPEC_ATTR, "save_pretrained"):
        if key != "save_pretrained" or isinstance(model.__dict__.get(key), SavePeftFormat):
            model.__dict__.pop(key, None)
    model.__dict__["dora_num_merge_report"] = report
    _log.info("dora_num.wrapper.merge_and_unload: %d DoRALinear modules merged into their base nn.Linear", len(mods))
    return model
