"""Notebook 00: the DoRA operator on a real model (all-MiniLM-L6-v2).

For every ``nn.Linear`` of the encoder: ``A`` initialised as PEFT does (through
:class:`~dora_num.ops.layer.DoRALinear`), a deterministic trained-looking
``(B, m)`` (:func:`dora_num.oracles.perturbed_adapter`), the factored and the
dense fp32 row norms against a float64 evaluation, each checked against its
a-priori bound (:mod:`dora_num.numerics.bounds`), and ``g`` at initialisation.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from tqdm.std import tqdm  # a text bar: no widget comm in a headless run

from ...numerics.bounds import dense_norm_bound, factored_norm_bound
from ...ops.layer import DoRALinear
from ...ops.norm import dense_row_norm, factored_row_norm, magnitude_scale
from ...oracles import perturbed_adapter, row_norm_ref64, row_norm_ref64_error_bound


def norm_agreement(model, *, rank: int, alpha: float, update_ratio: float, g_spread: float, seed: int,
                   layers: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per layer: errors of the factored and dense fp32 norms vs float64 with their
    bounds, and ``g`` at init and after the perturbation.  Returns ``(per_layer, per_row)``."""
    modules = dict(model.named_modules())
    rows, g_rows = [], []
    for i, name in enumerate(tqdm(layers, desc="layers", leave=False)):
        lin = modules[name]
        torch.manual_seed(seed + i)
        dora = DoRALinear.from_linear(lin, rank, alpha)
        W, A, s = lin.weight.detach(), dora.lora_A.detach(), dora.scale
        zero_B = torch.zeros_like(dora.lora_B)
        # At init (B = 0): m is the factored norm, and so is the forward's norm.
        g_init = magnitude_scale(dora.magnitude.detach(), factored_row_norm(W, A, zero_B, s))
        # m from a dense norm (PEFT's way) but the forward's norm factored: g = 1 only up to ulps.
        g_mixed = magnitude_scale(dense_row_norm(W, A, zero_B, s), factored_row_norm(W, A, zero_B, s))

        B, m = perturbed_adapter(W, A, s, seed=seed + 1000 + i, update_ratio=update_ratio, g_spread=g_spread)
        ref = row_norm_ref64(W, A, B, s)
        ref_err = row_norm_ref64_error_bound(W, A, B, s)
        fac = factored_row_norm(W, A, B, s).double()
        den = dense_row_norm(W, A, B, s).double()
        b_fac = torch.from_numpy(factored_norm_bound(W, A, B, s)) + ref_err
        b_den = torch.from_numpy(dense_norm_bound(W, A, B, s)) + ref_err
        e_fac, e_den = (fac - ref).abs(), (den - ref).abs()
        g = magnitude_scale(m, factored_row_norm(W, A, B, s)).double()
        rows.append({
            "layer": name, "d_out": W.shape[0], "d_in": W.shape[1], "rank": rank, "scale": s,
            "rel_err_factored_max": float((e_fac / ref).max()), "rel_err_dense_max": float((e_den / ref).max()),
            "bound_factored_rel_max": float((b_fac / ref).max()), "bound_dense_rel_max": float((b_den / ref).max()),
            "tightness_factored": float((e_fac / b_fac).max()), "tightness_dense": float((e_den / b_den).max()),
            "factored_within_bound": bool((e_fac <= b_fac).all()), "dense_within_bound": bool((e_den <= b_den).all()),
            "factored_vs_dense_within_bounds": bool(((fac - den).abs() <= b_fac + b_den).all()),
            "g_init_exactly_one": float((g_init == 1).double().mean()),
            "g_init_mixed_norms_exactly_one": float((g_mixed == 1).double().mean()),
            "g_init_mixed_norms_max_abs_gm1": float((g_mixed.double() - 1).abs().max()),
        })
        g_rows.append(pd.DataFrame({"layer": name, "row": np.arange(W.shape[0]), "g_minus_1": (g - 1).numpy()}))
    return pd.DataFrame(rows), pd.concat(g_rows, ignore_index=True)
