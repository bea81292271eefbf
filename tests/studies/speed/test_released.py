"""The like-for-like table of the released kernels against ours: on rows the recorder's own row builder
wrote from planted round times (so reader and writer agree on the format), and on the committed record."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import numpy as np
import pandas as pd
import pytest

from dora_num.studies.speed import released as rel
from dora_num.studies.speed.record_dorafactors import Case, case_rows

BF16 = "bfloat16"


def _rows(op, config, ours, ms: dict, info: dict) -> list[dict]:
    case = Case(op, config, ours, {name: None for name in ms}, info)
    return case_rows(case, ms)


def synthetic() -> pd.DataFrame:
    """A compose training row (theirs with bf16 mag and a bad dbase) and a norm row, planted round times."""
    compose = _rows("compose_train", {"tokens": 64, "d_out": 96}, "dora_num_fused",
                    {"dorafactors_fused": [1.1, 0.9, 1.3, 1.2, 1.0], "dora_num_fused": [1.0] * 5,
                     "eager_torch": [3.0] * 5},
                    {"dorafactors_fused": dict(act_dtype=BF16, g_dtype=BF16, out_dtype=BF16, err_out=6e-3,
                                               err_dbase=0.9, err_dlora=4e-3, err_dg=4e-3),
                     "dora_num_fused": dict(act_dtype=BF16, g_dtype="float32", out_dtype=BF16, err_out=3e-3,
                                            err_dbase=2e-3, err_dlora=2.5e-3, err_dg=1e-7),
                     "eager_torch": dict(act_dtype=BF16, g_dtype="float32", out_dtype=BF16, err_out=3e-3)})
    norm = _rows("row_norm", {"d_out": 63, "d_in": 1000, "rank": 3}, "dora_num_factored",
                 {"dorafactors_factored": [2.0, 2.2, 2.4, 2.1, 2.3, 2.6, 2.5], "dora_num_factored": [1.0] * 7},
                 {"dorafactors_factored": dict(w_dtype=BF16, ab_dtype=BF16, out_dtype=BF16, err_norm=4e-3),
                  "dora_num_factored": dict(w_dtype=BF16, ab_dtype=BF16, out_dtype="float32", err_norm=1.5e-7)})
    return pd.DataFrame(compose + norm)


def test_ratio_interval_dtypes_and_errors_of_each_configuration():
    t = rel.like_for_like(synthetic())
    assert list(t["op"]) == ["compose_train", "row_norm"]
    c, n = t.iloc[0], t.iloc[1]
    assert (c["ratio"], c["ratio_lo"], c["ratio_hi"], c["rounds"]) == (1.1, 0.9, 1.3, 5)
    assert (n["ratio"], n["ratio_lo"], n["ratio_hi"], n["rounds"]) == (2.3, 2.0, 2.6, 7)
    assert c["theirs_ms"] == 1.1 and c["ours_ms"] == 1.0 and c["shape"] == "64x96"
    assert n["shape"] == "63x1000 r3"
    assert c["dtypes_theirs"] == "x bf16, g bf16 -> bf16" and c["dtypes_ours"] == "x bf16, g fp32 -> bf16"
    assert n["dtypes_theirs"] == "W bf16, A,B bf16 -> bf16" and n["dtypes_ours"] == "W bf16, A,B bf16 -> fp32"
    assert (c["err_theirs"], c["err_ours"]) == (6e-3, 3e-3) and (n["err_theirs"], n["err_ours"]) == (4e-3, 1.5e-7)
    # the worst gradient of each side, named: a less exact dbase shows beside the speed
    assert (c["grad_err_theirs"], c["grad_err_theirs_of"]) == (0.9, "dbase")
    assert (c["grad_err_ours"], c["grad_err_ours_of"]) == (2.5e-3, "dlora")
    assert np.isnan(n["grad_err_theirs"]) and n["grad_err_theirs_of"] == ""
    assert list(rel.interval_side(t)) == ["overlaps 1", "theirs longer"]
    assert "eager_torch" not in set(t["theirs"]) | set(t["ours"])  # only theirs against ours


def test_interval_side_names_both_directions():
    t = pd.DataFrame({"ratio_lo": [0.8, 1.01, 0.9], "ratio_hi": [0.95, 1.2, 1.0]})
    assert list(rel.interval_side(t)) == ["ours longer", "theirs longer", "overlaps 1"]


@pytest.mark.parametrize("n", [2, 3, 7, 12])
def test_coverage_of_the_range_as_an_interval_for_the_median(n):
    """[min, max] of n continuous draws misses the median only when all n fall on one side of it: the
    coverage is P(1 <= K <= n-1), K ~ Binomial(n, 1/2), summed exactly here."""
    exact = sum(Fraction(comb(n, k), 2 ** n) for k in range(1, n))
    assert rel.coverage(n) == float(exact)


def test_coverage_needs_two_rounds():
    with pytest.raises(ValueError, match="at least 2 rounds"):
        rel.coverage(1)


def test_a_configuration_without_our_row_is_named():
    df = synthetic()
    df = df[df["impl"] != "dora_num_factored"]
    with pytest.raises(ValueError, match=r"row_norm .*0 rows of ours \('dora_num_factored'\)"):
        rel.like_for_like(df)


def test_rounds_that_disagree_with_the_count_are_refused():
    df = synthetic()
    df.loc[df["impl"] == "dorafactors_factored", "rounds"] = 6
    with pytest.raises(ValueError, match="7 per-round ratios, the record says 6 rounds"):
        rel.like_for_like(df)


def test_error_rows_are_left_out_of_the_table_and_listed():
    df = pd.concat([synthetic(), pd.DataFrame([{"op": "row_norm", "impl": "error", "d_out": 8, "d_in": 8,
                                                 "rank": 2, "error": "RuntimeError: boom"}])], ignore_index=True)
    assert len(rel.like_for_like(df)) == 2
    assert list(rel.failed(df)["error"]) == ["RuntimeError: boom"]


def test_unknown_measurement_is_named():
    df = synthetic()
    df["op"] = df["op"].replace("row_norm", "row_sum")
    with pytest.raises(ValueError, match="unknown measurement 'row_sum'"):
        rel.like_for_like(df)


def test_rounds_parses_and_refuses_an_empty_cell():
    assert list(rel.rounds("1.0;0.5")) == [1.0, 0.5]
    with pytest.raises(ValueError, match="no per-round values"):
        rel.rounds(float("nan"))


def test_the_recorded_table():
    """The committed record: every configuration of theirs has ours beside it in every round, nothing
    failed, and the per-round ratios agree with the recorded times and medians to the record's rounding
    (4 decimals: a ratio within 5e-5, a time within 5e-5 ms)."""
    bench = rel.load_bench()
    assert rel.failed(bench).empty
    t = rel.like_for_like(bench)
    theirs = bench[bench["impl"].str.startswith(rel.THEIRS)]
    assert len(t) == len(theirs) == 22 and (t["rounds"] == 7).all()
    assert set(t["op"]) == set(rel.OPS)
    for _, row in theirs.iterrows():
        r = rel.rounds(row["ratio_rounds"])
        assert abs(np.median(r) - row["ratio_to_ours"]) <= 5e-5
        ours = bench[(bench["impl"] == row["ours"]) & (bench["op"] == row["op"])
                     & (bench["d_out"] == row["d_out"]) & bench["rank"].fillna(-1).eq(
                         -1 if pd.isna(row["rank"]) else row["rank"])]
        ours = ours[ours["tokens"].fillna(-1).eq(-1 if pd.isna(row["tokens"]) else row["tokens"])]
        a, b = rel.rounds(row["rounds_ms"]), rel.rounds(ours.iloc[0]["rounds_ms"])
        # a/b from times rounded by 5e-5: off by at most (5e-5 / b) (1 + a / b) to first order, plus the
        # ratio's own rounding
        slack = 5e-5 / b * (1 + a / b) * 1.01 + 5e-5
        assert (np.abs(r - a / b) <= slack).all(), (row["op"], row["d_out"], row["rank"])
    # the compose rows give their kernel mag in bf16 (their layer's cast) and ours g in fp32
    compose = t[t["op"].astype(str).str.startswith("compose")]
    assert compose["dtypes_theirs"].str.contains("g bf16").all() and compose["dtypes_ours"].str.contains("g fp32").all()
    # the norm and layer rows: the same input dtypes on both sides (bf16 W, A, B: the adapter dtype their
    # layer keeps)
    rest = t[~t.index.isin(compose.index)]
    assert (rest["dtypes_theirs"].str.split(" -> ").str[0] == rest["dtypes_ours"].str.split(" -> ").str[0]).all()
