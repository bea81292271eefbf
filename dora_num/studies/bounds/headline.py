"""Notebook 03's headline in the README and its takeaway (the error bounds and how tight they are): the sentences
and the statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, read_csv

# shown under the headline in the README (figures/03_ground_truth_and_bounds/*.png)
FIGURES = ("error_vs_bound",)


def _bounds(d: Path) -> Stats:
    """Notebooks 00 and 03: bound violations, certified comparisons, and measured/bound of each bound: the
    compose and the norm assembly on adversarial inputs, the row norms in the conditioning study and on
    MiniLM's layers."""
    e = read_csv(d, "03_ground_truth_and_bounds/error_vs_bound.csv")
    t = read_csv(d, "03_ground_truth_and_bounds/tightness.csv")
    c = read_csv(d, "03_ground_truth_and_bounds/conditioning.csv")
    real = read_csv(d, "00_overview/norm_agreement.csv")
    comp = t[t.formula.str.startswith("compose")].groupby(["formula", "format", "arith"]).tightness.max()
    return {"violations": int(e.violations.sum()), "comparisons": int(e.n.sum()),
            "compose_tightness_max": comp.max(), "compose_tightness_min": comp.min(),
            "assembly_tightness_max": t[t.formula == "norm_assembly"].tightness.max(),
            "conditioning_factored": (c.err_factored / c.bound_factored).max(),
            "conditioning_dense": (c.err_dense / c.bound_dense).max(),
            "real_factored": real.tightness_factored.max(), "real_dense": real.tightness_dense.max()}


def _bounds_text(s: Stats) -> str:
    return (f"over the study's random, realistic and adversarial inputs the compose's error attains its bound "
            f"(the largest measured / bound up to {s['compose_tightness_max']:.3g}, and at least "
            f"{s['compose_tightness_min']:.3g} in every format and arithmetic); the norm assembly's reaches "
            f"{s['assembly_tightness_max']:.3g} there, the factored and "
            f"dense row-norm bounds {s['conditioning_factored']:.2g} and {s['conditioning_dense']:.2g} in the "
            f"conditioning study and {s['real_factored']:.2g} and {s['real_dense']:.2g} on MiniLM's layers")


def headline(d: Path) -> tuple[list[str], Stats]:
    s = _bounds(d)
    return ([f"{s['violations']} bound violations in {s['comparisons']:,} certified comparisons (compose and norm "
             f"assembly, every format and arithmetic); {_bounds_text(s)}"], s)


def _t_bounds(d: Path) -> tuple[str, Stats]:
    s = _bounds(d)
    return (f"**The error bounds hold; the compose's bound is tight, the norm bounds are not.** {s['violations']} "
            f"violations in {s['comparisons']:,} comparisons against certified exact results (every format and "
            f"arithmetic); {_bounds_text(s)}. A reviewer can re-check them on their own weights "
            f"(`dora-num bounds check`).", s)


# the README's numbered takeaways this notebook backs: (function, the figure that shows it)
TAKEAWAYS = (
    (_t_bounds, "03_ground_truth_and_bounds/error_vs_bound"),
)
