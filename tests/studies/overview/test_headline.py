"""Notebook 00's headline counts g == 1 at initialisation by rows: ``k of n rows`` summed over the layers, the
unweighted mean of the per-layer fractions named as such, checked on a hand-built table whose counts are
known."""

from __future__ import annotations

import pandas as pd
import pytest

from dora_num.studies.overview.headline import headline, rows_where


def _table(d_out, factored, mixed) -> pd.DataFrame:
    n = len(d_out)
    return pd.DataFrame({"layer": [f"l{i}" for i in range(n)], "d_out": d_out, "g_init_exactly_one": factored,
                         "g_init_mixed_norms_exactly_one": mixed, "factored_within_bound": True,
                         "dense_within_bound": True, "factored_vs_dense_within_bounds": True,
                         "rel_err_factored_max": 1e-7, "rel_err_dense_max": 2e-7, "tightness_factored": 0.01,
                         "tightness_dense": 0.02})


def test_g_at_init_is_counted_by_rows_not_by_layers(tmp_path):
    # layer 0: 1 of 3 rows, layer 1: 4 of 5 rows -> 5 of 8 rows (62.5%); the mean of the two fractions,
    # (1/3 + 4/5) / 2 = 56.7%, is another number and is named as the per-layer mean
    (tmp_path / "00_overview").mkdir()
    _table([3, 5], [1.0, 1.0], [1 / 3, 4 / 5]).to_csv(tmp_path / "00_overview/norm_agreement.csv", index=False)
    lines, stats = headline(tmp_path)
    text = lines[1]
    assert "8 of 8 (100%) with m from the factored norm" in text
    assert "5 of 8 (62.5%) with m from a dense norm" in text
    assert "from 33.3% to 80% of the layer's rows" in text and "unweighted mean over the 2 layers, 56.7%" in text
    assert "a 3-row layer as much as a 5-row one" in text
    assert stats["g_init_dense_exactly_one_rows"] == 5 and stats["rows"] == 8
    assert stats["g_init_dense_exactly_one_by_rows"] == 5 / 8


def test_a_column_that_is_not_a_fraction_of_rows_is_refused():
    with pytest.raises(ValueError, match="not a whole number of rows"):
        rows_where(_table([3], [1.0], [0.5]), "g_init_mixed_norms_exactly_one")
