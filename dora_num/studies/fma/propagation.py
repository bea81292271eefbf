"""Notebook 02, propagation: what a contracted norm assembly, an approximate sqrt
and a contracted compose do to ``g``, to ``DoRALinear`` outputs and to the final
MiniLM sentence embeddings.

Variants (CPU emulation, exact; :mod:`dora_num.studies.fma.models`):

The method in full: docs/methods.md, studies/fma/propagation.py.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import numpy as np
import pandas as pd
import torch
from tqdm.std import tqdm

from ...adapters.model import embed, tokenize
from ...numerics.formats import get_format, round_to, ulp_distance
from ...numerics.formulas import scale_constants
from ...ops.norm import magnitude_scale
from . import models as M
from .sqrt import PROGRESS, layer_terms

G_VARIANTS = ("production", "fma_assembly", "approx_sqrt_worst", "fma_and_approx_worst")
COMPOSE_VARIANTS = {"compose_fma": ("fma",), "compose_alt": ("alt",)}


def wnorm_variants(layer) -> dict[str, np.ndarray]:
    """``wnorm`` (float64 array of fp32 values) of each variant; checks that the emulated
    production assembly equals the layer's own norm bit for bit."""
    b, c, a, w_prod = layer_terms(layer)
    _, two_s, s_sq = scale_constants(layer.scale)
    terms = {"base_sq": b, "cross": c, "ba": a, "two_s": two_s, "s_sq": s_sq}
    t = {k: M.evaluate("norm_assembly", (k, k), terms, sqrt=lambda x: x) for k in ("none", "fma")}
    out = {"production": M.sqrt_rn(t["none"]), "fma_assembly": M.sqrt_rn(t["fma"]),
           "approx_sqrt_worst": M.sqrt_other_neighbour(t["none"]),
           "fma_and_approx_worst": M.sqrt_other_neighbour(t["fma"])}
    if not np.array_equal(out["production"], w_prod):
        raise AssertionError("the emulated production assembly does not reproduce factored_row_norm bit for bit")
    return out


def g_of(layer, wnorm: np.ndarray) -> torch.Tensor:
    return magnitude_scale(layer.magnitude.detach(), torch.from_numpy(wnorm).float())


def emulated_compose(choice: tuple[str, ...]):
    """A ``compose_fn`` for :class:`~dora_num.DoRALinear`: the exact emulation of the compose
    with contraction placement ``choice``, rounded once to the activation dtype (``delta``;
    the layer adds ``base`` as it does after its own compose)."""

    def compose(base, lora, g, scale, *, path="auto", out=None):
        s = scale_constants(scale)[0]
        fmt = get_format(base.dtype)
        v = M.evaluate("compose_stable", choice, {"base": base.detach().double().numpy(),
                                                  "lora": lora.detach().double().numpy(),
                                                  "g": g.detach().double().numpy(), "s": s})
        return torch.from_numpy(round_to(v, fmt)).to(base.dtype)

    return compose


def with_compose(layer, compose_fn):
    """``layer`` composing through ``compose_fn``: a shallow copy sharing the layer's modules
    and parameters (``layer`` itself is unchanged)."""
    view = copy.copy(layer)
    view.compose_fn = compose_fn
    return view


