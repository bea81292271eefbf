"""Read and write PEFT DoRA adapters (``adapter_config.json`` + weights).

Format (PEFT >= 0.9; what ``PeftModel.save_pretrained`` writes):

* ``adapter_config.json``: ``peft_type == "LORA"``, ``use_dora == true``, ``r``,
  ``lora_alpha``, ``use_rslora``, ``target_modules``, optional per-module
  ``rank_pattern`` / ``alpha_pattern``, ``fan_in_fan_out``.
* ``adapter_model.safetensors`` (or legacy ``adapter_model.bin``) with, per
  module ``<name>``: ``base_model.model.<name>.lora_A.weight [r, d_in]``,
  ``...lora_B.weight [d_out, r]``, ``...lora_magnitude_vector [d_out]``
  (older writers add ``.weight`` to the magnitude key; both are read).

Scale: ``s = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA.

Files are untrusted (docs/contract.md, promise 6): safetensors is preferred; a ``.bin`` is read
only with ``torch.load(weights_only=True)``, so a pickle that tries to run code is
refused.  Every malformed input raises :class:`AdapterError` (a ``ValueError``)
naming the file or key and the problem.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<name>.+?)\.(?P<part>lora_A\.weight|lora_B\.weight|"
                  r"lora_magnitude_vector(?:\.weight)?)$")


class AdapterError(ValueError):
    """A PEFT adapter (or its base model) is missing, unreadable or inconsistent."""


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


def group_adapter_tensors(tensors: dict[str, torch.Tensor], source: str = "adapter") -> dict[str, dict[str, torch.Tensor]]:
    """``{module name: {"A", "B", "m"}}``; raises on missing parts or inconsistent shapes."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        mt = _KEY.match(key)
        if not mt:
            continue  # e.g. modules_to_save entries: not part of the DoRA state
        part = {"lora_A.weight": "A", "lora_B.weight": "B"}.get(mt["part"], "m")
        groups.setdefault(mt["name"], {})[part] = t
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
        if A.dim() != 2 or B.dim() != 2 or m.dim() != 1:
            raise AdapterError(f"{source}: module {name!r}: expected A 2-D, B 2-D, magnitude 1-D, got shapes "
                               f"{tuple(A.shape)}, {tuple(B.shape)}, {tuple(m.shape)} (only Linear DoRA modules are supported)")
        if B.shape[1] != A.shape[0] or m.shape[0] != B.shape[0]:
            raise AdapterError(f"{source}: module {name!r}: shape mismatch: A {tuple(A.shape)}, B {tuple(B.shape)}, "
                               f"magnitude {tuple(m.shape)} (need A [r, d_in], B [d_out, r], magnitude [d_out])")
    return groups


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


def load_peft_dora(adapter_dir: str | os.PathLike, base_model) -> list[DoRAModuleState]:
    """Per-module DoRA states ``(name, W, A, B, m, scale)`` of a PEFT adapter, sorted by name.

    ``base_model``: a model folder (``*.safetensors`` / ``*.bin``), a weights file,
    an ``nn.Module`` or a state dict.  Tensors are returned as stored (no copy of
    dtype); ``W`` is ``[d_out, d_in]`` (transposed back if ``fan_in_fan_out``).
    """
    cfg = read_config(adapter_dir)
    wpath = adapter_weights_path(adapter_dir)
    groups = group_adapter_tensors(read_weights(wpath), str(wpath))
    state = _base_state(base_model)
    out = []
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


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT-keyed tensors (contiguous CPU copies) of every :class:`DoRALinear` in ``model``."""
    mods = dora_linear_modules(model)
    if not mods:
        raise AdapterError("model has no DoRALinear modules to export")
    out = {}
    for n, mod in sorted(mods.items()):
        out[f"{_PREFIX}{n}.lora_A.weight"] = mod.lora_A.detach().cpu().contiguous().clone()
        out[f"{_PREFIX}{n}.lora_B.weight"] = mod.lora_B.detach().cpu().contiguous().clone()
        out[f"{_PREFIX}{n}.lora_magnitude_vector"] = mod.magnitude.detach().cpu().contiguous().clone()
    return out


def adapter_config(model: nn.Module, base_model_name_or_path: str | None = None) -> dict:
    """A PEFT ``LoraConfig`` dict (``use_dora``) for the model's DoRALinear modules."""
    mods = dora_linear_modules(model)
    if not mods:
        raise AdapterError("model has no DoRALinear modules to export")
    rslora = {m.use_rslora for m in mods.values()}
    if len(rslora) != 1:
        raise AdapterError("cannot export: DoRALinear modules mix use_rslora True and False")
    first = next(iter(sorted(mods.items())))[1]
    rank_pattern = {n: m.rank for n, m in mods.items() if m.rank != first.rank}
    alpha_pattern = {n: m.alpha for n, m in mods.items() if m.alpha != first.alpha}
    return {
        "peft_type": "LORA", "use_dora": True, "r": first.rank, "lora_alpha": first.alpha,
        "use_rslora": rslora.pop(), "target_modules": sorted(mods), "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
    }


def export_peft_dora(model: nn.Module, out_dir: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                     **prov) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (with provenance sidecars)."""
    from safetensors.torch import save

    from ..repro.provenance import write_artifact

    out_dir = Path(out_dir)
    cfg = adapter_config(model, base_model_name_or_path)
    tensors = adapter_state_dict(model)
    prov.setdefault("producer", "dora_num.adapters.peft_io.export_peft_dora")
    write_artifact(out_dir / SAFETENSORS_NAME, save(tensors, metadata={"format": "pt"}), **prov)
    write_artifact(out_dir / CONFIG_NAME, (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode(), **prov)
    return out_dir


@torch.no_grad()
def apply_to_model(model: nn.Module, states: list[DoRAModuleState], **dora_kwargs) -> nn.Module:
    """Wrap the base ``model``'s linears named in ``states`` by :class:`DoRALinear` holding A, B, m (in place)."""
    from ..ops.layer import DoRALinear

    for st in states:
        lin = model.get_submodule(st.name)
        if not isinstance(lin, nn.Linear):
            raise AdapterError(f"base model mismatch: {st.name!r} is a {type(lin).__name__}, not nn.Linear")
        if tuple(lin.weight.shape) != tuple(st.W.shape):
            raise AdapterError(f"base model mismatch: {st.name!r} has weight {tuple(lin.weight.shape)}, adapter needs {tuple(st.W.shape)}")
        mod = DoRALinear(lin, st.rank, st.alpha, use_rslora=st.use_rslora, **dora_kwargs)
        mod.lora_A.copy_(st.A)
        mod.lora_B.copy_(st.B)
        mod.magnitude.copy_(st.m)
        parent, _, child = st.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, mod)
    return model
