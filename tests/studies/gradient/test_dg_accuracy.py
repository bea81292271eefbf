"""dg = sum over rows of (s*lora + base) * D: exact reference, fused-tree emulation, a-priori bounds.

Reference ladder: the fused two-stage emulation is bitwise equal to the Triton kernel
(interpreter) -> every reduction's error against the exact dg is within
:func:`dora_num.numerics.bounds.dg_bound` -> the exact dg equals an independent
rational evaluation (fractions) rounded to float64.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from dora_num.numerics import bounds as B
from dora_num.numerics.formulas import scale_constants
from dora_num.ops.reference import compose_backward_ref, compose_inner_ref
from dora_num.studies import inputs
from dora_num.studies.gradient import dg_accuracy as da

SHAPES = [(1, 3), (3, 5), (63, 4), (1000, 7), (4097, 3)]


@pytest.mark.parametrize("T,N", [(1, 2), (5, 3), (64, 2)], ids=lambda v: str(v))
def test_exact_matches_fractions(T, N, regimes):
    lora, base, grad = regimes.dg(T, N, "fp32", seed=T)
    s = scale_constants(0.5)[0]
    got = da.dg_exact(s, lora, base, grad)
    L, b, D = (x.double().numpy() for x in (lora, base, grad))
    for j in range(N):
        ref = sum((Fraction(s) * Fraction(L[k, j]) + Fraction(b[k, j])) * Fraction(D[k, j]) for k in range(T))
        assert got[j] == float(ref), (j, got[j], float(ref))  # float(Fraction) rounds correctly


@pytest.mark.parametrize("T,N", SHAPES, ids=lambda v: str(v))
def test_fused_emulation_bitwise_equals_kernel(T, N, regimes):
    from dora_num.ops.config import get_config
    from dora_num.ops.kernels import compose as kc

    tiles = get_config().compose_tiles
    if not get_config().interpret and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on CPU) or CUDA")
    if torch.cuda.is_available():
        pytest.skip("the GPU's in-block tl.sum order differs from the interpreter's; covered by the bound")
    lora, base, grad = regimes.dg(T, N, "fp32", seed=11 + T)
    s = scale_constants(0.5)[0]
    inner = compose_inner_ref(base, lora, s)
    _, _, dg = kc.compose_bwd(grad, inner, torch.ones(N), s, need_dlora=False, need_dbase=False)
    terms = (inner * grad.float()).numpy()
    emu = da.fused_dg_emulated(terms, block_m=tiles.bwd_block_m, chunk=tiles.fin_chunk, order="sequential")
    assert np.array_equal(emu.view(np.uint32), dg.numpy().view(np.uint32))


def test_eager_reduction_is_the_reference_path(regimes):
    lora, base, grad = regimes.dg(1000, 6, "bf16", seed=3)
    s = scale_constants(0.5)[0]
    got = da.computed_dg(s, lora, base, grad, reductions=("eager",))["eager"]
    inner = compose_inner_ref(base, lora, s)
    ref = compose_backward_ref(grad, inner, torch.ones(6), s)[2]
    assert np.array_equal(got, ref.double().numpy())


CASES = [
    pytest.param(T, N, dt, kind, id=f"{kind}-{dt}-T{T}")
    for (T, N) in SHAPES for dt in ("bf16", "fp16", "fp32") for kind in ("random",)
] + [
    pytest.param(4097, 4, "bf16", "cancel", id="cancel-bf16-T4097"),
    pytest.param(1000, 4, "fp32", "cancel", id="cancel-fp32-T1000"),
    pytest.param(4096, 4, "bf16", "base128", id="absorbing-bf16-T4096"),
]


@pytest.mark.parametrize("T,N,dtype,kind", CASES)
def test_every_reduction_within_bound(T, N, dtype, kind, regimes):
    if kind == "cancel":  # rows in +/- pairs with the same inner: dg is a tiny residue (kappa huge)
        lora, base, grad = regimes.dg(T, N, dtype, seed=5, cancelling=True)
    else:
        lora, base, grad = regimes.dg(T, N, dtype, seed=7 + T, base_scale=128.0 if kind == "base128" else 1.0)
    s = 0.5
    ex = da.dg_exact(s, lora, base, grad)
    for order in ("sequential", "tree"):
        comp = da.computed_dg(s, lora, base, grad, reductions=da.REDUCTIONS, fused_order=order)
        for r, v in comp.items():
            bnd = B.dg_bound(s, lora.double().numpy(), base.double().numpy(), grad.double().numpy(), r,
                             block_m=64, chunk=64)
            err = np.abs(v - ex)
            assert np.all(err <= bnd), (r, order, float(np.max(err / bnd)))


def test_bound_is_not_vacuous_for_well_conditioned_data(regimes):
    # all products positive: kappa = 1, so the relative bound is ~ (A + 2) u
    lora, base, grad = regimes.dg(4096, 3, "fp32", seed=1)
    grad = grad.abs() * torch.sign(base.float() + 0.5 * lora.float())
    ex = da.dg_exact(0.5, lora, base, grad)
    for r in da.REDUCTIONS:
        bnd = B.dg_bound(0.5, lora.double().numpy(), base.double().numpy(), grad.double().numpy(), r,
                         block_m=64, chunk=64)
        A = B.dg_max_additions(r, 4096, block_m=64, chunk=64)
        u = 2.0**-53 if r == "fp64" else 2.0**-24
        # the inner rounding (2 u32) plus (A + 1) roundings of the sum, to first order
        assert np.all(bnd / np.abs(ex) <= 1.01 * (2 * 2.0**-24 + (A + 1) * u)), r


def test_max_additions():
    assert B.dg_max_additions("eager", 1) == 0
    assert B.dg_max_additions("eager", 4097) == 4096
    assert B.dg_max_additions("fused", 1, block_m=64, chunk=64) == 0
    assert B.dg_max_additions("fused", 64, block_m=64, chunk=64) == 63
    assert B.dg_max_additions("fused", 65, block_m=64, chunk=64) == 63 + 1
    # 65536 rows: 1024 partials, 16 chunks: 63 + 63 + 15
    assert B.dg_max_additions("fused", 65536, block_m=64, chunk=64) == 141
    with pytest.raises(ValueError, match="reduction"):
        B.dg_max_additions("atomic", 10)
    with pytest.raises(ValueError, match="n_rows"):
        B.dg_max_additions("eager", 0)
    with pytest.raises(ValueError, match="block_m"):
        B.dg_max_additions("fused", 10)


def test_dg_bound_rejects_bad_input():
    a = np.ones((4, 2))
    with pytest.raises(ValueError, match="one shape"):
        B.dg_bound(0.5, a, a, np.ones((3, 2)), "eager")
    with pytest.raises(ValueError, match="finite"):
        B.dg_bound(0.5, a, a, np.full((4, 2), np.nan), "eager")


def test_absorption_fraction_at_the_half_ulp():
    base = torch.full((4, 1), 128.0)  # bf16 ulp(128) = 1
    s = 0.5
    lora_in = torch.tensor([[0.125], [-0.375], [0.75], [0.5]]) / s
    # |s*lora| = 0.125, 0.375 (< 0.5: absorbed); 0.75 (kept); 0.5 (the tie: not < ulp/2, kept)
    assert da.absorption_fraction(s, lora_in, base, "bf16") == 0.5
    assert da.absorption_fraction(s, lora_in, base, "fp32") == 0.0


def test_adamw_first_step_is_a_sign_step():
    m0 = np.ones(3)
    g = np.array([3e-2, -1e-4, 5e-6])
    m1 = da.adamw_first_step(m0, g, lr=1e-3)
    expect = np.float32(1.0) - np.float32(1e-3) * np.sign(g) * np.abs(g) / (np.abs(g) + 1e-8)
    assert np.allclose(m1, expect, rtol=0, atol=2 * 2.0**-23)
    # doubling the gradient leaves the step unchanged where |g| >> eps (AdamW normalises it) ...
    m2 = da.adamw_first_step(m0, 2 * g, lr=1e-3)
    assert m2[0] == m1[0]
    # ... but not where |g| ~ eps * 10^3: there an error in dg reaches the magnitude
    assert m2[2] != m1[2]


def test_metrics_row_and_sweep_smoke():
    df = da.synthetic_sweep(Ts=(256, 1024), dtypes=("bf16",), N=4, base_scales=(1.0,))
    assert set(df["reduction"]) == set(da.REDUCTIONS) | {"lowp"}
    assert df.loc[df["reduction"].isin(da.REDUCTIONS), "bound_ok"].all()
    ex = da.growth_exponents(df)
    assert set(ex["reduction"]) >= set(da.REDUCTIONS) - {"fp64"}


def test_synthetic_inputs_reject_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        inputs.dg_operands(4, 2, "fp8", seed=0)


@pytest.mark.slow
def test_minilm_capture_does_not_follow_the_cpus_gemm_kernels():
    """Notebook 06's MiniLM capture, run under two of MKL's code branches (``COMPATIBLE``, the pinned one,
    and ``AUTO``, what an unpinned Intel or AMD host runs: different GEMM kernels, different last bits),
    gives the same tensors once rounded to each studied dtype. The fp32 capture it replaces differed in
    most elements (its loss and the layer's g were fp32, so the kernels' last bits steered training)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).with_name("_capture_probe.py")
    runs = {}
    for branch in ("COMPATIBLE", "AUTO"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
               "MKL_CBWR": branch}
        out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, check=True, env=env)
        runs[branch] = json.loads(out.stdout.strip().splitlines()[-1])
    differ = sorted(k for k in runs["COMPATIBLE"] if runs["COMPATIBLE"][k] != runs["AUTO"][k])
    assert len(runs["AUTO"]) == 9 and not differ, differ


def test_the_recorded_minilm_table_refuses_other_settings():
    """Notebook 06 reads its MiniLM table from the record: with the record's own settings it gets every row;
    with a setting the record was not made with, an error naming it, not that run's table."""
    from dora_num.repro.provenance import read_provenance
    from dora_num.studies.gradient.dg_accuracy import DG_MINILM, recorded_minilm_table

    made = read_provenance(DG_MINILM.path())["parameters"]
    keys = ("MINILM_STEPS", "MINILM_BATCH", "MINILM_MODULES", "LR", "SEED")
    table = recorded_minilm_table(**{k: made[k] for k in keys})
    assert len(table) == 12 * 3 * 4 and set(table["dtype"]) == {"bf16", "fp16", "fp32"}
    with pytest.raises(ValueError, match=r"MINILM_STEPS=3 \(asked 4\)"):
        recorded_minilm_table(**{k: made[k] for k in keys} | {"MINILM_STEPS": 4})
