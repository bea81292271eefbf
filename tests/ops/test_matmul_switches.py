"""torch's fp32 matmul switches (TF32 on CUDA; bf16 GEMMs through oneDNN on the CPU under
``torch.set_float32_matmul_precision("medium")``) against the products lemmas 4, 4' and 5 need.

On this CPU the bf16 switch is real: an fp32 GEMM then rounds its inputs to bf16.  The factored
norm's products must not follow it silently: they are formed where the switch cannot reach them
(float64 accumulation, ``dora_num.ops.products.product_model``), the guard does not certify terms
from the torch tail's own fp32 GEMM, its row magnitudes are no GEMM at all, and the dense norm's
bound takes the switch as an argument.  Ground truth: exact rationals written here."""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import numpy as np
import pytest
import torch

import dora_num as dn
from dora_num.numerics.bounds import dense_norm_bound, factored_norm_bound
from dora_num.numerics.formulas import scale_constants
from dora_num.ops.config import get_config
from dora_num.ops.guard import CANCELLATION_REL
from dora_num.ops.norm import _factored_core, chunk_columns
from numerics._exact_ref import exact_row_norm_sq, norm_within

MKL = torch.backends.mkldnn.matmul


@pytest.fixture
def bf16_gemms():
    """oneDNN's fp32 GEMMs in bf16 for the test (what "medium" selects on the CPU), restored after."""
    before = MKL.fp32_precision
    MKL.fp32_precision = "bf16"
    try:
        yield
    finally:
        MKL.fp32_precision = before


