"""Notebook 02's headline in the README and its takeaway (FMA contraction and an approximate sqrt): the sentences
and the statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, pct, read_csv, read_json

# shown under the headline in the README (figures/02_fma_and_sqrt/*.png)
FIGURES = ("assembly_ulp_hist",)


def _fma(d: Path) -> Stats:
    """Notebook 02: the fraction of row norms a contraction changes and by how many ulps at most, on MiniLM W
    with the synthetic adapter and on the GPU suite's inputs; the largest 1 - cosine of the sentence embeddings
    of any variant against production."""
    s = read_csv(d, "02_fma_and_sqrt/assembly_summary.csv")
    s = s[(s.sqrt == "rn") & s.category.isna()]
    real, gpu = s[s.set == "minilm"], s[s.set == "gpu_suite"]
    gprod, gfma = gpu[gpu.production == True], gpu[gpu.production != True]  # noqa: E712 - a bool column with NaN
    gs0 = gfma[gfma.placement.str.contains("s0:fma")]
    p = read_csv(d, "02_fma_and_sqrt/propagation_model.csv")
    par = read_json(d, "02_fma_and_sqrt/assembly_summary.csv.provenance.json")["parameters"]
    return {"minilm_changed": 1 - real.agree_vs_production.min(), "minilm_ulps": real.max_abs_ulp_vs_production.max(),
            "update_ratio": par["UPDATE_RATIO"],
            "gpu_changed": 1 - gfma.agree_vs_production.min(), "gpu_ulps": gfma.max_abs_ulp_vs_production.max(),
            "gpu_production_within_1ulp": gprod.within_1ulp_of_exact.iloc[0],
            "gpu_production_ulps_from_exact": gprod.max_abs_ulp_vs_exact.iloc[0],
            "gpu_s0_contracted_within_1ulp_min": gs0.within_1ulp_of_exact.min(),
            "frac_changed_max_all_inputs": 1 - s[s.set != "adversarial"].agree_vs_production.min(),
            "ulps_changed_max_all_inputs": s[s.set != "adversarial"].max_abs_ulp_vs_production.max(),
            "one_minus_cosine_max": p[p.variant != "production"].one_minus_min_cosine_embedding.max()}


def _fma_text(s: Stats) -> str:
    return (f"on MiniLM W with a synthetic adapter (update ratio {s['update_ratio']:g}) contracting the norm's "
            f"additions into FMAs changes at most {pct(s['minilm_changed'])} of row norms, by at most "
            f"{s['minilm_ulps']:.0f} ulp; on the GPU suite's inputs it changes up to {pct(s['gpu_changed'])} of "
            f"them, by up to {s['gpu_ulps']:,.0f} ulps: there the production norm is up to "
            f"{s['gpu_production_ulps_from_exact']:,.0f} ulps from exact (within 1 ulp on "
            f"{pct(s['gpu_production_within_1ulp'])}), and contracting the first addition (2s*cross + base_sq) "
            f"brings it within 1 ulp on "
            f"{pct(s['gpu_s0_contracted_within_1ulp_min'])}")


def headline(d: Path) -> tuple[list[str], Stats]:
    s = _fma(d)
    return ([_fma_text(s),
             f"at the sentence embeddings every variant (contraction, approximate sqrt) stays within "
             f"1 - cosine = {s['one_minus_cosine_max']:.3g} of production; the trained adapters and the paper's "
             f"failing configuration (an approximate division inside the kernel, in a deep decoder) are not tested"],
            s)


def _t_fma(d: Path) -> tuple[str, Stats]:
    s = _fma(d)
    return (f"**FMA contraction changes few of MiniLM's row norms and many of the GPU suite's; neither it nor an "
            f"approximate square root moves MiniLM's embeddings much.** {_fma_text(s)[0].upper()}"
            f"{_fma_text(s)[1:]}. The model's sentence embeddings stay within 1 - cosine = "
            f"{s['one_minus_cosine_max']:.2g} of the production kernel's. The paper's failing configuration (an "
            f"approximate division inside the kernel, in a deep decoder) is not tested here.", s)


# the README's numbered takeaways this notebook backs: (function, the figure that shows it)
TAKEAWAYS = (
    (_t_fma, "02_fma_and_sqrt/assembly_ulp_hist"),
)
