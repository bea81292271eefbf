"""The merge bound (lemma 10 of docs/bounds.md, ``dora_num.numerics.merge_bound``) over its domain:
every product of every GEMM is an underflow site (and a backend may flush subnormal products, partial
sums and inputs: CPU bf16 GEMMs do), so a layer whose activations and weights make every product
subnormal is within the bound; the merged and the unmerged outputs are each within their own part of
it against the exact output, decided in rationals here."""

from __future__ import annotations

from fractions import Fraction as Fr

import numpy as np
import pytest
import torch

import dora_num as dn
from dora_num.numerics.formulas import scale_constants
from dora_num.numerics.merge_bound import merged_linear_bound
from dora_num.wrapper import gemm_units


def _layer(d_in, d_out=4, r=2, dtype=torch.float32, w_scale=1e-20, b_scale=0.5, g_scale=1.0, adapters=None, seed=0):
    """A DoRALinear with W, A ~ w_scale (products of x ~ w_scale with them far below fp32's normal range),
    B ~ b_scale, m scaled by g_scale (g = g_scale); the base in ``dtype``, the adapters in ``adapters``
    (default: the base's dtype; fp32 adapters on a bf16 base is PEFT's default)."""
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=gen) * w_scale)
    layer = dn.DoRALinear(lin.to(dtype), r)
    layer.to(dtype if adapters is None else adapters)
    layer.base.to(dtype)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(r, d_in, generator=gen) * w_scale)
        layer.lora_B.copy_(torch.randn(d_out, r, generator=gen) * b_scale)
        layer.magnitude.mul_(g_scale)
    return layer


# (d_in, base dtype, adapter dtype, scale of x, W and A, g): every product of x W^T below 2^-126 (fp32:
# rounded on the subnormal grid, 2^-150 each; CPU bf16 GEMMs flush them)
SUBNORMAL = {"fp32-64": (64, torch.float32, None, 3e-23, 1.3), "fp32-4096": (4096, torch.float32, None, 3e-23, 1.3),
             "fp32-4096-g1": (4096, torch.float32, None, 1e-22, 1.0),
             "bf16-fp32-adapters-1024": (1024, torch.bfloat16, torch.float32, 1e-20, 1.0),
             "bf16-64": (64, torch.bfloat16, None, 1e-20, 1.3)}


@pytest.mark.parametrize("case", list(SUBNORMAL))
def test_every_product_subnormal_merge_within_bound(case):
    d_in, dtype, adapters, scale, g = SUBNORMAL[case]
    layer = _layer(d_in, dtype=dtype, w_scale=scale, g_scale=g, adapters=adapters)
    x = (torch.randn(8, d_in, generator=torch.Generator().manual_seed(1)) * scale).to(dtype)
    rep = dn.merge(torch.nn.Sequential(layer), x, probe_rows=8)
    assert rep.within_bound, str(rep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merged_and_unmerged_each_within_their_part(dtype):
    """E_m bounds |y_merged - y| and E_u bounds |y_unmerged - y| for the exact y = x W'^T, W' = g (W + s B A)
    (rationals), with the products subnormal and normal side by side."""
    d_in, d_out, r = 48, 3, 2
    layer = _layer(d_in, d_out, r, dtype=dtype)
    with torch.no_grad():
        layer.base.weight[0] *= 1e20  # a row of normal products beside the subnormal ones
    x = (torch.randn(5, d_in, generator=torch.Generator().manual_seed(2)) * 1e-20).to(dtype)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        g = layer.magnitude_scale().detach()
        y_u = layer(x, g=g).double()
        W = layer.base.weight.detach().clone()
        compose_dt = torch.promote_types(torch.promote_types(layer.lora_A.dtype, layer.lora_B.dtype), W.dtype)
        layer.merge(g)
        y_m = layer(x).double()
    s = scale_constants(layer.scale)[0]
    t = lambda v: v.detach().double().numpy()  # noqa: E731
    E_m, E_u = merged_linear_bound(t(x), t(W), None, t(layer.lora_A), t(layer.lora_B), t(g), s, base_dtype=W.dtype,
                                   compose_dtype=compose_dt, gemm_base=gemm_units(W.dtype, W.device),
                                   gemm_compose=gemm_units(compose_dt, W.device),
                                   gemm_fp32=gemm_units(torch.float32, W.device), parts=True)
    Wf = [[Fr(v) for v in row] for row in t(W).tolist()]
    Af = [[Fr(v) for v in row] for row in t(layer.lora_A).tolist()]
    Bf = [[Fr(v) for v in row] for row in t(layer.lora_B).tolist()]
    gf, sf = [Fr(v) for v in t(g).tolist()], Fr(s)
    Wp = [[gf[j] * (Wf[j][i] + sf * sum(Bf[j][k] * Af[k][i] for k in range(r))) for i in range(d_in)]
          for j in range(d_out)]
    for n, xrow in enumerate(t(x).tolist()):
        xf = [Fr(v) for v in xrow]
        for j in range(d_out):
            y = sum(a * b for a, b in zip(xf, Wp[j]))
            assert abs(Fr(float(y_m[n, j])) - y) <= Fr(float(E_m[n, j])), (n, j)
            assert abs(Fr(float(y_u[n, j])) - y) <= Fr(float(E_u[n, j])), (n, j)
    assert np.isfinite(E_m).all() and np.isfinite(E_u).all()
