"""Notebook 00's headline in the README (factored vs dense row norms on MiniLM): the sentences and the statistics
they state, read from the committed data (``d``: the ``data/`` folder). :mod:`dora_num.repro.results` gathers
every study folder's ``headline.py`` into the README and checks each strong word against the statistics it
returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, pct, read_csv

# shown under the headline in the README (figures/00_overview/*.png)
FIGURES = ("norm_errors",)


def rows_where(t, fraction: str) -> int:
    """The rows counted by the per-layer ``fraction`` column of ``t`` (each layer's fraction of its ``d_out``
    rows, :func:`~dora_num.studies.overview.norms.norm_agreement`): ``sum(fraction * d_out)``, an integer
    count, or a ValueError where a layer's product is not one (the column is then not a fraction of rows)."""
    counts = t[fraction] * t.d_out
    if (counts - counts.round()).abs().max() > 1e-6:
        raise ValueError(f"{fraction} times d_out is not a whole number of rows in every layer")
    return int(counts.round().sum())


def headline(d: Path) -> tuple[list[str], Stats]:
    t = read_csv(d, "00_overview/norm_agreement.csv")
    ok = int((t.factored_within_bound & t.dense_within_bound & t.factored_vs_dense_within_bounds).sum())
    n = int(t.d_out.sum())
    fac, mixed = rows_where(t, "g_init_exactly_one"), rows_where(t, "g_init_mixed_norms_exactly_one")
    per_layer = t.g_init_mixed_norms_exactly_one
    return ([f"factored and dense fp32 row norms within their a-priori bounds on {ok} of {len(t)} MiniLM layers; "
             f"worst relative error {t.rel_err_factored_max.max():.3g} (factored), {t.rel_err_dense_max.max():.3g} "
             f"(dense); worst measured/bound {t.tightness_factored.max():.3g} / {t.tightness_dense.max():.3g}",
             f"g at initialisation exactly 1, counted by rows (output rows whose g == 1, over all {n:,} output rows "
             f"of the {len(t)} layers): {fac:,} of {n:,} ({pct(fac / n)}) with m from the factored norm; "
             f"{mixed:,} of {n:,} ({pct(mixed / n)}) with m from a dense norm; by layer, from "
             f"{pct(per_layer.min())} to {pct(per_layer.max())} of the layer's rows (their unweighted mean over "
             f"the {len(t)} layers, {pct(per_layer.mean())}, weighs a {t.d_out.min()}-row layer as much as a "
             f"{t.d_out.max()}-row one)"],
            {"norm_tightness_max": max(t.tightness_factored.max(), t.tightness_dense.max()),
             "g_init_factored_exactly_one_rows": fac, "g_init_dense_exactly_one_rows": mixed, "rows": n,
             "g_init_dense_exactly_one_by_rows": mixed / n})
