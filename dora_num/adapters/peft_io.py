"""Read and write PEFT DoRA adapters (``adapter_config.json`` + weights).

The format PEFT's ``save_pretrained`` writes (``lora_A``, ``lora_B``, ``lora_magnitude_vector`` per
module; ``s = alpha / r`` or ``alpha / sqrt(r)``); every other entry is applied or refused, never
dropped; A, B and m keep their dtypes and an unchanged adapter is written back bitwise.  Files are
untrusted: safetensors preferred, ``.bin`` only through ``torch.load(weights_only=True)``; a malformed
input raises :class:`AdapterError` naming the file or key.  The format, the round trip and the export
fields in full: docs/peft.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

_log = logging.getLogger("dora_num.adapters.peft_io")
CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<name>.+?)\.(?P<part>lora_A\.weight|lora_B\.weight|"
                  r"lora_magnitude_vector(?:\.weight)?)$")


SPEC_ATTR = "dora_num_adapter"  # attribute of a model that carries its AdapterSpec
# The magnitude key of a new export.  PEFT 0.21 writes "lora_magnitude_vector" and reads both spellings;
# transformers 5.24's from_pretrained(<adapter folder>) maps only "lora_magnitude_vector.weight" onto
# PEFT's parameter and leaves the other at its initial value (load report: MISSING), so this one
# (tests/test_wrap.py::test_save_pretrained_of_a_wrapped_model_writes_peft_s_format).
NEW_MAGNITUDE_KEY = "lora_magnitude_vector.weight"
SIDECARS = ("outside", "beside", "none")


class AdapterError(ValueError):
    """A PEFT adapter (or its base model) is missing, unreadable or inconsistent."""


class UnsupportedAdapterError(AdapterError):
    """A valid PEFT adapter entry of a kind this package does not serve (Embedding/Conv DoRA,
    ``lora_B.bias``, a base module that is not ``nn.Linear``)."""


@dataclass
class ExtraEntry:
    """A non-DoRA tensor of an adapter file: ``key`` as stored, ``name`` the model parameter
    it belongs to (``base_model.model.`` and PEFT's ``.base_layer`` removed)."""

    key: str
    name: str
    tensor: torch.Tensor


class AdapterStates(list):
    """The list of :class:`DoRAModuleState` of :func:`load_peft_dora`, plus what else the
    adapter holds: ``config`` (parsed ``adapter_config.json``), ``config_bytes`` (as stored),
    ``magnitude_suffix`` (``lora_magnitude_vector`` or ``...vector.weight``, as stored),
    ``extra`` (:class:`ExtraEntry` list: ``modules_to_save`` weights, saved biases) and
    ``source`` (the weights file)."""

    def __init__(self, states=(), *, config: dict, config_bytes: bytes, magnitude_suffix: str,
                 extra: list, source: str):
        super().__init__(states)
        self.config, self.config_bytes = config, config_bytes
        self.magnitude_suffix, self.extra, self.source = magnitude_suffix, extra, source


@dataclass
class AdapterSpec:
    """What :func:`export_peft_dora` needs to write a model's adapter: the config it was loaded
    with (None: a new one is built), its bytes as stored, the magnitude key spelling, the
    extra entries (stored key -> model parameter name) and, for a new config, the
    ``modules_to_save`` names."""

    config: dict | None
    config_bytes: bytes | None = None
    magnitude_suffix: str = NEW_MAGNITUDE_KEY
    extra: dict | None = None
    modules_to_save: list | None = None


@dataclass
class DoRAModuleState:
    """One DoRA module: frozen ``W [d_out, d_in]``, ``A [r, d_in]``, ``B [d_out, r]``, ``m [d_out]``, scale ``s``."""

    name: str
    W: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    m: torch.Tensor
    scale: float
    rank: int
    alpha: float
    use_rslora: bool
    bias: torch.Tensor | None = None


# ----------------------------------------------------------------------------
# Low-level readers.
# ----------------------------------------------------------------------------

def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, or of a ``.bin`` via ``torch.load(weights_only=True)``."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # noqa: BLE001 - any parse failure is an unreadable file
            raise AdapterError(f"cannot read {path} as safetensors: {type(e).__name__}: {e}") from e
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        if "weights_only" in msg or "Unsupported global" in msg or "GLOBAL" in msg:
            raise AdapterError(f"refused to load {path}: it is not a plain tensor file (torch.load(weights_only=True) "
                               f"rejected it; it may try to execute code when unpickled): {msg.splitlines()[0]}") from e
        raise AdapterError(f"cannot read {path} as a torch state dict: {type(e).__name__}: {msg.splitlines()[0] if msg else ''}") from e
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise AdapterError(f"{path} does not hold a dict of named tensors (got {type(obj).__name__})")
    return obj


def read_config(adapter_dir: str | os.PathLike) -> dict:
    """The adapter's config, checked to be a DoRA LoRA config with usable r and alpha."""
    path = Path(adapter_dir) / CONFIG_NAME
    if not Path(adapter_dir).is_dir():
        raise AdapterError(f"adapter folder not found: {adapter_dir}")
    if not path.is_file():
        wrapped = _wrapped_state_keys(Path(adapter_dir))
        if wrapped:
            raise AdapterError(f"{adapter_dir} holds a dora_num-wrapped model's own state dict (keys such as "
                               f"{wrapped[:2]}), not a PEFT adapter: load it into the wrapped model "
                               "(dn.wrap(base, ...).load_state_dict(...)), then write the adapter with "
                               "dn.export_peft_dora(model, dir) or a plain model with "
                               "dora_num.wrapper.merge_and_unload(model).save_pretrained(dir)")
        raise AdapterError(f"{path} is missing: not a PEFT adapter folder")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"cannot parse {path} as JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {cfg.get('peft_type')!r}, not 'LORA': not a DoRA adapter")
    if not cfg.get("use_dora", False):
        raise AdapterError(f"{path}: use_dora is not true: a plain LoRA adapter, not DoRA (no magnitude vector)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{path}: lora_alpha must be a finite number, got {alpha!r}")
    if cfg.get("fan_in_fan_out", False) not in (True, False):
        raise AdapterError(f"{path}: fan_in_fan_out must be a boolean")
    return cfg


