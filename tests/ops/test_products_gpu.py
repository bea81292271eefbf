"""The factored norm's products and guard on the GPU (marked gpu; skip visibly on the CPU): TF32 switches,
a bf16 base with fp32 adapters, the accumulation probe at the GEMM shapes the operator calls, subnormal
16-bit inputs, the guard at the 70B down projection.  The recorder of the same measurements:
``dora-num record products --out DIR``."""

from __future__ import annotations

import pytest
import torch

from dora_num.studies.bounds.record_products import (_adapter, _norm_errors, _subnormal_input_probe, record_accumulation,
                                          record_fire_rate)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("setting", ["allow_tf32", "high"])
def test_tf32_switches_change_no_certified_bound(setting):
    """With TF32 on, the factored norm's products take the float64 route (its model named), both norms stay
    within their bounds (the dense one under the TF32 model), and the guard certifies only rows within rel."""
    from dora_num.ops.guard import guard_rows
    from dora_num.ops.products import product_model

    W, A, B, s = _adapter(512, 4096, 64, 1.0, w_dtype=torch.float32, a_dtype=torch.float32)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        if setting == "allow_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            torch.set_float32_matmul_precision("high")
        assert product_model(W, A).u == "fp64"
        e = _norm_errors(W, A, B, s)
        assert e["err_over_bound_factored_max"] <= 1 and e["err_over_bound_dense_max"] <= 1, e
        g = guard_rows(W, A, B, s)
        ref = torch.linalg.vector_norm(W.double() + s * (B.double() @ A.double()), dim=1)
        ok = g.rel <= 2**-6
        assert bool(((g.bare.double() - ref).abs()[ok] <= g.rel.double()[ok] * ref[ok] * (1 + 1e-9)).all())
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("a_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bf16_base_within_the_split_or_tensor_core_bound(a_dtype):
    W, A, B, s = _adapter(1024, 4096, 64, 1.0, w_dtype=torch.bfloat16, a_dtype=a_dtype)
    e = _norm_errors(W, A, B, s)
    assert e["err_over_bound_factored_max"] <= 1, e
    assert ("split" in e["model"]) == (a_dtype == torch.float32)


def test_accumulation_probe_confirms_the_order_free_charge_at_the_operators_shapes():
    """Every probed GEMM shape (up to one TC_BLOCK_K block): the order explained by the blocked model, products
    exact, and the 2u-per-addition charge confirmed (factor <= 1); subnormal 16-bit inputs kept (the model has
    no term for flushed inputs)."""
    recs = record_accumulation(smoke=False)
    probes = [r for r in recs if "bound" in r]
    bad = [(r["format"], r["product"], r["M"], r["N"], r["K"]) for r in probes
           if not (r["bound"].get("valid") and r["bound"]["factor"] <= 1)]
    assert not bad, bad
    assert all(r["subnormal_inputs_kept"] for r in recs if r.get("probe") == "subnormal inputs")


def test_guard_certifies_the_70b_down_projection():
    """d_in = 28,672, r = 256, rho = 0.2 (bf16 base; fp32 and bf16 adapters): no row flagged."""
    rows = [r for r in record_fire_rate(smoke=False, shapes={"70B down": (8192, 28672)}) if r["r"] == 256 and r["rho"] == 0.2]
    assert rows and all(r["flagged"] == 0 for r in rows), rows


def test_subnormal_input_probe_runs():
    for fmt in ("bf16", "fp16"):
        p = _subnormal_input_probe(fmt)
        assert p["input"] > 0 and p["exact"] > 0