def _layer(d_out=6, d_in=128, r=64, seed=0, rho=1.0):
    """fp32 W, A, B with ||sBA|| about rho ||W|| per row (the update as large as the row)."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)
    A = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
    B = torch.randn(d_out, r, generator=gen) * rho / math.sqrt(r)
    return W, A, B, 1.0


_exact_q, _within = exact_row_norm_sq, norm_within


def test_the_switch_is_real_on_this_cpu_and_is_read(bf16_gemms):
    """The premise: under the switch an fp32 GEMM of this shape is a bf16 one (errors of 2^-9 of the
    magnitudes, far above fp32's gamma_d), and fp32_matmul_precision reads the switch."""
    from dora_num.ops.products import fp32_matmul_precision

    W, A, _, _ = _layer()
    U = (W @ A.T).double()
    exact = W.double() @ A.double().T
    mag = W.double().abs() @ A.double().abs().T
    assert float(((U - exact).abs() / mag).max()) > 2.0**-12  # not an fp32 product
    assert fp32_matmul_precision("cpu") == "bf16"
    MKL.fp32_precision = "ieee"
    assert fp32_matmul_precision("cpu") == "ieee"


def test_fp32_matmul_precision_reads_every_switch():
    """Legacy and per-backend settings alike, without torch.get_float32_matmul_precision (which
    raises once the two APIs are mixed)."""
    from dora_num.ops.products import fp32_matmul_precision

    cuda = torch.backends.cuda.matmul
    saved = (cuda.allow_tf32, MKL.fp32_precision)
    try:
        assert fp32_matmul_precision("cpu") == "ieee" and fp32_matmul_precision("cuda") == "ieee"
        cuda.allow_tf32 = True
        assert fp32_matmul_precision("cuda") == "tf32" and fp32_matmul_precision("cpu") == "ieee"
        cuda.allow_tf32 = False
        MKL.fp32_precision = "tf32"
        assert fp32_matmul_precision("cpu") == "tf32"
        MKL.fp32_precision = "ieee"
        torch.set_float32_matmul_precision("medium")
        assert fp32_matmul_precision("cpu") == "bf16" and fp32_matmul_precision("cuda") == "tf32"
        torch.set_float32_matmul_precision("high")
        assert fp32_matmul_precision("cpu") == "tf32" and fp32_matmul_precision("cuda") == "tf32"
    finally:
        torch.set_float32_matmul_precision("highest")
        cuda.allow_tf32, MKL.fp32_precision = saved
    assert fp32_matmul_precision("cpu") == "ieee" and fp32_matmul_precision("cuda") == "ieee"


@pytest.mark.parametrize("rho", [1.0, 0.1], ids=["update-as-large-as-W", "realistic-update"])
def test_factored_norm_within_lemma_4_under_the_bf16_switch(bf16_gemms, rho):
    """The bare factored norm (no guard) stays within lemma 4's fp32 bound with the switch on: its
    products do not become bf16 GEMMs."""
    W, A, B, s = _layer(rho=rho)
    q = _exact_q(W, A, B, s)
    w = dn.factored_row_norm(W, A, B, s, on_cancellation="off").double().tolist()
    E = factored_norm_bound(W.double().numpy(), A.double().numpy(), B.double().numpy(), s)
    bad = [j for j in range(len(q)) if not _within(w[j], float(E[j]), q[j])]
    assert not bad, f"rows {bad} outside lemma 4's bound under the bf16 switch"


def test_guard_certificate_holds_under_the_bf16_switch(bf16_gemms):
    """Lemma 4' from the operator's own terms: wherever the guard certifies a row (rel <= 2^-6) the
    factored value is within rel of the exact norm; and the returned (guarded) norm is within 2^-6
    on every row."""
    W, A, B, s = _layer(rho=1.0)
    q = _exact_q(W, A, B, s)
    d_out, d_in = W.shape
    core = _factored_core(W, A, B, scale_constants(s), chunk_columns(d_out, d_in, None), None, None, get_config())
    w, rel = core.wnorm.double().tolist(), core.rel.double().tolist()
    for j in range(d_out):
        if rel[j] <= CANCELLATION_REL:
            exact = Fr(w[j]) / (1 + Fr(rel[j]))  # |w^ - w| <= rel w  <=>  w >= w^ / (1 + rel) ...
            assert exact * exact <= q[j] <= (Fr(w[j]) / (1 - Fr(rel[j]))) ** 2, (j, rel[j])
    guarded = dn.factored_row_norm(W, A, B, s).double().tolist()
    assert all(_within(guarded[j], CANCELLATION_REL * math.sqrt(float(q[j])) * 1.001, q[j]) for j in range(d_out))


def test_row_magnitudes_are_upper_bounds_under_the_bf16_switch(bf16_gemms):
    """lora_abs >= sum_k |B_jk| ||A_k|| exactly (the guard's Cauchy-Schwarz magnitude): a bf16
    matrix-vector product would round it below."""
    from dora_num.numerics.norm_bounds import lora_row_magnitudes

    _, A, B, _ = _layer(d_out=1024, r=64)
    G = (A.double() @ A.double().T).float()
    la, _ = lora_row_magnitudes(B, G, d_in=A.shape[1])
    nA = [math.sqrt(sum(Fr(v) ** 2 for v in row)) for row in A.tolist()]  # ||A_k||, rounded twice: 1e-16
    lower = np.abs(B.double().numpy()) @ np.array(nA) * (1 - 1e-12)
    short = np.flatnonzero(la.double().numpy() < lower)
    assert short.size == 0, f"{short.size} rows with lora_abs below sum_k |B_jk| ||A_k||"


def test_dense_norm_bound_takes_the_switch(bf16_gemms):
    """The dense norm's fp32 ``B @ A`` follows the switch: within lemma 5 for the bf16 GEMM model
    (``matmul="bf16"``), and outside the IEEE bound on some row (so the argument is needed)."""
    W, A, B, s = _layer(rho=1.0)
    q = _exact_q(W, A, B, s)
    w = dn.dense_row_norm(W, A, B, s).double().tolist()
    args = (W.double().numpy(), A.double().numpy(), B.double().numpy(), s)
    E_bf16, E_ieee = dense_norm_bound(*args, matmul="bf16"), dense_norm_bound(*args)
    assert all(_within(w[j], float(E_bf16[j]), q[j]) for j in range(len(q)))
    assert not all(_within(w[j], float(E_ieee[j]), q[j]) for j in range(len(q)))
