"""torch's fp32 matmul switches (TF32 on CUDA; bf16 GEMMs through oneDNN on the CPU under
``torch.set_float32_matmul_precision("medium")``) against the products lemmas 4, 4' and 5 need.

Whether the bf16 switch is real is a property of the CPU: oneDNN makes bf16 primitives for fp32 GEMMs
under it on some CPUs (an Intel Xeon) and none on others (an AMD EPYC with avx512_bf16 ran the same GEMM
in fp32).  The tests that need it measure it first and skip, with the measured error, where it is not.
The factored norm's products must not follow the switch silently: they are formed where the switch cannot reach them
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


def _switched_gemm_error() -> float:
    """Largest error of ``W @ A.T`` (fp32, under whatever switch is set), relative to ``|W| @ |A|.T``,
    against float64 (exact here: 128 products of 24-bit values summed in 53 bits lose < 2^-40)."""
    W, A, _, _ = _layer()
    exact = W.double() @ A.double().T
    return float((((W @ A.T).double() - exact).abs() / (W.double().abs() @ A.double().abs().T)).max())


#: An fp32 GEMM of length 128 errs by at most gamma_128 ~ 2^-17 of the magnitudes; one whose inputs were
#: rounded to bf16 by about 2^-9. Half-way on a log scale separates the two with margin on both sides.
BF16_GEMM_FLOOR = 2.0**-12


@pytest.fixture
def real_bf16_switch(bf16_gemms):
    """The premise of the tests that need the switch to act: measured, and a visible skip where false."""
    err = _switched_gemm_error()
    if err <= BF16_GEMM_FLOOR:
        from dora_num.repro.determinism import cpu_info

        pytest.skip(f"premise false on this CPU ({cpu_info()['model']}): under the bf16 switch oneDNN ran the fp32 GEMM in "
                    f"fp32, measured error {err:.3g} of the magnitudes, not above 2^-12")
    return err


def _layer(d_out=6, d_in=128, r=64, seed=0, rho=1.0):
    """fp32 W, A, B with ||sBA|| about rho ||W|| per row (the update as large as the row)."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)
    A = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
    B = torch.randn(d_out, r, generator=gen) * rho / math.sqrt(r)
    return W, A, B, 1.0


_exact_q, _within = exact_row_norm_sq, norm_within


def test_fp32_matmul_precision_reads_the_bf16_switch(bf16_gemms):
    """fp32_matmul_precision reports the switch on every CPU, whether or not oneDNN acts on it: the
    dense bound then takes the bf16 model, which holds for an fp32 GEMM too."""
    from dora_num.ops.products import fp32_matmul_precision

    assert fp32_matmul_precision("cpu") == "bf16"
    MKL.fp32_precision = "ieee"
    assert fp32_matmul_precision("cpu") == "ieee"


def test_the_ieee_setting_gives_an_fp32_gemm():
    """The other side of the premise's threshold, on every CPU: with the switch off the same GEMM is an
    fp32 one, below 2^-12 (so the threshold is not passed by any fp32 GEMM)."""
    assert MKL.fp32_precision in ("ieee", "none")
    assert _switched_gemm_error() <= BF16_GEMM_FLOOR


def test_the_switch_makes_a_bf16_gemm_where_the_cpu_has_one(real_bf16_switch):
    """Where oneDNN acts on the switch, the GEMM's error is a bf16 GEMM's (about 2^-9 of the
    magnitudes): the premise of the tests below that use ``real_bf16_switch``."""
    assert real_bf16_switch > BF16_GEMM_FLOOR


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
def test_factored_norm_within_lemma_4_under_the_bf16_switch(real_bf16_switch, rho):
    """The bare factored norm (no guard) stays within lemma 4's fp32 bound with the switch on: its
    products do not become bf16 GEMMs."""
    W, A, B, s = _layer(rho=rho)
    q = _exact_q(W, A, B, s)
    w = dn.factored_row_norm(W, A, B, s, on_cancellation="off").double().tolist()
    E = factored_norm_bound(W.double().numpy(), A.double().numpy(), B.double().numpy(), s)
    bad = [j for j in range(len(q)) if not _within(w[j], float(E[j]), q[j])]
    assert not bad, f"rows {bad} outside lemma 4's bound under the bf16 switch"


def test_guard_certificate_holds_under_the_bf16_switch(real_bf16_switch):
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


def test_row_magnitudes_are_upper_bounds_under_the_bf16_switch(real_bf16_switch):
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


def _dense_case():
    W, A, B, s = _layer(rho=1.0)
    q = _exact_q(W, A, B, s)
    w = dn.dense_row_norm(W, A, B, s).double().tolist()
    args = (W.double().numpy(), A.double().numpy(), B.double().numpy(), s)
    return q, w, dense_norm_bound(*args, matmul="bf16"), dense_norm_bound(*args)


def test_dense_norm_within_the_bf16_model_under_the_switch(bf16_gemms):
    """The dense norm's fp32 ``B @ A`` follows the switch: within lemma 5 for the bf16 GEMM model
    (``matmul="bf16"``) on every CPU (an fp32 GEMM is within it too)."""
    q, w, E_bf16, _ = _dense_case()
    bad = [j for j in range(len(q)) if not _within(w[j], float(E_bf16[j]), q[j])]
    assert not bad, f"rows {bad}: dense norm {[w[j] for j in bad]} outside lemma 5's bf16 bound"


def test_dense_norm_bound_needs_the_switch_argument(real_bf16_switch):
    """Where the switch acts, the IEEE bound is exceeded on some row: the argument is needed."""
    q, w, _, E_ieee = _dense_case()
    assert not all(_within(w[j], float(E_ieee[j]), q[j]) for j in range(len(q)))
