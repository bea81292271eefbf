"""Notebook 06's headline in the README (dg within its bound; the memory model against the H200): the sentences
and the statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, pct, read_csv

# shown under the headline in the README (figures/06_gradient_and_memory/*.png)
FIGURES = ("dg_error_vs_tokens",)


def headline(d: Path) -> tuple[list[str], Stats]:
    s = read_csv(d, "06_gradient_and_memory/dg_synthetic.csv")
    b = s[s.bound_ok.notna()]
    ok = int(b.bound_ok.astype(str).str.lower().eq("true").sum())
    h = read_csv(d, "06_gradient_and_memory/memory_h200.csv")
    return ([f"dg within its a-priori bound in {ok} of {len(b)} synthetic cases",
             f"memory model vs H200 peaks: worst error {pct(h.rel_err.abs().max())} over {len(h)} configurations"],
            {"dg_within": ok, "dg_cases": len(b), "memory_err_max": h.rel_err.abs().max()})
