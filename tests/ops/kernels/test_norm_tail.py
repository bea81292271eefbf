"""The one-launch tail of the factored norm (:mod:`dora_num.ops.kernels.norm_tail`).

On CPU under TRITON_INTERPRET=1 (tests/conftest.py); the H200 runs the same
kernel in tests/ops/kernels/test_gpu_kernels.py.  Bitwise claims are made where the
sums are exact in any order (small integers), so the assembly, the clamp and the
division are checked against torch with nothing left to summation order; the
bound of the whole norm is in tests/ops/test_norm.py.
"""

import math

import pytest
import torch

import dora_num as dn
from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
from dora_num.numerics.formulas import norm_assembly, scale_constants
from dora_num.ops import norm as N
from dora_num.ops.kernels.norm_tail import BLOCK_M, norm_tail

from ._bitwise import assert_bitwise

SHAPES = [(1, 1), (3, 7), (33, 16), (63, 40), (100, 65)]  # (d_out, r): masks on both axes


@pytest.fixture
def tail_kernel(monkeypatch):
    if not N._tail_kernel_used(torch.device("cpu")) and not torch.cuda.is_available():
        monkeypatch.setattr(N, "NORM_TAIL", "triton")
    yield


def _exact_inputs(d_out, r, dtype=torch.float32, seed=0, device="cpu"):
    """Small-integer U, B, G: every product and partial sum of cross = rowsum(B*U) and
    ba = rowsum((B@G)*B) is an fp32 integer below 2^24 (r <= 4096), so exact in any order.
    G is symmetric but not PSD: some rows get ba < 0 and t < 0, which the clamp zeroes."""
    gen = torch.Generator().manual_seed(seed)
    U = torch.randint(-8, 9, (d_out, r), generator=gen).float()
    B = torch.randint(-1, 2, (d_out, r), generator=gen).to(dtype)
    H = torch.randint(-2, 3, (r, r), generator=gen).float()
    G = torch.triu(H) + torch.triu(H, 1).T
    base = torch.randint(1, 2**18, (d_out,), generator=gen).float() * 8.0
    return tuple(t.to(device) for t in (U, B, G, base))


def _exact_terms(U, B, G):
    B64 = B.double()
    BG = B64 @ G.double()
    cross = (B64 * U.double()).sum(1)
    ba = (BG * B64).sum(1)
    assert max(float(BG.abs().max()), float(cross.abs().max()), float(ba.abs().max())) < 2**24  # exact in fp32
    return cross.float(), ba.float()


@pytest.mark.parametrize("d_out,r", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_tail_bitwise_on_exact_sums(d_out, r, dtype):
    U, B, G, base = _exact_inputs(d_out, r, dtype)
    _, two_s, s_sq = scale_constants(0.37)
    m = 0.5 + torch.rand(d_out)
    w, den, bad = norm_tail(U, B, G, base, two_s, s_sq, m=m, eps=1e-12)
    cross, ba = _exact_terms(U, B, G)
    want = norm_assembly(TorchFP32CorrectSqrt, base, cross, ba, two_s, s_sq)
    assert_bitwise(w, want)
    assert_bitwise(den, want.clamp_min(1e-12))
    assert not bool(bad.any())
    w2, den2, bad2 = norm_tail(U, B, G, base, two_s, s_sq)  # without m: the norm only
    assert_bitwise(w2, want)
    assert den2 is None and bad2 is None


def test_tail_flag_names_nonfinite_rows_and_ignores_masked_ones():
    d_out, r = BLOCK_M + 5, 9  # the second program has 27 masked rows
    U, B, G, base = _exact_inputs(d_out, r)
    _, two_s, s_sq = scale_constants(0.5)
    m = torch.ones(d_out)

    def flag(**kw):
        args = dict(U=U, B=B, G=G, base_sq=base, m=m, eps=1e-12)
        args.update(kw)
        return norm_tail(args["U"], args["B"], args["G"], args["base_sq"], two_s, s_sq,
                         m=args["m"], eps=args["eps"])[2].tolist()  # one slot per program, each written

    # eps = 0: a masked row (all-zero terms) has den = 0 and g = 1/0 = inf; only the
    # row mask keeps it out of the flag (every real row here has wnorm > 0)
    assert flag(eps=0.0) == [0, 0]

    assert flag() == [0, 0]
    for bad_m in (float("nan"), float("inf"), -float("inf")):
        m2 = m.clone()
        m2[-1] = bad_m  # the last row, in the partly masked program
        assert flag(m=m2) == [0, 1], bad_m
    B2 = B.clone()
    B2[3, 2] = float("nan")
    assert flag(B=B2) == [1, 0]
    U2 = U.clone()
    U2[0] = 3e38  # 2s*cross overflows: wnorm = inf, g = m/inf = 0 is finite, the flag still fires
    assert flag(U=U2) == [1, 0]
    # a zero row of W + sBA: wnorm = 0 exactly, den = eps, g = m / eps finite: no flag
    Z = torch.zeros_like(U)
    w, den, bad = norm_tail(Z, torch.zeros_like(B), G, torch.zeros_like(base), two_s, s_sq, m=m, eps=1e-12)
    assert float(w.abs().max()) == 0.0 and not bool(bad.any())
    assert_bitwise(den, torch.full_like(den, 1e-12))


def test_tail_rejects_bad_arguments_and_handles_empty():
    U, B, G, base = _exact_inputs(4, 3)
    with pytest.raises(ValueError, match="U must be"):
        norm_tail(U.double(), B, G, base, 1.0, 0.25)
    with pytest.raises(ValueError, match="G must be"):
        norm_tail(U, B, G[:2], base, 1.0, 0.25)
    with pytest.raises(ValueError, match="m must be"):
        norm_tail(U, B, G, base, 1.0, 0.25, m=torch.ones(5), eps=1e-12)
    with pytest.raises(ValueError, match="eps"):
        norm_tail(U, B, G, base, 1.0, 0.25, m=torch.ones(4))
    w, den, bad = norm_tail(U[:0], B[:0], G, base[:0], 1.0, 0.25, m=torch.ones(0), eps=1e-12)
    assert w.shape == (0,) and den.shape == (0,) and not bool(bad.any())


@pytest.mark.parametrize("m_dtype", [torch.float32, torch.bfloat16], ids=["m-fp32", "m-bf16"])
def test_layer_fast_g_is_magnitude_scale_of_its_norm(m_dtype, tail_kernel):
    """DoRALinear's forward g (tail kernel: clamp in the kernel, division in torch) is bitwise
    ``magnitude_scale(m, wnorm)`` of the same norm, and differentiable in m like it."""
    torch.manual_seed(0)
    layer = dn.DoRALinear(torch.nn.Linear(96, 70, bias=False), rank=12, alpha=24.0)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.05)
        layer.base.weight[5] = 0.0  # a zero row
        layer.lora_B[5] = 0.0
    layer.magnitude.data = layer.magnitude.data.to(m_dtype)
    g, bad = layer._g_fast()
    assert not bool(bad.any()) and g.dtype == torch.float32
    wnorm = layer.weight_norm()
    want = dn.magnitude_scale(layer.magnitude, wnorm)
    assert_bitwise(g, want)
    (gm,) = torch.autograd.grad(g.sum(), layer.magnitude)
    (wm,) = torch.autograd.grad(want.sum(), layer.magnitude)
    assert_bitwise(gm, wm)