def _wrapped_state_keys(folder: Path) -> list[str]:
    """Keys of a wrapped model's own state dict (``<module>.base.weight`` beside ``<module>.lora_A``) in
    the folder's safetensors files (read from their headers), or []."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        try:
            with safe_open(str(f), "pt") as st:
                keys = list(st.keys())
        except Exception:  # noqa: BLE001 - not a readable safetensors file: not this case
            continue
        mods = {k.removesuffix(".lora_A") for k in keys if k.endswith(".lora_A")}
        hits = sorted(k for k in keys if k.endswith(".base.weight") and k.removesuffix(".base.weight") in mods)
        if hits:
            return hits
    return []


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's rank/alpha pattern lookup: the first key matching the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def is_targeted(cfg: dict, name: str) -> bool:
    """PEFT's target rule: a regex string must match the whole name; a list entry must
    equal the name or a dot-separated suffix of it.  No ``target_modules``: anything goes."""
    tm = cfg.get("target_modules")
    if tm is None:
        return True
    if isinstance(tm, str):
        return re.fullmatch(tm, name) is not None
    return any(name == t or name.endswith("." + t) for t in tm)


def module_scale(cfg: dict, name: str, rank: int) -> tuple[float, float]:
    """``(alpha, s)`` of module ``name`` (rsLoRA: ``alpha/sqrt(r)``, else ``alpha/r``)."""
    alpha = float(_pattern_value(cfg.get("alpha_pattern"), name, cfg.get("lora_alpha", 8)))
    s = alpha / math.sqrt(rank) if cfg.get("use_rslora", False) else alpha / rank
    return alpha, s


def adapter_weights_path(adapter_dir: str | os.PathLike) -> Path:
    d = Path(adapter_dir)
    for name in (SAFETENSORS_NAME, BIN_NAME):
        if (d / name).is_file():
            return d / name
    raise AdapterError(f"{d} has neither {SAFETENSORS_NAME} nor {BIN_NAME}")


_UNSUPPORTED_KEYS = (
    (re.compile(r"\.lora_embedding_[AB]$"), "an Embedding DoRA adapter (lora_embedding_A/B)"),
    (re.compile(r"\.lora_B\.bias$"), "a lora_B bias (lora_bias=True)"),
    (re.compile(r"\.(original_module|modules_to_save)\."),
     "PEFT's internal copies of a modules_to_save module (bias='all' with modules_to_save)"),
)


def split_adapter_tensors(tensors: dict[str, torch.Tensor], source: str = "adapter"):
    """``(groups, extra, magnitude_suffix)``: ``{module name: {"A", "B", "m"}}`` of the DoRA
    entries (checked as :func:`group_adapter_tensors`), the other entries as
    :class:`ExtraEntry` objects, and how the magnitude keys are spelled.  Unsupported
    entries raise :class:`UnsupportedAdapterError` naming the key."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    extra, suffixes = [], set()
    for key, t in sorted(tensors.items()):
        for pat, what in _UNSUPPORTED_KEYS:
            if pat.search(key):
                raise UnsupportedAdapterError(f"{source}: entry {key!r} is {what}: not supported "
                                              "(DoRALinear serves Linear DoRA modules only)")
        mt = _KEY.match(key)
        if not mt:
            name = key.removeprefix(_PREFIX).replace(".base_layer.", ".")
            extra.append(ExtraEntry(key, name, t))
            continue
        if mt["part"].startswith("lora_magnitude_vector"):
            suffixes.add(mt["part"])
        part = {"lora_A.weight": "A", "lora_B.weight": "B"}.get(mt["part"], "m")
        groups.setdefault(mt["name"], {})[part] = t
    if len(suffixes) > 1:
        raise AdapterError(f"{source}: magnitude keys are spelled both 'lora_magnitude_vector' and "
                           "'lora_magnitude_vector.weight'")
    _check_groups(groups, source)
    return groups, extra, suffixes.pop() if suffixes else "lora_magnitude_vector"


