"""What the cards recorded of the tensor-core accumulator: each card's probe at the operator's shapes, read
from its committed record and analysed (the probes and the analysis: tests/numerics/test_accumulation.py)."""

import pytest

from dora_num.numerics.accumulation import analyze, charge_confirmed
from dora_num.studies.bounds import accumulation as A


def test_missing_probe_is_named_with_its_recorder(tmp_path):
    from dora_num.repro.paths import RecordedDataMissing

    with pytest.raises(RecordedDataMissing, match="dora-num record exhaustive --out DIR --only accumulation"):
        A.load_record(tmp_path)


@pytest.mark.parametrize("card", ["h100"])
def test_recorded_operator_probe_is_explained_on_each_card(card):
    """The probe the gpu test runs, as the card recorded it: every (format, product, r, K) of the operator's
    GEMMs explained by the blocked model (split-K included), products exact, subnormal products kept, and the
    order-free 2u charge confirmed (factor <= 1): the reviewer's kit's criterion (``charge_confirmed``)."""
    from dora_num.studies.bounds.datasets import OPERATOR_ACCUMULATION_CARDS

    assert card in OPERATOR_ACCUMULATION_CARDS
    device, recs = A.load_operator_probe(card)
    assert card in device["name"].lower() and len(recs) == 160
    bad = [((rec["format"], *rec["shape"], rec["K"]), charge_confirmed(analyze(rec))) for rec in recs
           if charge_confirmed(analyze(rec)) is not None]
    assert not bad, bad
    assert all(analyze(r)["subnormal_products_kept"] for r in recs if r["format"] == "bf16")
    split_k = {(r["shape"][0], r["K"]) for r in recs if analyze(r)["splits"] > 1}
    assert ("G", 8192) in split_k  # the shapes that failed the power-of-two model: cuBLAS's split-K
