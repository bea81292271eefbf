"""The paper's failing configuration (studies/fma/deep_stack.py): the study kernel's sequence bit for bit under
the interpreter, the stack's harness on SMOKE sizes, the cosine-deficit bound (attained, never exceeded), and
what an adversarial 2-ulp error in ``g`` (the worst of ``div.full.f32``, emulated) does to a layer's cosine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
from dora_num.numerics.formulas import magnitude_scale, norm_assembly, scale_constants
from dora_num.ops.magnitude import default_eps
from dora_num.ops.reference import compose_stable_ref
from dora_num.studies.fma import deep_stack as D

pytestmark = pytest.mark.interpreter  # the kernel runs on CPU tensors


def _terms(n, seed):
    g = torch.Generator().manual_seed(seed)
    base_sq = torch.rand(n, generator=g) * 4 + 0.5
    cross = torch.randn(n, generator=g) * 0.05
    ba = torch.rand(n, generator=g) * 0.01
    base_sq[3], cross[3], ba[3] = 0.0, 0.0, 0.0  # a zero row: eps is the denominator there
    return base_sq, cross, ba


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", list(D.VARIANTS))
def test_the_kernel_is_the_production_sequence_bit_for_bit(dtype, variant):
    """Under the interpreter (whose division and sqrt are correctly rounded) every variant is the production
    sequence: ``g = m / sqrt_rn(assembly)`` and ``y = base + round(compose_stable)``, bit for bit."""
    T, N, scale = 24, 96, 2.0
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(T, N, generator=gen).to(dtype)
    lora = (0.01 * torch.randn(T, N, generator=gen)).to(dtype)
    terms = _terms(N, 2)
    m = (torch.sqrt(terms[0]) * (1 + 0.0015 * torch.randn(N, generator=gen))).float()
    y, g = D.fused_dora_forward(base, lora, terms, m, scale, variant)
    _, two_s, s_sq = scale_constants(scale)
    w = norm_assembly(TorchFP32CorrectSqrt, *terms, two_s, s_sq)
    g_ref = magnitude_scale(TorchFP32CorrectSqrt, m, w, default_eps(torch.float32))
    assert torch.equal(g, g_ref) and g[3] == m[3] / default_eps(torch.float32)
    assert torch.equal(y, base + compose_stable_ref(base, lora, g_ref, scale))


def test_bad_inputs_are_named():
    base = torch.zeros(4, 8, dtype=torch.bfloat16)
    terms = _terms(8, 0)
    with pytest.raises(ValueError, match="variant must be one of"):
        D.fused_dora_forward(base, base, terms, torch.ones(8), 1.0, "fast")
    with pytest.raises(ValueError, match="bf16 or fp32"):
        D.fused_dora_forward(base.half(), base.half(), terms, torch.ones(8), 1.0, "paper")
    with pytest.raises(ValueError, match="m must be float32"):
        D.fused_dora_forward(base, base, terms, torch.ones(8, dtype=torch.float64), 1.0, "paper")


def test_the_deficit_bound_is_attained_and_never_exceeded():
    """``1 - cos(y, y + e) <= 1 - sqrt(1 - eps^2)`` for ``|e| = eps |y|``, with equality where ``e`` is
    perpendicular to ``y + e``; the stable deficit resolves it at 1e-9."""
    rng = np.random.default_rng(0)
    y = torch.from_numpy(rng.standard_normal((64, 512)))
    for eps in (1e-1, 1e-3, 2.0**-22):
        u = torch.from_numpy(rng.standard_normal(y.shape))
        u -= (u * y).sum(-1, keepdim=True) / (y * y).sum(-1, keepdim=True) * y  # perpendicular to y
        u /= torch.linalg.vector_norm(u, dim=-1, keepdim=True)
        sin, cos = eps, math.sqrt(1 - eps**2)
        ny = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
        worst = y * cos**2 + ny * sin * cos * u  # at angle asin(eps) from y, |worst - y| = eps |y|
        bound = float(D.cosine_deficit_bound(eps))
        assert torch.allclose(torch.linalg.vector_norm(worst - y, dim=-1) / ny[:, 0], torch.tensor(eps,
                              dtype=torch.float64), rtol=1e-9)
        assert torch.allclose(D.cosine_deficit(worst, y), torch.tensor(bound, dtype=torch.float64), rtol=1e-6)
        e = torch.from_numpy(rng.standard_normal(y.shape))
        e *= eps * ny / torch.linalg.vector_norm(e, dim=-1, keepdim=True)
        assert (D.cosine_deficit(y + e, y) <= bound * (1 + 1e-9)).all()
    assert D.cosine_deficit_bound(2.0**-22) <= 2.0**-44 / (2 - 2.0**-44)


def test_a_2ulp_division_error_moves_a_layers_cosine_by_at_most_the_bound():
    """The worst of ``div.full.f32`` (2 ulp in the fp32 ``g``, a random sign per row) emulated with nextafter:
    relative output error <= 2^-22 per element before rounding, so ``1 - cos <= 2^-44 / (2 - 2^-44)`` (attained
    to within a factor 2 by random signs); after the production bf16 roundings it changes a few outputs by one
    ulp, a cosine deficit below 1% of what the bf16 roundings themselves cost (exact reference: float64)."""
    T, N, s = 256, 1024, 2.0
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(T, N, generator=gen).bfloat16()
    lora = (0.01 * torch.randn(T, N, generator=gen)).bfloat16()
    g = (1 + 0.0015 * torch.randn(N, generator=gen)).float()
    g2 = D.pm2ulp(g, gen)
    rel_g = ((g2.double() - g.double()).abs() / g.double())
    assert (rel_g > 0).all() and float(rel_g.max()) <= 2.0**-22
    v = base.double() + s * lora.double()
    y, y2 = g.double() * v, g2.double() * v  # the exact layer outputs (float64: 24 x 16 bits, exact)
    eps = (torch.linalg.vector_norm(y2 - y, dim=-1) / torch.linalg.vector_norm(y, dim=-1)).numpy()
    assert eps.max() <= 2.0**-22
    deficit = D.cosine_deficit(y2, y).numpy()
    bound = D.cosine_deficit_bound(eps)
    assert (deficit <= bound * (1 + 1e-6)).all() and (deficit >= bound / 2).all()
    out = base + compose_stable_ref(base, lora, g, s)  # production: delta rounded, then base + delta rounded
    out2 = base + compose_stable_ref(base, lora, g2, s)
    changed = float((out != out2).double().mean())
    assert 0 < changed < 1e-3  # 3e-5 here: outputs within 2^-22 of a rounding boundary of the delta or the sum
    moved = D.cosine_deficit(out2, out)  # the whole deficit the division adds (energy of the changed outputs)
    rounding = D.cosine_deficit(out, y)  # what production's two bf16 roundings cost against the exact output
    assert float(moved.mean()) < 0.01 * float(rounding.mean())  # 2.2e-4 times it here


def test_the_smoke_stack_runs_every_path_and_the_kernel_is_production_there():
    """SMOKE sizes on the CPU: every path against float64; the interpreter's kernel variants are production bit
    for bit (its division and sqrt are exact: a check of the harness, not of the GPU); ``g_pm2ulp`` moves every
    ``g`` by 2 ulp; each token's deficit is within the bound of its relative error."""
    rows = {(r["depth"], r["path"]): r for r in D.measure(D.make_stack(D.SMOKE, 0, "cpu"), 0)}
    assert sorted({p for _, p in rows}) == sorted(D.PATHS) and {d for d, _ in rows} == set(D.SMOKE.depths)
    for (depth, path), r in rows.items():
        assert 0 < r["one_minus_cos_max"] <= D.cosine_deficit_bound(r["rel_err_max_token"]) * (1 + 1e-9)
        assert r["one_minus_cos_median"] <= r["one_minus_cos_max"] < 1e-3
        if path in D.VARIANTS or path == "production":
            assert r["frac_logits_bitwise_production"] == 1.0 and r["g_frac_differ_vs_production"] == 0.0
            assert r["g_frac_exactly_one_in_g1_rows"] == 1.0
    pm = rows[(4, "g_pm2ulp")]
    assert pm["g_frac_differ_vs_production"] == 1.0 and pm["g_max_ulp_vs_production"] == 2
    assert pm["g_frac_exactly_one_in_g1_rows"] == 0.0
    peft = rows[(4, "peft_bf16")]
    assert peft["frac_logits_bitwise_production"] < 1 and peft["g_max_ulp_vs_production"] > 2**10