def group_adapter_tensors(tensors: dict[str, torch.Tensor], source: str = "adapter") -> dict[str, dict[str, torch.Tensor]]:
    """``{module name: {"A", "B", "m"}}``; raises on missing parts or inconsistent shapes."""
    return split_adapter_tensors(tensors, source)[0]


def _check_groups(groups: dict, source: str) -> None:
    if not groups:
        raise AdapterError(f"{source}: no lora_A/lora_B/lora_magnitude_vector keys found")
    for name, g in sorted(groups.items()):
        missing = [k for k, full in (("A", "lora_A.weight"), ("B", "lora_B.weight"), ("m", "lora_magnitude_vector")) if k not in g]
        if missing:
            names = {"A": "lora_A.weight", "B": "lora_B.weight", "m": "lora_magnitude_vector"}
            if missing == ["m"]:
                raise AdapterError(f"{source}: module {name!r} has lora_A/lora_B but no lora_magnitude_vector: not a DoRA adapter")
            raise AdapterError(f"{source}: module {name!r} is missing key(s) " + ", ".join(f"{_PREFIX}{name}.{names[k]}" for k in missing))
        A, B, m = g["A"], g["B"], g["m"]
        if A.dim() in (3, 4, 5) and B.dim() == A.dim():
            raise UnsupportedAdapterError(f"{source}: module {name!r} is a Conv DoRA adapter (lora_A of shape "
                                          f"{tuple(A.shape)}): not supported (DoRALinear serves Linear DoRA modules only)")
        if A.dim() != 2 or B.dim() != 2 or m.dim() != 1:
            raise AdapterError(f"{source}: module {name!r}: expected A 2-D, B 2-D, magnitude 1-D, got shapes "
                               f"{tuple(A.shape)}, {tuple(B.shape)}, {tuple(m.shape)}")
        if B.shape[1] != A.shape[0] or m.shape[0] != B.shape[0]:
            raise AdapterError(f"{source}: module {name!r}: shape mismatch: A {tuple(A.shape)}, B {tuple(B.shape)}, "
                               f"magnitude {tuple(m.shape)} (need A [r, d_in], B [d_out, r], magnitude [d_out])")
        names = {"A": "lora_A.weight", "B": "lora_B.weight", "m": "lora_magnitude_vector"}
        for part, t in (("A", A), ("B", B), ("m", m)):
            key = f"{_PREFIX}{name}.{names[part]}"
            if not t.is_floating_point():
                raise AdapterError(f"{source}: {key} has dtype {t.dtype}; adapter tensors must be floating point")
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                raise AdapterError(f"{source}: {key} contains non-finite values ({int(torch.isnan(t).sum())} NaN, "
                                   f"{int(torch.isinf(t).sum())} Inf)")


# ----------------------------------------------------------------------------
# Base model weights.
# ----------------------------------------------------------------------------

