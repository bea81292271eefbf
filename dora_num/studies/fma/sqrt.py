"""Notebook 02, the exact CPU study: FMA contraction and square-root rounding in the
norm assembly and the compose.

For every contraction site of :mod:`dora_num.numerics.formulas` (found by
:func:`~dora_num.studies.fma.models.contraction_sites`) and every placement of
contractions, the formula is evaluated exactly (one rounding per operation, a
contracted site rounded once) and compared, element by element, with

- the production sequence (no contraction, correctly rounded sqrt): how many
  results change and by how many ulps;
- the exact result of the formula for the same inputs, rounded once
  (:mod:`dora_num.numerics.ground_truth`): is the contracted result better?

The method in full: docs/methods.md, studies/fma/sqrt.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as Fn
from tqdm.std import tqdm

from ...adapters.corpus import load_corpus
from ...adapters.model import tokenize
from ...numerics.formats import quantum, round_to, ulp_distance
from ...numerics.formulas import scale_constants
from ...numerics.ground_truth import assembly_exact, compose_exact
from ...ops.layer import DoRALinear
from ...ops.config import override
from ...ops.norm import factored_row_norm, factored_terms
from ...oracles import perturbed_adapter
from .. import inputs
from ..cancellation.datasets import TRAINED
from . import models as M

# notebook 01's trained adapter in PEFT format, the one committed (run r16_lr0.001)
TRAINED_ADAPTER = TRAINED.subset("export_config", "export_weights")

SQRT_MODELS = ("rn", "faithful_other")
# Progress of the long loops: a text bar on stderr (tqdm.std), never an ipywidgets bar, whose comm a
# headless notebook run cannot answer; the rendered pages drop stderr.
PROGRESS = {"leave": False, "mininterval": 2.0}
Q_BINS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 0.5, np.inf)  # bins of q = removed error / ulp(site result)


@dataclass
class AssemblyInputs:
    """fp32 row terms (float64 arrays of fp32 values) and the adapter scale."""

    base_sq: np.ndarray
    cross: np.ndarray
    ba: np.ndarray
    s: float
    category: np.ndarray  # a label per row

    def terms(self) -> dict:
        s, two_s, s_sq = scale_constants(self.s)
        return {"base_sq": self.base_sq, "cross": self.cross, "ba": self.ba, "two_s": two_s, "s_sq": s_sq}


@dataclass
class ComposeInputs:
    """Flattened compose inputs: ``base``, ``lora`` (fp32 values), ``g`` per element, scale."""

    base: np.ndarray
    lora: np.ndarray
    g: np.ndarray
    s: float
    category: np.ndarray


# --------------------------------------------------------------------------
# Inputs (drawn by :mod:`dora_num.studies.inputs`; the adversarial sets are
# ``AssemblyInputs(**inputs.fma_assembly(n, s, seed))`` and
# ``ComposeInputs(**inputs.fma_compose(n, s, seed))``)
# --------------------------------------------------------------------------

def gpu_suite_sizes() -> dict:
    """The sizes the GPU suite draws its FMA inputs at (the seeded streams depend on
    them, so a prefix must be cut from a draw of the full size)."""
    rows, cols = inputs.SUITE_FMA_COMPOSE_SHAPE
    return {"norm": inputs.SUITE_FMA_N, "compose_rows": rows, "compose_cols": cols}


def gpu_suite_assembly_inputs(n: int, n_total: int | None = None) -> AssemblyInputs:
    """The first ``n`` of the GPU suite's ``n_total`` norm-assembly inputs
    (:func:`~dora_num.studies.inputs.suite_assembly`; default: the suite's full size)."""
    n_total = gpu_suite_sizes()["norm"] if n_total is None else n_total
    if n > n_total:
        raise ValueError(f"n={n} exceeds n_total={n_total}")
    b, c, a = (v[:n].astype(np.float64) for v in inputs.suite_assembly(n_total))
    return AssemblyInputs(b, c, a, inputs.SUITE_FMA_SCALE, np.full(n, "gpu_suite", dtype=object))


def gpu_suite_compose_inputs(rows: int, cols: int, rows_total: int | None = None) -> ComposeInputs:
    """The first ``rows`` rows of the GPU suite's ``rows_total x cols`` compose inputs
    (:func:`~dora_num.studies.inputs.suite_compose`)."""
    rows_total = gpu_suite_sizes()["compose_rows"] if rows_total is None else rows_total
    base, lora, g = inputs.suite_compose(rows_total, cols)
    base, lora = base[:rows], lora[:rows]
    gg = np.broadcast_to(g.astype(np.float64), base.shape)
    return ComposeInputs(base.astype(np.float64).ravel(), lora.astype(np.float64).ravel(), gg.ravel().copy(),
                         scale_constants(inputs.SUITE_FMA_SCALE)[0], np.full(base.size, "gpu_suite", dtype=object))


def minilm_layers(model, names: list[str], *, rank: int, alpha: float, use_rslora: bool, update_ratio: float,
                  g_spread: float, seed: int, dtype=torch.float32) -> dict:
    """``{name: DoRALinear}`` around the model's layers, ``A`` PEFT-initialised and ``(B, m)``
    from :func:`dora_num.oracles.perturbed_adapter` (as notebook 00), in ``dtype``."""
    modules = dict(model.named_modules())
    out = {}
    for i, name in enumerate(names):
        lin = copy.deepcopy(modules[name]).to(dtype)
        torch.manual_seed(seed + i)
        # adapter_dtype=None: A, B in W's dtype and m fp32, as when this study's data was recorded
        dora = DoRALinear.from_linear(lin, rank, alpha, use_rslora=use_rslora, compose_path="eager",
                                      adapter_dtype=None)
        W, A = lin.weight.detach(), dora.lora_A.detach()
        B, m = perturbed_adapter(W.float(), A.float(), dora.scale, seed=seed + 1000 + i, update_ratio=update_ratio,
                                 g_spread=g_spread)
        with torch.no_grad():
            dora.lora_B.copy_(B.to(dtype))
            dora.magnitude.copy_(m.to(dora.magnitude.dtype))
        out[name] = dora
    return out


def trained_layers(model, adapter_dir, names: list[str] | None = None, dtype=torch.float32) -> dict:
    """``{name: DoRALinear}`` around the model's layers carrying a trained PEFT DoRA adapter's ``A``, ``B``,
    ``m`` and scale (:func:`~dora_num.adapters.peft_io.load_peft_dora`; ``names``: those of its modules to
    keep, default all), in ``dtype`` as :func:`minilm_layers` builds them (A, B in W's dtype, m fp32)."""
    from ...adapters.peft_io import load_peft_dora

    modules = dict(model.named_modules())
    states = {st.name: st for st in load_peft_dora(adapter_dir, model)}
    missing = [n for n in (names or []) if n not in states]
    if missing:
        raise ValueError(f"the adapter in {adapter_dir} has no module {missing[0]!r} (it has {len(states)})")
    out = {}
    for name in names or sorted(states):
        st = states[name]
        lin = copy.deepcopy(modules[name]).to(dtype)
        dora = DoRALinear.from_linear(lin, st.rank, st.alpha, use_rslora=st.use_rslora, compose_path="eager",
                                      adapter_dtype=None)
        if dora.scale != st.scale:
            raise ValueError(f"{name}: the layer's scale {dora.scale} is not the adapter's {st.scale}")
        with torch.no_grad():
            dora.lora_A.copy_(st.A.to(dtype))
            dora.lora_B.copy_(st.B.to(dtype))
            dora.magnitude.copy_(st.m.to(dora.magnitude.dtype))
        out[name] = dora
    return out


def layer_terms(layer) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(base_sq, cross, ba, wnorm)`` of a :class:`~dora_num.DoRALinear`: the fp32 terms its
    factored norm assembles (:func:`~dora_num.ops.norm.factored_terms`, the torch tail's) and
    the production norm itself on that tail (float64 arrays of fp32 values)."""
    W, A, B = layer.base.weight, layer.lora_A, layer.lora_B
    with override(norm_tail="torch"):  # the tail whose terms factored_terms returns (CUDA's kernel sums in
        wnorm = factored_row_norm(W, A, B, layer.scale)  # another order)
    b, c, a, _, _ = factored_terms(W, A, B, layer.scale)
    return tuple(t.detach().double().cpu().numpy() for t in (b, c, a)) + (wnorm.double().numpy(),)


def minilm_assembly_inputs(layers: dict) -> AssemblyInputs:
    parts = [layer_terms(lay)[:3] + (name,) for name, lay in layers.items()]
    scales = {float(scale_constants(lay.scale)[0]) for lay in layers.values()}
    if len(scales) != 1:
        raise ValueError(f"all layers must share one scale, got {sorted(scales)}")
    cat = np.concatenate([np.full(p[0].shape, p[3], dtype=object) for p in parts])
    return AssemblyInputs(*(np.concatenate([p[i] for p in parts]) for i in range(3)), scales.pop(), cat)


def minilm_activations(model, tok, names: list[str], *, n_texts: int, max_tokens: int) -> dict:
    """Real inputs of each layer: hidden states of ``n_texts`` corpus summaries (padding
    dropped), at most ``max_tokens`` tokens per layer, fp32 ``[tokens, d_in]``."""
    texts = [r["summary"] for r in load_corpus()[:n_texts]]
    batch = tokenize(tok, texts)
    keep = batch["attention_mask"].reshape(-1).bool()
    acts, hooks = {}, []
    modules = dict(model.named_modules())
    for name in names:
        def hook(mod, inp, out, name=name):
            x = inp[0].detach().reshape(-1, inp[0].shape[-1])[keep]
            acts[name] = x[:max_tokens].float().clone()
        hooks.append(modules[name].register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return acts


def minilm_compose_inputs(layers: dict, acts: dict) -> ComposeInputs:
    """``base = x W^T``, ``lora = x A^T B^T`` and ``g`` exactly as ``DoRALinear.forward`` forms them."""
    cols = {k: [] for k in ("base", "lora", "g", "cat")}
    for name, lay in layers.items():
        x = acts[name].to(lay.base.weight.dtype)
        with torch.no_grad():
            base = Fn.linear(x, lay.base.weight).float()
            lora = Fn.linear(Fn.linear(x, lay.lora_A), lay.lora_B).float()
            g = lay.magnitude_scale().float()
        cols["base"].append(base.double().numpy().ravel())
        cols["lora"].append(lora.double().numpy().ravel())
        cols["g"].append(np.broadcast_to(g.double().numpy(), base.shape).ravel())
        cols["cat"].append(np.full(base.numel(), name, dtype=object))
    s = scale_constants(next(iter(layers.values())).scale)[0]
    return ComposeInputs(*(np.concatenate(cols[k]) for k in ("base", "lora", "g")), s, np.concatenate(cols["cat"]))


# --------------------------------------------------------------------------
# Studies
# --------------------------------------------------------------------------

HIST_CAP = 8  # ULP distances beyond +-HIST_CAP are pooled at +-(HIST_CAP + 1) (e.g. a norm of 0 vs 1e-20)


def _hist(rows: list, key: dict, d: np.ndarray) -> None:
    d = np.clip(np.asarray(d, dtype=np.int64), -HIST_CAP - 1, HIST_CAP + 1)
    vals, counts = np.unique(d, return_counts=True)
    rows.extend({**key, "ulp": int(v), "count": int(c)} for v, c in zip(vals, counts))


def _vs_exact(d_prod, d_exact) -> dict:
    """Summary columns of ULP differences against the exact result (and the worst vs production)."""
    return {"correctly_rounded": float((d_exact == 0).mean()),
            "within_1ulp_of_exact": float((np.abs(d_exact) <= 1).mean()),
            "max_abs_ulp_vs_exact": int(np.abs(d_exact).max()),
            "max_abs_ulp_vs_production": int(np.abs(d_prod).max())}


def _hist_both(hist, key, d_prod, d_exact) -> None:
    _hist(hist, {**key, "vs": "production"}, d_prod)
    _hist(hist, {**key, "vs": "exact"}, d_exact)


def _explain(rows: list, key: dict, records_prod: list, outputs_prod: np.ndarray, name: str, inputs: dict,
             fmt: str, final) -> None:
    """Per site: the single-site contraction's effect binned by ``q = removed / ulp(site result)``."""
    for i, rec in enumerate(records_prod):
        choice = tuple("fma" if j == i else "none" for j in range(len(records_prod)))
        recs: list = []
        out = final(M.evaluate(name, choice, inputs, records=recs))
        site_changed = recs[i]["out"] != rec["out"]
        out_changed = out != outputs_prod
        q = np.minimum(rec["removed"] / quantum(rec["out"], "fp32"), 1.0)
        q = np.broadcast_to(q, out_changed.shape)
        b = np.digitize(q, Q_BINS[1:-1])
        for k in range(len(Q_BINS) - 1):
            sel = b == k
            if sel.any():
                rows.append({**key, "site": i, "q_lo": Q_BINS[k], "q_hi": Q_BINS[k + 1], "n": int(sel.sum()),
                             "mean_q": float(q[sel].mean()),
                             "site_result_changed": float(np.broadcast_to(site_changed, sel.shape)[sel].mean()),
                             "output_changed": float(out_changed[sel].mean())})


def assembly_study(sets: dict[str, AssemblyInputs]) -> dict[str, pd.DataFrame]:
    """Every placement x sqrt model of the norm assembly on each input set.

    Returns ``summary`` (one row per set x placement x sqrt), ``hist`` (ULP
    histograms vs production and vs exact) and ``explain`` (per site, by ``q``).
    """
    summary, hist, explain = [], [], []
    name = "norm_assembly"
    for set_name, inp in tqdm(sets.items(), desc="assembly: input sets", **PROGRESS):
        terms = inp.terms()
        exact = assembly_exact(inp.base_sq, inp.cross, inp.ba, inp.s).rounded
        recs0: list = []
        t0 = M.evaluate(name, ("none",) * 2, terms, sqrt=lambda x: x, records=recs0)
        w0 = M.sqrt_rn(t0)
        _explain(explain, {"set": set_name, "formula": name}, recs0, w0, name, terms, "fp32", lambda x: x)
        for choice in M.placements(name):
            t = M.evaluate(name, choice, terms, sqrt=lambda x: x)
            for sq in SQRT_MODELS:
                w = M.sqrt_rn(t) if sq == "rn" else M.sqrt_other_neighbour(t)
                d_prod = ulp_distance(w0, w, "fp32")
                d_exact = ulp_distance(exact, w, "fp32")
                key = {"set": set_name, "placement": M.placement_label(choice), "sqrt": sq}
                summary.append({**key, "n": int(w.size), "production": choice == ("none", "none") and sq == "rn",
                                "agree_vs_production": float((d_prod == 0).mean()),
                                "t_agree_vs_production": float((t == t0).mean()),
                                **_vs_exact(d_prod, d_exact)})
                _hist_both(hist, key, d_prod, d_exact)
        for cat in np.unique(inp.category):
            sel = inp.category == cat
            for choice in M.placements(name):
                t = M.evaluate(name, choice, {k: (v[sel] if isinstance(v, np.ndarray) else v)
                                              for k, v in terms.items()}, sqrt=lambda x: x)
                summary.append({"set": set_name, "category": cat, "placement": M.placement_label(choice), "sqrt": "rn",
                                "n": int(sel.sum()), "agree_vs_production": float((M.sqrt_rn(t) == w0[sel]).mean()),
                                "t_agree_vs_production": float((t == t0[sel]).mean()),
                                "correctly_rounded": float((M.sqrt_rn(t) == exact[sel]).mean())})
    return {"summary": pd.DataFrame(summary), "hist": pd.DataFrame(hist), "explain": pd.DataFrame(explain)}


COMPOSE_FORMULAS = ("compose_naive", "compose_stable", "compose_inner")


def compose_study(sets: dict[str, ComposeInputs], out_fmts=("fp32", "bf16")) -> dict[str, pd.DataFrame]:
    """Every placement of the compose formulas, outputs rounded once to each format.

    ``inner`` (``s*lora + base``, saved in fp32 for the backward) is evaluated
    in fp32 only; its exact value rounded once *is* the contracted result.
    """
    summary, hist, explain = [], [], []
    for set_name, inp in tqdm(sets.items(), desc="compose: input sets", **PROGRESS):
        for fmt in out_fmts:
            base, lora = round_to(inp.base, fmt), round_to(inp.lora, fmt)  # storage values
            args = {"base": base, "lora": lora, "g": inp.g, "s": scale_constants(inp.s)[0]}
            exact = compose_exact(base, lora, inp.g, inp.s, fmt).rounded
            for name in COMPOSE_FORMULAS:
                if name == "compose_inner" and fmt != "fp32":
                    continue
                final = (lambda x: round_to(x, fmt)) if name != "compose_inner" else (lambda x: x)
                recs0: list = []
                out0 = final(M.evaluate(name, M.placements(name)[0], args, records=recs0))
                ex = exact if name != "compose_inner" else M.evaluate(name, ("fma",), args)
                _explain(explain, {"set": set_name, "formula": name, "fmt": fmt}, recs0, out0, name, args, fmt, final)
                for choice in M.placements(name):
                    out = final(M.evaluate(name, choice, args))
                    d_prod = ulp_distance(out0, out, fmt)
                    d_exact = ulp_distance(ex, out, fmt)
                    key = {"set": set_name, "formula": name, "fmt": fmt, "placement": M.placement_label(choice)}
                    summary.append({**key, "n": int(out.size),
                                    "production": name != "compose_naive" and all(c == "none" for c in choice),
                                    "agree_vs_production": float((d_prod == 0).mean()),
                                    **_vs_exact(d_prod, d_exact)})
                    _hist_both(hist, key, d_prod, d_exact)
    return {"summary": pd.DataFrame(summary), "hist": pd.DataFrame(hist), "explain": pd.DataFrame(explain)}


def sites_table() -> pd.DataFrame:
    """Every contraction site of the formulas (derived by tracing them)."""
    rows = [{"formula": s.formula, "site": s.index, "expression": f"{s.a}*{s.b} + {s.c}", "contracted": s.fused,
             "rounding_removed": s.removes, "alternative": s.fused_alt or ""} for s in M.contraction_sites()]
    covered = {r["formula"] for r in rows}
    rows += [{"formula": f, "site": None, "expression": "(no a*b + c)", "contracted": "", "rounding_removed": "",
              "alternative": ""} for f in M.formula_names() if f not in covered]
    return pd.DataFrame(rows)