def test_layer_with_tail_kernel_names_bad_input(tail_kernel):
    torch.manual_seed(1)
    layer = dn.DoRALinear(torch.nn.Linear(40, 24), rank=4)
    x = torch.randn(3, 40)
    y = layer(x)
    assert torch.isfinite(y).all()
    with torch.no_grad():
        layer.lora_A[1, 3] = float("nan")
    with pytest.raises(ValueError, match="A contains non-finite"):
        layer(x)
    with torch.no_grad():
        layer.lora_A[1, 3] = 0.0
        layer.magnitude[2] = float("inf")
    with pytest.raises(ValueError, match="m contains non-finite"):
        layer(x)
    with torch.no_grad():  # finite inputs whose row norm overflows fp32: wnorm = inf, g = 0
        layer.magnitude[2] = 1.0
        layer.base.weight[7] = 1e30
    with pytest.raises(ValueError, match="base_sq contains non-finite .* overflowed float32"):
        layer(x)
    with torch.no_grad():  # W's own squares fit, W + sBA's do not
        layer.base.weight[7] = 2e18
        layer.lora_B[7] = 1e20
    with pytest.raises(ValueError, match=r"overflowed float32 \(inputs are finite\)"):
        layer(x)


def test_tail_and_torch_paths_agree_within_bound(monkeypatch):
    """The layer's g through the kernel and through the torch tail (DORA_NUM_NORM_TAIL=torch)."""
    from dora_num.numerics.bounds import factored_norm_bound

    torch.manual_seed(2)
    layer = dn.DoRALinear(torch.nn.Linear(200, 50, bias=False), rank=24, alpha=48.0)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.05)
    monkeypatch.setattr(N, "NORM_TAIL", "torch")
    g_torch, _ = layer._g_fast()
    monkeypatch.setattr(N, "NORM_TAIL", "triton")
    if not N._tail_kernel_used(torch.device("cpu")):
        pytest.skip("the CPU comparison needs TRITON_INTERPRET=1 (on a CUDA machine: "
                    "test_layer_g_tail_kernel_vs_torch_tail_within_bound in test_gpu_kernels.py)")
    g_tail, _ = layer._g_fast()
    W, A, B = (t.detach().numpy() for t in (layer.base.weight, layer.lora_A, layer.lora_B))
    w = layer.weight_norm().double().numpy()
    # both norms are within factored_norm_bound of the exact one; g inherits (1 + u) of it
    rel = torch.from_numpy(2 * factored_norm_bound(W, A, B, layer.scale) / w) + 3 * 2.0**-24
    assert bool(((g_tail.double() - g_torch.double()).abs() <= rel * g_torch.double().abs()).all())
    assert not math.isnan(float(g_tail.sum()))