def _base_state(base_model) -> dict[str, torch.Tensor]:
    if isinstance(base_model, nn.Module):
        return {k: v.detach() for k, v in base_model.state_dict().items()}
    if isinstance(base_model, dict):
        return base_model
    if base_model is None:
        raise AdapterError("base_model is required: the base weights W are needed to form g = m / ||W + sBA||")
    p = Path(base_model)
    if p.is_file():
        return read_weights(p)
    if not p.is_dir():
        raise AdapterError(f"base model not found: {p}")
    files = sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin")) or sorted(p.glob("*.bin"))
    if not files:
        raise AdapterError(f"base model folder {p} has no *.safetensors or *.bin weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(read_weights(f))
    return out


def _find_base_key(state: dict, name: str, suffix: str) -> str | None:
    """``name.suffix`` in the base state dict, allowing one model prefix (e.g. ``bert.``)."""
    exact = f"{name}.{suffix}"
    if exact in state:
        return exact
    hits = [k for k in state if k.endswith("." + exact)]
    if len(hits) > 1:
        raise AdapterError(f"base model mismatch: module {name!r} matches several base keys: {hits[:4]}")
    return hits[0] if hits else None


def load_peft_dora(adapter_dir: str | os.PathLike, base_model) -> AdapterStates:
    """Per-module DoRA states ``(name, W, A, B, m, scale)`` of a PEFT adapter, sorted by name.

    ``base_model``: a model folder (``*.safetensors`` / ``*.bin``), a weights file,
    an ``nn.Module`` or a state dict.  Tensors are returned as stored (dtypes kept);
    ``W`` is ``[d_out, d_in]`` (transposed back if ``fan_in_fan_out``).  The list is an
    :class:`AdapterStates`: it also carries the config and the adapter's other entries
    (``modules_to_save`` weights, saved biases), which :func:`apply_to_model` applies.
    """
    cfg = read_config(adapter_dir)
    config_bytes = (Path(adapter_dir) / CONFIG_NAME).read_bytes()
    wpath = adapter_weights_path(adapter_dir)
    groups, extra, mag_suffix = split_adapter_tensors(read_weights(wpath), str(wpath))
    state = _base_state(base_model)
    out = AdapterStates(config=cfg, config_bytes=config_bytes, magnitude_suffix=mag_suffix, extra=extra,
                        source=str(wpath))
    for name, g in sorted(groups.items()):
        A, B, m = g["A"], g["B"], g["m"]
        if not is_targeted(cfg, name):
            raise AdapterError(f"{wpath}: module {name!r} is not covered by the config's target_modules "
                               f"{cfg.get('target_modules')!r}: adapter weights and config disagree")
        rank = A.shape[0]
        want_r = int(_pattern_value(cfg.get("rank_pattern"), name, cfg["r"]))
        if rank != want_r:
            raise AdapterError(f"{wpath}: module {name!r} has rank {rank} but the config says r = {want_r}")
        wkey = _find_base_key(state, name, "weight")
        if wkey is None:
            raise AdapterError(f"base model mismatch: the adapter targets {name!r}, but the base model has no "
                               f"{name}.weight")
        W = state[wkey]
        if cfg.get("fan_in_fan_out", False):
            W = W.T
        if W.dim() != 2 or W.shape != (B.shape[0], A.shape[1]):
            raise AdapterError(f"base model mismatch: module {name!r}: base weight {wkey} has shape {tuple(W.shape)}, "
                               f"the adapter needs [d_out, d_in] = [{B.shape[0]}, {A.shape[1]}]")
        alpha, s = module_scale(cfg, name, rank)
        bkey = _find_base_key(state, name, "bias")
        out.append(DoRAModuleState(name, W, A, B, m, s, rank, alpha, bool(cfg.get("use_rslora", False)),
                                   state[bkey] if bkey else None))
    return out


# ----------------------------------------------------------------------------
# Export from DoRALinear; load back into DoRALinear.
# ----------------------------------------------------------------------------

def dora_linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    from ..ops.layer import DoRALinear

    return {n: mod for n, mod in model.named_modules() if isinstance(mod, DoRALinear)}


def model_parameter(model: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter ``name`` of ``model`` (a PEFT-style name: for a module wrapped by
    :class:`~dora_num.DoRALinear` also found under its ``.base``), or None."""
    from ..ops.layer import DoRALinear

    params = dict(model.named_parameters(remove_duplicate=False))
    if name in params:
        return params[name]
    mod, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(mod) if mod else model
    except AttributeError:
        return None
    if isinstance(owner, DoRALinear):
        return params.get(f"{mod}.base.{leaf}")
    return None


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT-keyed tensors (contiguous CPU copies, dtypes kept) of every :class:`DoRALinear` in
    ``model``, and of the model's other adapter entries (``modules_to_save`` weights, saved
    biases) recorded by :func:`apply_to_model` or :func:`dora_num.wrapper.wrap`."""
    mods = dora_linear_modules(model)
    if not mods:
        raise AdapterError("model has no DoRALinear modules to export")
    spec = getattr(model, SPEC_ATTR, None)
    mag = spec.magnitude_suffix if spec is not None else NEW_MAGNITUDE_KEY
    out = {}
    for n, mod in sorted(mods.items()):
        out[f"{_PREFIX}{n}.lora_A.weight"] = mod.lora_A.detach().cpu().contiguous().clone()
        out[f"{_PREFIX}{n}.lora_B.weight"] = mod.lora_B.detach().cpu().contiguous().clone()
        out[f"{_PREFIX}{n}.{mag}"] = mod.magnitude.detach().cpu().contiguous().clone()
    for key, name in sorted(((spec.extra or {}) if spec is not None else {}).items()):
        p = model_parameter(model, name)
        if p is None:
            raise AdapterError(f"cannot export: the adapter entry {key!r} is the model's parameter {name!r}, "
                               "which the model no longer has")
        out[key] = p.detach().cpu().contiguous().clone()
    return out


def _uniform(mods: dict, what: str, fn):
    vals = {fn(m) for m in mods.values()}
    if len(vals) != 1:
        raise AdapterError(f"cannot export one PEFT config: the DoRALinear modules mix {what} {sorted(vals)}")
    return vals.pop()


def _dropout_p(mod) -> float:
    return float(getattr(mod.dropout, "p", 0.0))


def check_config_matches(cfg: dict, mods: dict) -> None:
    """Raise unless every DoRALinear in ``mods`` is what ``cfg`` says for its name (targeted,
    rank, alpha, rsLoRA, dropout): the config written back must describe the modules."""
    for n, mod in sorted(mods.items()):
        problems = []
        if not is_targeted(cfg, n):
            problems.append(f"not covered by target_modules {cfg.get('target_modules')!r}")
        r = int(_pattern_value(cfg.get("rank_pattern"), n, cfg["r"]))
        if r != mod.rank:
            problems.append(f"rank {mod.rank}, config r = {r}")
        alpha = module_scale(cfg, n, mod.rank)[0]
        if alpha != mod.alpha:
            problems.append(f"alpha {mod.alpha}, config alpha = {alpha}")
        if bool(cfg.get("use_rslora", False)) != mod.use_rslora:
            problems.append(f"use_rslora {mod.use_rslora}, config {cfg.get('use_rslora', False)}")
        if float(cfg.get("lora_dropout", 0.0)) != _dropout_p(mod):
            problems.append(f"lora_dropout {_dropout_p(mod)}, config {cfg.get('lora_dropout', 0.0)}")
        if problems:
            raise AdapterError(f"the model's DoRALinear {n!r} no longer matches the adapter config it was loaded "
                               "with: " + "; ".join(problems))


def peft_config_json(cfg: dict) -> bytes:
    """``cfg`` as PEFT's ``PeftConfigMixin.save_pretrained`` writes it (``json.dumps(indent=2,
    sort_keys=True)``, no trailing newline)."""
    return json.dumps(cfg, indent=2, sort_keys=True).encode()


def _task_type(task_type):
    """``task_type`` checked against PEFT's ``TaskType`` (None stays None)."""
    if task_type is None:
        return None
    from peft import TaskType

    names = [t.value for t in TaskType]
    value = getattr(task_type, "value", task_type)
    if value not in names:
        raise ValueError(f"task_type must be one of PEFT's task types {names} or None, got {task_type!r}")
    return value


def _auto_mapping(model: nn.Module) -> dict:
    """PEFT's ``auto_mapping`` of a config without ``task_type`` (``PeftModel.save_pretrained``): the base
    model's class and module, from which ``AutoPeftModelFor*`` builds the base model."""
    return {"base_model_class": type(model).__name__, "parent_library": type(model).__module__}


def new_peft_config(mods: dict, *, modules_to_save=None, base_model_name_or_path=None, task_type=None,
                    auto_mapping: dict | None = None) -> dict:
    """A PEFT ``LoraConfig`` (``use_dora=True``) for the DoRALinear modules ``mods``, built by
    PEFT itself (so every field has PEFT's default) and returned as the dict its
    ``save_pretrained`` writes (with ``auto_mapping`` where given); ``target_modules`` lists the
    module names (sorted)."""
    import tempfile

    from peft import LoraConfig

    first = mods[sorted(mods)[0]]
    rank_pattern = {n: m.rank for n, m in sorted(mods.items()) if m.rank != first.rank}
    alpha_pattern = {n: m.alpha for n, m in sorted(mods.items()) if m.alpha != first.alpha}
    alpha = first.alpha
    cfg = LoraConfig(
        r=first.rank, lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        use_rslora=_uniform(mods, "use_rslora", lambda m: m.use_rslora), use_dora=True,
        target_modules=sorted(mods), rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        lora_dropout=_uniform(mods, "lora_dropout", _dropout_p), bias="none",
        modules_to_save=sorted(modules_to_save) if modules_to_save else None,
        base_model_name_or_path=base_model_name_or_path, inference_mode=True, task_type=task_type,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp, auto_mapping_dict=auto_mapping if task_type is None else None)
        out = json.loads((Path(tmp) / CONFIG_NAME).read_text())
    for key in ("target_modules", "modules_to_save", "exclude_modules"):  # sets in PEFT: make the order fixed
        if isinstance(out.get(key), list):
            out[key] = sorted(out[key])
    return out


def adapter_config(model: nn.Module, base_model_name_or_path: str | None = None, task_type=None) -> dict:
    """The PEFT ``LoraConfig`` dict (``use_dora``) for the model's DoRALinear modules: the config
    the adapter was loaded with (checked to still describe the modules), or a new one; the fields
    PEFT's ``save_pretrained`` fills filled as it fills them (module docstring)."""
    return _config_and_bytes(model, base_model_name_or_path, task_type)[0]


def _config_and_bytes(model: nn.Module, base_model_name_or_path: str | None, task_type=None):
    mods = dora_linear_modules(model)
    if not mods:
        raise AdapterError("model has no DoRALinear modules to export")
    task_type = _task_type(task_type)
    # PEFT's save_pretrained: a missing base_model_name_or_path from the model's name_or_path
    known_name = model.__dict__.get("name_or_path") or None
    spec = getattr(model, SPEC_ATTR, None)
    if spec is not None and spec.config is not None:
        check_config_matches(spec.config, mods)
        cfg = dict(spec.config)
        if base_model_name_or_path is not None or cfg.get("base_model_name_or_path") is None:
            cfg["base_model_name_or_path"] = base_model_name_or_path or known_name
        if task_type is not None:
            cfg["task_type"] = task_type
        elif cfg.get("task_type") is None and cfg.get("auto_mapping") is None:
            cfg["auto_mapping"] = _auto_mapping(model)
        if cfg == spec.config:  # written back as it was loaded
            return cfg, spec.config_bytes if spec.config_bytes is not None else peft_config_json(cfg)
        return cfg, peft_config_json(cfg)
    mts = spec.modules_to_save if spec is not None else None
    cfg = new_peft_config(mods, modules_to_save=mts, base_model_name_or_path=base_model_name_or_path or known_name,
                          task_type=task_type, auto_mapping=_auto_mapping(model))
    return cfg, peft_config_json(cfg)


def export_peft_dora(model: nn.Module, out_dir: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                     task_type=None, sidecars: str | None = None, **prov) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's format:
    ``PeftModel.from_pretrained`` and ``AutoPeftModelFor*`` load it.  A model loaded by
    :func:`apply_to_model` is written back as it was loaded (same config bytes, same keys;
    values as they are now), fields PEFT leaves empty filled as PEFT's ``save_pretrained``
    fills them (module docstring).

    ``base_model_name_or_path``: PEFT's field (default: the config's, else the model's
    ``name_or_path``); ``task_type``: PEFT's ``TaskType`` (e.g. ``"CAUSAL_LM"``; default the
    config's, and for a new config None with PEFT's ``auto_mapping``).  ``sidecars``: where the
    provenance records (:mod:`dora_num.repro.provenance`) go: ``"outside"`` (in
    ``<out_dir>.provenance/``, beside the folder: the folder holds only PEFT's files, so an upload of
    it carries nothing else), ``"beside"`` (``<file>.provenance.json`` in the folder: the layout of
    every artifact under ``data/``, which ``dora_num.repro.check`` verifies) or ``"none"``.  Default:
    ``"beside"`` where provenance arguments (``params``, ``seed``, ``producer``, ...: the project's
    recorders) are given, else ``"outside"``."""
    from safetensors.torch import save

    from ..repro.provenance import write_artifact

    sidecars = sidecars if sidecars is not None else ("beside" if prov else "outside")
    if sidecars not in SIDECARS:
        raise ValueError(f"sidecars must be one of {SIDECARS}, got {sidecars!r}")
    out_dir = Path(out_dir)
    _, config_bytes = _config_and_bytes(model, base_model_name_or_path, task_type)
    tensors = adapter_state_dict(model)
    files = {SAFETENSORS_NAME: save(tensors, metadata={"format": "pt"}), CONFIG_NAME: config_bytes}
    if sidecars == "none":
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out_dir / name).write_bytes(data)
        return out_dir
    prov.setdefault("producer", "dora_num.adapters.peft_io.export_peft_dora")
    for name, data in files.items():
        write_artifact(out_dir / name, data, **prov)
        if sidecars == "outside":  # written beside by the provenance helper, moved out of the folder
            side = out_dir / f"{name}.provenance.json"
            if side.is_file():
                dest = out_dir.parent / f"{out_dir.name}.provenance"
                dest.mkdir(exist_ok=True)
                os.replace(side, dest / side.name)
    return out_dir


class SavePeftFormat:
    """``save_pretrained`` of a transformers model wrapped by this package (set on the model by
    :func:`apply_to_model` and :func:`dora_num.wrapper.wrap`): writes the DoRA adapter in PEFT's format
    (:func:`export_peft_dora`, no provenance files), as a ``PeftModel``'s ``save_pretrained`` does,
    instead of the wrapped model's own state dict (``q_proj.base.weight``, ``q_proj.lora_A``, ...: keys
    a plain model's ``from_pretrained`` would re-initialise every targeted weight from).  A plain
    checkpoint: ``dora_num.wrapper.merge_and_unload(model).save_pretrained(dir)``.  The HF ``Trainer``'s
    ``save_model`` and checkpoints go through it too (its ``state_dict=`` is not used: the adapter is
    read from the modules)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *, is_main_process: bool = True, state_dict=None,
                 safe_serialization: bool = True, max_shard_size=None, push_to_hub: bool = False,
                 base_model_name_or_path: str | None = None, task_type=None, **kwargs) -> Path | None:
        if kwargs:
            raise TypeError(f"save_pretrained of a dora_num-wrapped model (PEFT's adapter format) does not take "
                            f"{sorted(kwargs)}")
        if push_to_hub:
            raise ValueError("save_pretrained(push_to_hub=True) of a dora_num-wrapped model: call "
                             "model.push_to_hub(repo_id) (it saves through this method)")
        if not safe_serialization:
            raise ValueError("a dora_num-wrapped model saves its adapter as safetensors only")
        if not is_main_process:
            return None
        out = export_peft_dora(self.model, save_directory, base_model_name_or_path=base_model_name_or_path,
                               task_type=task_type, sidecars="none")
        _log.info("dora_num: save_pretrained of a wrapped model wrote its DoRA adapter in PEFT's format to %s "
                  "(a plain model: dora_num.wrapper.merge_and_unload(model).save_pretrained(dir))", out)
        return out


