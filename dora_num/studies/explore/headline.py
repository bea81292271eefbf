"""Notebook 07's headline in the README (one input swept over g - 1 under three settings): the sentences and the
statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

from pathlib import Path

from ...repro.headline import Stats, read_json

# shown under the headline in the README (figures/07_explore/*.png)
FIGURES = ("arithmetics",)


def headline(d: Path) -> tuple[list[str], Stats]:
    e = read_json(d, "07_explore/effects.json")["settings"]
    fp32, contract, eager = e["fp32/fp32"], e["bf16/fp32"], e["bf16/per_op"]
    return ([f"one input swept over g - 1: with fp32 activations the naive form is up to "
             f"{fp32['naive_max_ulps']:.3g} ulps off, the stable form {fp32['stable_max_ulps']:.2g}; with bf16 "
             f"activations and fp32 intermediates the final rounding hides most of it (naive "
             f"{contract['naive_max_ulps']:.2g}, stable {contract['stable_max_ulps']:.2g} ulps); with every op in "
             f"bf16, g rounds to 1 and the stable form is the worse ({eager['stable_max_ulps']:.4g} vs "
             f"{eager['naive_max_ulps']:.4g} ulps), at {eager['stable_worse_in_zone_opposite_signs']} of "
             f"{eager['points']} points, all where g rounds to 1 and (g-1)*base, with the exact g-1, and s*lora have "
             f"opposite signs"],
            {"stable_max_ulps_per_op": eager["stable_max_ulps"], "naive_max_ulps_per_op": eager["naive_max_ulps"]})
