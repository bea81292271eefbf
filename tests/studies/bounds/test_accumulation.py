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