def install_save_pretrained(model: nn.Module) -> None:
    """Give a wrapped transformers model (``PreTrainedModel``) the :class:`SavePeftFormat` ``save_pretrained``."""
    transformers = sys.modules.get("transformers")  # not imported: the model is not one of its models
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        model.__dict__["save_pretrained"] = SavePeftFormat(model)


def _check_linear(name: str, mod) -> None:
    from ..ops.layer import DoRALinear

    if isinstance(mod, DoRALinear):
        raise AdapterError(f"module {name!r} is already a DoRALinear (apply the adapter to the base model)")
    if not isinstance(mod, nn.Linear) or type(mod).forward is not nn.Linear.forward:
        extra = (" (transformers' Conv1D stores W transposed: PEFT's fan_in_fan_out)"
                 if type(mod).__name__ == "Conv1D" else "")
        raise UnsupportedAdapterError(f"module {name!r} is a {type(mod).__module__}.{type(mod).__name__}{extra}: "
                                      "unsupported module type (DoRALinear wraps torch.nn.Linear)")


def _exact_copy_source(e: ExtraEntry, p: torch.Tensor, round_extra: bool) -> torch.Tensor:
    t = e.tensor
    if tuple(t.shape) != tuple(p.shape):
        raise AdapterError(f"adapter entry {e.key!r} has shape {tuple(t.shape)} but the model's parameter "
                           f"{e.name!r} has {tuple(p.shape)}")
    if t.dtype != p.dtype and not round_extra and not torch.equal(t.to(p.dtype).to(t.dtype), t):
        raise AdapterError(f"adapter entry {e.key!r} is {t.dtype} but the model's parameter {e.name!r} is "
                           f"{p.dtype}: copying would round it (load the model in {t.dtype}, or pass "
                           "round_extra=True to round it as PEFT's loader does)")
    return t