def layer_outputs(layer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Outputs of every variant for input ``x`` (no grad)."""
    wn = wnorm_variants(layer)
    outs = {}
    with torch.no_grad():
        y_real = layer(x)
        for name in G_VARIANTS:
            outs[name] = layer(x, g=g_of(layer, wn[name]))
        y_emul = with_compose(layer, emulated_compose(("none",)))(x)
        if not (torch.equal(y_real, outs["production"]) and torch.equal(y_real, y_emul)):
            raise AssertionError("injected production g / emulated production compose differ from the real layer")
        for name, choice in COMPOSE_VARIANTS.items():
            outs[name] = with_compose(layer, emulated_compose(choice))(x)
    return outs


def _compare(y: torch.Tensor, y0: torch.Tensor, fmt) -> dict:
    d = np.abs(ulp_distance(y0.double().numpy(), y.double().numpy(), fmt))
    a, b = y.double().ravel(), y0.double().ravel()
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()))
    return {"n": int(d.size), "changed": float((d > 0).mean()), "max_ulp": int(d.max()) if d.size else 0,
            "ulp_1": float((d == 1).mean()), "ulp_2plus": float((d >= 2).mean()), "cosine_vs_production": cos,
            "max_rel_change": float((a - b).abs().max() / b.abs().max())}


def propagation_table(layers: dict, acts: dict, act_scales=(1.0,)) -> pd.DataFrame:
    """Per layer x activation scale x variant: ``g`` changes (count, ulps) and output changes."""
    rows = []
    for name, layer in tqdm(layers.items(), desc="propagation: layers", **PROGRESS):
        fmt = get_format(layer.base.weight.dtype)
        wn = wnorm_variants(layer)
        g0 = g_of(layer, wn["production"]).double().numpy()
        for sc in act_scales:
            x = (acts[name] * sc).to(layer.base.weight.dtype)
            outs = layer_outputs(layer, x)
            for var, y in outs.items():
                gv = g0 if var.startswith("compose") else g_of(layer, wn[var]).double().numpy()
                dg = np.abs(ulp_distance(g0, gv, "fp32"))
                rows.append({"layer": name, "dtype": fmt.name, "act_scale": sc, "variant": var,
                             "g_changed": float((dg > 0).mean()), "g_max_ulp": int(dg.max()),
                             **_compare(y, outs["production"], fmt)})
    return pd.DataFrame(rows)


class _WithG(torch.nn.Module):
    """A DoRA layer run with a given ``g`` (``layer(x, g=g)``), as a drop-in module."""

    def __init__(self, layer, g: torch.Tensor):
        super().__init__()
        self.layer = layer
        self.g = g

    def forward(self, x):
        return self.layer(x, g=self.g)


@contextmanager
def model_variant(model, layers: dict, variant: str):
    """``model`` with every listed linear replaced by its DoRA layer running ``variant``."""
    modules = dict(model.named_modules())
    saved = []
    for name, layer in layers.items():
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name]
        saved.append((parent, attr, getattr(parent, attr)))
        if variant in G_VARIANTS:
            layer = _WithG(layer, g_of(layer, wnorm_variants(layer)[variant]))
        elif variant in COMPOSE_VARIANTS:
            layer = with_compose(layer, emulated_compose(COMPOSE_VARIANTS[variant]))
        setattr(parent, attr, layer)
    try:
        yield model
    finally:
        for parent, attr, mod in saved:
            setattr(parent, attr, mod)


def model_table(model, tok, layers: dict, texts: list[str]) -> pd.DataFrame:
    """Final sentence embeddings of the model with every layer DoRA-wrapped, per variant,
    against the production variant: cosine similarity and ulps."""
    model = copy.deepcopy(model).to(next(iter(layers.values())).base.weight.dtype)
    batch = tokenize(tok, texts)
    outs = {}
    with torch.no_grad():
        for var in tqdm(G_VARIANTS + tuple(COMPOSE_VARIANTS), desc="model: variants", **PROGRESS):
            with model_variant(model, layers, var):
                h = model(**batch).last_hidden_state
                outs[var] = (h, embed(model, batch))
    h0, e0 = outs["production"]
    fmt = get_format(h0.dtype)
    rows = []
    for var, (h, e) in outs.items():
        cos_tok = torch.nn.functional.cosine_similarity(h.double(), h0.double(), dim=-1)
        mask = batch["attention_mask"].bool()
        cos_emb = torch.nn.functional.cosine_similarity(e.double(), e0.double(), dim=-1)
        rows.append({"dtype": fmt.name, "variant": var, "min_cosine_token": float(cos_tok[mask].min()),
                     "min_cosine_embedding": float(cos_emb.min()), "mean_cosine_embedding": float(cos_emb.mean()),
                     **{f"hidden_{k}": v for k, v in _compare(h[mask], h0[mask], fmt).items()
                        if k in ("changed", "max_ulp", "max_rel_change")}})
    return pd.DataFrame(rows)
