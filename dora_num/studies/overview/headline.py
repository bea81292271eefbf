"""Notebook 00's headline in the README (factored vs dense row norms on MiniLM): the sentences and the statistics
they state, read from the committed data (``d``: the ``data/`` folder). :mod:`dora_num.repro.results` gathers
every study folder's ``headline.py`` into the README and checks each strong word against the statistics it
returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, pct, read_csv

# shown under the headline in the README (figures/00_overview/*.png)
FIGURES = ("norm_errors",)


def headline(d: Path) -> tuple[list[str], Stats]:
    t = read_csv(d, "00_overview/norm_agreement.csv")
    ok = int((t.factored_within_bound & t.dense_within_bound & t.factored_vs_dense_within_bounds).sum())
    rows = (t.g_init_mixed_norms_exactly_one * t.d_out).sum() / t.d_out.sum()
    return ([f"factored and dense fp32 row norms within their a-priori bounds on {ok} of {len(t)} MiniLM layers; "
             f"worst relative error {t.rel_err_factored_max.max():.3g} (factored), {t.rel_err_dense_max.max():.3g} "
             f"(dense); worst measured/bound {t.tightness_factored.max():.3g} / {t.tightness_dense.max():.3g}",
             f"g at initialisation exactly 1 on {pct(t.g_init_exactly_one.mean())} of rows (m from the factored "
             f"norm); with m from a dense norm, on {pct(rows)} of the {int(t.d_out.sum()):,} rows of the "
             f"{len(t)} layers (the mean of the per-layer fractions: {pct(t.g_init_mixed_norms_exactly_one.mean())}; "
             f"per layer {pct(t.g_init_mixed_norms_exactly_one.min())} to "
             f"{pct(t.g_init_mixed_norms_exactly_one.max())})"],
            {"norm_tightness_max": max(t.tightness_factored.max(), t.tightness_dense.max()),
             "g_init_dense_exactly_one_by_rows": rows})