@torch.no_grad()
def apply_to_model(model: nn.Module, states: list[DoRAModuleState], *, freeze: bool = True,
                   round_extra: bool = False, **dora_kwargs) -> nn.Module:
    """Wrap the base ``model``'s linears named in ``states`` by :class:`DoRALinear` holding A, B, m
    (in place; the dtypes of A, B and m are kept), and apply the adapter's other entries.

    With :class:`AdapterStates` (from :func:`load_peft_dora`): ``lora_dropout`` comes from
    the config (unless given in ``dora_kwargs``); every other entry of the file
    (``modules_to_save`` weights, biases saved with ``bias="all"/"lora_only"``) is copied
    into the model parameter of its name and made trainable; the adapter is recorded on
    the model (:data:`SPEC_ATTR`) for :func:`export_peft_dora`, and a transformers model's
    ``save_pretrained`` writes that format (:class:`SavePeftFormat`).  ``freeze``: every other
    parameter of the model gets ``requires_grad=False`` (as PEFT's loader).  An extra entry
    whose dtype differs from its parameter's is copied only if that is exact, or with
    ``round_extra=True`` (PEFT's loader rounds it silently).  Everything is
    checked before anything is changed: an entry that cannot be applied raises
    :class:`AdapterError` (an unsupported module type :class:`UnsupportedAdapterError`).
    """
    from ..ops.layer import DoRALinear

    cfg = getattr(states, "config", None)
    extra = list(getattr(states, "extra", []))
    kwargs = dict(dora_kwargs)
    if cfg is not None:
        kwargs.setdefault("lora_dropout", float(cfg.get("lora_dropout", 0.0)))
    targets = []
    for st in states:
        try:
            lin = model.get_submodule(st.name)
        except AttributeError:
            raise AdapterError(f"base model mismatch: the adapter targets {st.name!r}, which the model does "
                               "not have") from None
        _check_linear(st.name, lin)
        if tuple(lin.weight.shape) != tuple(st.W.shape):
            raise AdapterError(f"base model mismatch: {st.name!r} has weight {tuple(lin.weight.shape)}, "
                               f"adapter needs {tuple(st.W.shape)}")
        targets.append((st, lin))
    extra_params = []
    for e in extra:
        p = model_parameter(model, e.name)
        if p is None:
            raise AdapterError(f"adapter entry {e.key!r} cannot be applied: the model has no parameter {e.name!r}")
        extra_params.append((e, p, _exact_copy_source(e, p, round_extra)))
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    for st, lin in targets:
        dev = lin.weight.device
        mod = DoRALinear(lin, st.rank, st.alpha, use_rslora=st.use_rslora, **kwargs,
                         lora_A=nn.Parameter(st.A.detach().to(dev).clone()),
                         lora_B=nn.Parameter(st.B.detach().to(dev).clone()),
                         magnitude=nn.Parameter(st.m.detach().to(dev).clone()))
        if mod.scale != st.scale:
            raise AdapterError(f"module {st.name!r}: scale {mod.scale} differs from the adapter's {st.scale}")
        mod.name = st.name
        parent, _, child = st.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, mod)
    for e, p, t in extra_params:
        p.copy_(t)
        p.requires_grad_(True)
    if cfg is not None:
        setattr(model, SPEC_ATTR, AdapterSpec(config=cfg, config_bytes=getattr(states, "config_bytes", None),
                                              magnitude_suffix=states.magnitude_suffix,
                                              extra={e.key: e.name for e in extra}))
        install_save_pretrained(model)
    return model


def load_adapter(model: nn.Module, adapter_dir: str | os.PathLike, **dora_kwargs) -> nn.Module:
    """``apply_to_model(model, load_peft_dora(adapter_dir, model))``: a PEFT DoRA adapter folder
    (as ``save_pretrained`` writes it) onto the base ``model``, in place."""
    return apply_to_model(model, load_peft_dora(adapter_dir, model), **dora_kwargs)
