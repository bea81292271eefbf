"""The tensor-core accumulation probe recovers the parameters of exact CPU models of blocked,
aligned, truncating or rounding accumulators; its bound implications are as derived; the verdict on the
2u-per-addition charge (what the reviewer's kit applies) follows them."""

import math

import numpy as np
import pytest
import torch

from dora_num.numerics import accumulation as A

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


def test_charge_confirmed_follows_the_factor():
    """An analysis whose charge is twice the present one (a truncating adder without guard bits: 40 blocks of
    one product at K = 40, each 2^-23 + 2^-23 against 2 * 2^-24 per addition) is not confirmed, with the
    factor named; one of 16-product blocks keeping 25 bits (3 blocks, each 16 * 2^-24 + 2^-23, against
    80 * 2^-24: 27/40) is; a model that explains nothing, or flushed subnormal products, is not."""
    base = {"explained": True, "products_exact": True, "columns_agree": True, "splits": 1, "K": 40,
            "rounding_block": "rz", "rounding_acc": "rz"}
    bad = {**base, "block_k": 1, "block_bits": 24}
    assert A.bound_factor(bad)["factor"] == 2.0
    assert A.charge_confirmed(bad) == ("the measured accumulator implies 2 times the 2u-per-addition charge "
                                       "(blocks of 1, 24 bits kept)")
    good = {**base, "block_k": 16, "block_bits": 25}
    assert A.bound_factor(good)["factor"] == 27 / 40 and A.charge_confirmed(good) is None
    assert "does not explain" in A.charge_confirmed({**good, "explained": False})
    assert "subnormal products are flushed" in A.charge_confirmed({**good, "subnormal_products_kept": False})


def test_a_truncating_accumulator_emulated_on_the_cpu_is_not_confirmed():
    """The probe through an exact CPU model that truncates each addition to 24 bits (no guard bit): the
    analysis recovers it and the charge is not confirmed; the fused 16-product block with 25 bits is."""
    trunc = A.TensorCoreModel(k=1, align_bits=24, rounding="rz")
    f = A.analyze(A.run_probes(trunc.mm, "bf16", 40, shape=("U", 64, 2), positions=A.probe_positions(40)))
    assert f["explained"] and f["block_k"] == 1 and f["block_bits"] == 24
    assert "2 times" in A.charge_confirmed(f)
    fused = A.TensorCoreModel(k=16, align_bits=25, rounding="rz")
    assert A.charge_confirmed(A.analyze(A.run_probes(fused.mm, "bf16", 40, shape=("U", 64, 2)))) is None


def test_probe_with_a_row_stride_sees_the_operators_strides():
    """``lead``: the probe's ``a`` and ``b^T`` are column blocks of rows ``lead`` long (the operator's column
    blocks of W and A beyond TC_BLOCK_K): the strides reach ``mm``, the outputs are those of the dense probe."""
    seen = []

    def mm(a, b):
        seen.append((a.stride(), b.stride(), tuple(a.shape), tuple(b.shape)))
        return a.float() @ b.float()

    dense = A.run_probes(mm, "bf16", 24, shape=("U", 32, 3), positions=(0, 23))
    seen.clear()
    strided = A.run_probes(mm, "bf16", 24, shape=("U", 32, 3), positions=(0, 23), lead=40)
    assert set(seen) == {((40, 1), (1, 40), (32, 24), (24, 3))}
    assert strided["order_out"] == dense["order_out"] and strided["lead"] == 40 and "lead" not in dense
    with pytest.raises(ValueError, match="lead = 8 is below K = 24"):
        A.run_probes(mm, "bf16", 24, lead=8)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_subnormal_input_probe(fmt):
    """Three subnormal steps (bf16: 3 * 2^-133, fp16: 3 * 2^-24) times 2^8: kept by an fp32 product, lost
    where the input is flushed to zero."""
    tiny = {"bf16": 3 * 2.0**-133, "fp16": 3 * 2.0**-24}[fmt]
    kept = A.subnormal_input_probe(lambda a, b: a.float() @ b.float(), fmt, K=8, shape=("U", 4, 2))
    assert (kept["input"], kept["output"], kept["subnormal_inputs_kept"]) == (tiny, tiny * 2**8, True)

    def flush(a, b):
        lim = torch.finfo(a.dtype).smallest_normal
        return torch.where(a.abs() < lim, 0, a).float() @ b.float()

    assert A.subnormal_input_probe(flush, fmt)["subnormal_inputs_kept"] is False
