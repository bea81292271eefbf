"""Collapse analysis of real DoRA adapters: per module and format.

For every module of an adapter, ``g = m / ||W + s B A||_row`` is formed from the
stored (fp32) magnitude and the row norm evaluated in float64
(:func:`g_fp64`; relative error below ``(r + d_in + 2) 2^-53``, i.e. ~1e-13:
eight orders of magnitude below the narrowest format spacing studied, so every
zone test below is decided correctly unless g lies within ~1e-13 of a zone end).

Per module x format, :func:`collapse_table` reports

The method in full: docs/methods.md, adapters/collapse.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from ..numerics.collapse import absorption_fraction, collapse_stats
from ..numerics.formats import NARROW_FORMATS, get_format, round_to
from ..oracles import row_norm_ref64

QUANTILES = (0.1, 0.5, 0.9, 0.99)
POOLED = "(all modules)"
# Activations for the absorption column (:func:`analyse_adapter`): this many validation summaries, this many
# token rows per module (a seeded sample), the base model evaluated in float64.  float64 so that the rounded
# activations do not depend on the CPU: fp32 forwards differ in the last bits between machines (BLAS kernel
# choice), which moves values across rounding boundaries of the narrow formats; float64 differences (~1e-16)
# decide a bf16/fp16/fp8 rounding only for values within 1e-16 of a rounding boundary.
ACTIVATION_TEXTS = 32
ACTIVATION_ROWS = 256


@torch.no_grad()
def g_fp64(W, A, B, m, scale: float) -> np.ndarray:
    """``g = m / ||W + s B A||_row`` in float64 (``m`` as stored, ``s = fl32(scale)``), the
    norm :func:`dora_num.oracles.row_norm_ref64`.

    Not exact: the float64 dense evaluation has relative error below
    ``(r + d_in + 2) * 2^-53`` (summation bounds for ``BA``, the row sum of
    squares and the sqrt), about 2e-13 for MiniLM.
    """
    norm = row_norm_ref64(W, A, B, scale)
    if bool((norm == 0).any()):
        raise ValueError("a row of W + sBA is exactly zero: g = m / 0 is undefined there")
    return (m.detach().double() / norm).cpu().numpy()


def g_from_states(states, *, progress: bool = False) -> dict[str, np.ndarray]:
    """``{module name: g (float64)}`` for :class:`~dora_num.adapters.peft_io.DoRAModuleState` s."""
    from tqdm.std import tqdm  # a text bar: no widget comm in a headless notebook run

    return {st.name: g_fp64(st.W, st.A, st.B, st.m, st.scale)
            for st in tqdm(states, desc="g per module", unit="module", disable=not progress, leave=False)}


def _row(module: str, fmt, g: np.ndarray, x: np.ndarray | None) -> dict:
    st = collapse_stats(g, fmt)
    d = np.abs(g - 1.0)
    row = {"module": module, **st}
    for q in QUANTILES:
        row[f"abs_gm1_q{int(round(q * 100)):02d}"] = float(np.quantile(d, q))
    if x is not None:
        xr = round_to(x, fmt)
        ok = np.isfinite(xr)  # values beyond the format's range (fp8) are not stored activations
        row["absorption"] = absorption_fraction(np.broadcast_to(g, xr.shape)[ok], xr[ok], fmt) if ok.any() else float("nan")
        row["n_activations"] = int(ok.sum())
    else:
        row["absorption"] = float("nan")
        row["n_activations"] = 0
    return row


def collapse_table(g_by_module: dict[str, np.ndarray], formats=NARROW_FORMATS, *, activations: dict | None = None,
                   pooled: bool = True):
    """One row per module x format (plus a pooled row per format); a pandas DataFrame.

    ``g_by_module``: ``{name: g}`` (1-D, float64 preferred).  ``activations``:
    optional ``{name: x [tokens, d_out]}`` base activations ``x W^T`` of the
    module (float64/fp32), for the value-level absorption column.
    """
    import pandas as pd

    if not isinstance(g_by_module, dict) or not g_by_module:
        raise ValueError("g_by_module must be a non-empty dict {module name: g vector}")
    fmts = [get_format(f) for f in formats]
    if not fmts:
        raise ValueError("formats must name at least one format")
    rows = []
    for name in sorted(g_by_module):
        g = np.asarray(g_by_module[name], dtype=np.float64)
        if g.ndim != 1:
            raise ValueError(f"g of module {name!r} must be 1-D, got shape {g.shape}")
        x = None
        if activations is not None and name in activations:
            x = np.asarray(activations[name], dtype=np.float64).reshape(-1, g.shape[0])
        for f in fmts:
            rows.append(_row(name, f, g, x))
    if pooled and len(g_by_module) > 1:
        allg = np.concatenate([np.asarray(g_by_module[n], dtype=np.float64) for n in sorted(g_by_module)])
        df_mod = pd.DataFrame(rows)
        for f in fmts:
            r = _row(POOLED, f, allg, None)
            sub = df_mod[df_mod["format"] == f.name]
            if sub["n_activations"].sum() > 0:  # activation-weighted mean of the per-module fractions
                w = sub["n_activations"].to_numpy()
                r["absorption"] = float(np.nansum(sub["absorption"].to_numpy() * w) / w.sum())
                r["n_activations"] = int(w.sum())
            rows.append(r)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------
# Real activations of the base model's adapted layers.
# ----------------------------------------------------------------------------

def _resolve_module(model: torch.nn.Module, name: str):
    """The module ``name`` or, for names saved with a task-head prefix, its longest suffix present."""
    mods = dict(model.named_modules())
    if name in mods:
        return mods[name]
    parts = name.split(".")
    for i in range(1, len(parts)):
        if ".".join(parts[i:]) in mods:
            return mods[".".join(parts[i:])]
    return None


@torch.no_grad()
def base_activations(model: torch.nn.Module, tok, names: list[str], texts: list[str], *, max_rows: int = 256,
                     max_len: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """``{name: x W^T}`` (float64, at most ``max_rows`` token rows, a seeded sample) of each named linear
    when ``model`` runs on ``texts``.  Names not found in the model are skipped."""
    from .model import tokenize

    batch = tokenize(tok, texts, max_len)
    keep = batch["attention_mask"].reshape(-1).bool()  # real tokens only
    gen = torch.Generator().manual_seed(seed)
    res: dict[str, np.ndarray] = {}
    hooks = []
    for n in names:
        mod = _resolve_module(model, n)
        if mod is None or not hasattr(mod, "weight") or getattr(mod, "weight", None) is None or mod.weight.dim() != 2:
            continue

        def hook(m, inp, _out, n=n):
            # Reduced to the sampled rows at once (not kept for every token): the capture
            # then costs max_rows rows per module, not the whole batch.
            if n in res:
                raise ValueError(f"module {n!r} ran twice in one forward: its activations are ambiguous")
            x = torch.nn.functional.linear(inp[0], m.weight).reshape(-1, m.weight.shape[0])
            if x.shape[0] == keep.shape[0]:
                x = x[keep]
            if x.shape[0] > max_rows:
                x = x[torch.randperm(x.shape[0], generator=gen)[:max_rows].sort().values]
            res[n] = x.double().numpy()

        hooks.append(mod.register_forward_hook(hook))
    try:
        model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return res


def analyse_adapter(adapter_dir: str | os.PathLike, base_dir: str | os.PathLike | None = None, *,
                    formats=NARROW_FORMATS, activations: bool = True, n_texts: int = ACTIVATION_TEXTS,
                    max_rows: int = ACTIVATION_ROWS, progress: bool = False):
    """``collapse_table`` of the PEFT DoRA adapter in ``adapter_dir`` on the base model in ``base_dir``.

    Activations come from running the base model (transformers ``AutoModel`` +
    tokenizer from ``base_dir``, in float64: :data:`ACTIVATION_TEXTS`) on ``n_texts``
    validation summaries of the corpus; if the base model cannot be run that way, the absorption column is
    NaN and a warning is printed (g statistics need only the weights).  The base weights
    are held once: the adapter's ``W`` are the loaded model's own tensors, and the model is
    converted to float64 in place once g is formed.
    """
    import warnings

    from .model import load_base_model, minilm_path
    from .peft_io import load_peft_dora, read_config

    cfg = read_config(adapter_dir)
    if base_dir is None:
        named = cfg.get("base_model_name_or_path") or ""
        if named and Path(named).is_dir():
            base_dir = Path(named)
        elif named.endswith("all-MiniLM-L6-v2"):
            base_dir = minilm_path()
        elif "all-MiniLM-L6-v2" in named and "bf16-rounded" in named:  # the H200 runs' base (notebook 01)
            raise ValueError(f"{adapter_dir} was trained on the bf16-rounded copy of all-MiniLM-L6-v2, not on the "
                             "packaged fp32 model (its g would differ): write the copy with `dora-num record carry "
                             "DIR` (45 MB, seconds) and pass --base DIR")
        else:
            raise ValueError(f"base model of {adapter_dir} is {named!r}, not a folder on disk: pass --base MODEL_DIR")
    model = tok = None
    if activations:
        try:
            model, tok = load_base_model(base_dir)
        except Exception as e:  # noqa: BLE001 - g statistics stay valid without activations
            warnings.warn(f"could not run the base model for activations ({type(e).__name__}: {e}); "
                          "absorption left as NaN", stacklevel=2)
    # W from the loaded model when there is one (one copy of the base weights), else from the files
    states = load_peft_dora(adapter_dir, model if model is not None else base_dir)
    g = g_from_states(states, progress=progress)
    del states
    acts = None
    if model is not None:
        try:
            from .corpus import load_corpus

            model = model.double()  # in place: the fp32 weights upcast exactly, then freed
            texts = [p["summary"] for p in load_corpus(split="validation")[:n_texts]]
            if progress:
                print(f"running the base model on {len(texts)} texts for the absorption column", file=sys.stderr)
            acts = base_activations(model, tok, sorted(g), texts, max_rows=max_rows)
        except Exception as e:  # noqa: BLE001 - g statistics stay valid without activations
            warnings.warn(f"could not run the base model for activations ({type(e).__name__}: {e}); "
                          "absorption left as NaN", stacklevel=2)
    return collapse_table(g, formats, activations=acts)
