"""The tensor-core accumulation probe recovers the parameters of exact CPU models of blocked,
aligned, truncating or rounding accumulators; its bound implications are as derived."""

import math

import numpy as np
import pytest

from dora_num.studies.bounds import accumulation as A

K = 64


@pytest.mark.parametrize("model", [
    A.TensorCoreModel(k=16, align_bits=25, rounding="rz", splits=1),
    A.TensorCoreModel(k=8, align_bits=27, rounding="rn", splits=2),
    A.TensorCoreModel(k=4, align_bits=24, rounding="rz", splits=1),
], ids=lambda m: f"k{m.k}-w{m.align_bits}-{m.rounding}-s{m.splits}")
def test_probe_recovers_the_model(model):
    rec = A.model_record(model, "bf16", K, positions=(0, 5, K - 1))
    f = A.analyze(rec)
    assert f["explained"] and (f["block_k"], f["splits"]) == (model.k, model.splits), f
    assert f["block_bits"] == model.align_bits and f["acc_bits"] == 24
    assert f["products_exact"] and f["columns_agree"] and f["unit_kept"]
    if model.align_bits >= 26:
        assert f["rounding_block"] == model.rounding
    else:
        assert f["rounding_block"] in (model.rounding, "rz_or_cut_by_alignment")
    assert f["subnormal_products_kept"]


def test_fp16_probe_and_flushed_subnormals():
    m = A.TensorCoreModel(k=8, align_bits=25, rounding="rz", splits=1, subnormal_products=False)
    f = A.analyze(A.model_record(m, "fp16", K, positions=(0, K - 1)))
    assert f["explained"] and f["block_k"] == 8  # fp16 units (2^-24 products) are normal in fp32
    fb = A.analyze(A.model_record(m, "bf16", 32, positions=(0,)))
    assert fb["subnormal_products_kept"] is False


def test_unexplained_order_is_reported():
    rec = A.model_record(A.TensorCoreModel(k=8, align_bits=25, rounding="rz", splits=1), "bf16", K, positions=(0, 9))
    S = A.lca_sizes(rec)
    rec["order_out"] = [y if j % 7 else y + rec["unit"] for (i, j), y in zip(rec["order_ij"], rec["order_out"])]
    f = A.analyze(rec)
    assert not f["explained"] and A.bound_factor(f)["valid"] is False
    assert np.array_equal(S[0], A.model_lca_sizes(K, 0, 8, 1))


@pytest.mark.parametrize("k, w, rounding, splits, want", [
    (1, 24, "rz", 1, 2.0),          # truncating adder without guard bits: the 2u charge is not safe
    (1, 53, "rn", 1, 0.5),          # an IEEE fp32 adder (exact alignment, RN): u per addition
    (16, 25, "rz", 1, 0.5 + 1 / 16),
])
def test_bound_factor(k, w, rounding, splits, want):
    f = {"explained": True, "products_exact": True, "columns_agree": True, "block_k": k, "splits": splits,
         "K": 4096, "block_bits": w, "rounding_block": rounding, "rounding_acc": rounding}
    b = A.bound_factor(f)
    assert b["valid"] and math.isclose(b["factor"], want, rel_tol=1e-9, abs_tol=2**-28)


def test_missing_probe_is_named_with_its_recorder(tmp_path):
    from dora_num.repro.paths import RecordedDataMissing

    with pytest.raises(RecordedDataMissing, match="dora-num record exhaustive --out DIR --only accumulation"):
        A.load_record(tmp_path)


@pytest.mark.parametrize("reduction", ["serial", "pairwise"])
def test_probe_recovers_tiled_split_k(reduction):
    """Split-K as cuBLAS ran it on an H100 (segments of a tile-aligned length, the last shorter, added one
    after another): 300 = 128 + 128 + 44 here, 4096 = 1408 + 1408 + 1280 there."""
    model = A.TensorCoreModel(k=16, align_bits=25, rounding="rz", splits=3, seg_tile=32, reduction=reduction)
    assert [len(g) for g in A.segments(300, 3, 32)] == [128, 128, 44]
    f = A.analyze(A.model_record(model, "bf16", 300, positions=(0, 130, 299)))
    assert f["explained"] and (f["block_k"], f["splits"], f["segment_max"]) == (16, 3, 128), f
    # three segments: a pairwise tree and the serial order are the same tree; four are not
    four = A.TensorCoreModel(k=8, align_bits=25, rounding="rz", splits=4, reduction=reduction)
    f4 = A.analyze(A.model_record(four, "bf16", 256, positions=(0, 100, 255)))
    assert f4["explained"] and f4["splits"] == 4 and f4["reduction"] == reduction, f4


def test_bound_factor_counts_the_serial_additions():
    f = {"explained": True, "products_exact": True, "columns_agree": True, "block_k": 16, "splits": 6,
         "segment_max": 1408, "reduction": "serial", "K": 8192, "block_bits": 26, "rounding_block": "rz",
         "rounding_acc": "rn"}
    b = A.bound_factor(f)
    assert b["blocks_per_product"] == 88 + 5  # 1408 / 16 blocks, then the other five segments one by one
    assert math.isclose(b["factor"], 93 * (16 * 2.0**-25 + 2.0**-23) / (2 * 2.0**-24 * 8192))


@pytest.mark.parametrize("card", ["h100"])
def test_recorded_operator_probe_is_explained_on_each_card(card):
    """The probe the gpu test runs, as the card recorded it: every (format, product, r, K) of the operator's
    GEMMs explained by the blocked model (split-K included), products exact, subnormal products kept, and the
    order-free 2u charge confirmed (factor <= 1)."""
    from dora_num.studies.bounds.datasets import OPERATOR_ACCUMULATION_CARDS

    assert card in OPERATOR_ACCUMULATION_CARDS
    device, recs = A.load_operator_probe(card)
    assert card in device["name"].lower() and len(recs) == 160
    bad = []
    for rec in recs:
        f = A.analyze(rec)
        b = A.bound_factor(f)
        if not (f["explained"] and f["products_exact"] and b["valid"] and b["factor"] <= 1):
            bad.append((rec["format"], *rec["shape"], rec["K"]))
    assert not bad, bad
    split_k = {(r["shape"][0], r["K"]) for r in recs if A.analyze(r)["splits"] > 1}
    assert ("G", 8192) in split_k  # the shapes that failed the power-of-two model: cuBLAS's split-K
