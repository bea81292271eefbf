"""The one-launch tail of the factored norm (:mod:`dora_num.ops.kernels.norm_tail`).

Each test runs on the CPU under the Triton interpreter and on CUDA (``gpu``; the H200 also
runs the layer shapes).  Bitwise claims are made where the sums are exact in any order
(small integers), so the assembly, the clamp and the division are checked against torch
with nothing left to summation order; the bound of the whole norm is in
tests/ops/test_norm.py.
"""

import math

import pytest
import torch

import dora_num as dn
from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
from dora_num.numerics.bounds import factored_norm_bound
from dora_num.numerics.arithmetic import TorchFP32
from dora_num.numerics.formulas import magnitude_denominator, norm_assembly, scale_constants
from dora_num.ops.config import get_config, override
from dora_num.ops.guard import FLAG_NONFINITE
from dora_num.ops.kernels.norm_tail import norm_tail
from dora_num.ops.norm import uses_tail_kernel
from dora_num.ops.weight_norm import magnitude_scale_and_flag

from .helpers import (DEVICES, assert_bitwise, assert_tail_bitwise_lemma_4_prime, exact_tail_inputs,
                      exact_tail_terms)

SHAPES = [(1, 1), (3, 7), (33, 16), (63, 40), (100, 65)]  # (d_out, r): masks on both axes
CUDA_SHAPES = [(4096, 384), (8192, 512)]


def _shape_cases():
    out = []
    for dev in DEVICES:
        for d_out, r in SHAPES + (CUDA_SHAPES if dev.values[0] == "cuda" else []):
            out.append(pytest.param(dev.values[0], d_out, r, id=f"{dev.id}-{d_out}x{r}", marks=dev.marks))
    return out


@pytest.fixture
def tail_kernel():
    """The tail kernel also on the CPU (``norm_tail="triton"``; on CUDA it is the default)."""
    with override(norm_tail="triton") as cfg:
        yield cfg


def g_and_flag(layer):
    return magnitude_scale_and_flag(layer.base.weight, layer.lora_A, layer.lora_B, layer.scale, layer.magnitude,
                                    chunk_bytes=layer.chunk_bytes)


@pytest.mark.parametrize("device,d_out,r", _shape_cases())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_tail_bitwise_on_exact_sums(device, d_out, r, dtype):
    """B's entries are -1, 0, 1 (exact in every dtype, and upcast before any arithmetic), so
    bf16 runs on the interpreter too.  The assembly is the production sequence (no contraction,
    sqrt.rn): bitwise torch's with a correctly rounded sqrt."""
    U, B, G, base = exact_tail_inputs(d_out, r, dtype, device=device)
    _, two_s, s_sq = scale_constants(0.37)
    m = 0.5 + torch.rand(d_out, generator=torch.Generator().manual_seed(1)).to(device)
    w, den, bad, aux = norm_tail(U, B, G, base, two_s, s_sq, m=m, eps=1e-12)
    cross, ba = exact_tail_terms(U, B, G)
    want = norm_assembly(TorchFP32CorrectSqrt, base, cross, ba, two_s, s_sq)
    assert_bitwise(w, want)
    assert_bitwise(den, magnitude_denominator(TorchFP32, want, 1e-12))
    assert not bool(bad.any()) and aux is None
    w2, den2, bad2, _ = norm_tail(U, B, G, base, two_s, s_sq)  # without m: the norm only
    assert_bitwise(w2, want)
    assert den2 is None and bad2 is None
    m[-1] = float("nan")
    assert int(norm_tail(U, B, G, base, two_s, s_sq, m=m, eps=1e-12).flag.max()) == FLAG_NONFINITE


@pytest.mark.parametrize("device", DEVICES)
def test_tail_flag_names_nonfinite_rows_and_ignores_masked_ones(device):
    block_m = get_config().norm_tail_tiles.block_m
    d_out, r = block_m + 5, 9  # the second program has block_m - 5 masked rows
    U, B, G, base = exact_tail_inputs(d_out, r, device=device)
    _, two_s, s_sq = scale_constants(0.5)
    m = torch.ones(d_out, device=device)

    def flag(**kw):
        args = dict(U=U, B=B, G=G, base_sq=base, m=m, eps=1e-12)
        args.update(kw)
        return norm_tail(args["U"], args["B"], args["G"], args["base_sq"], two_s, s_sq,
                         m=args["m"], eps=args["eps"]).flag.tolist()  # one slot per program, each written

    # eps = 0: a masked row (all-zero terms) has den = 0 and g = 1/0 = inf; only the
    # row mask keeps it out of the flag (every real row here has wnorm > 0)
    assert flag(eps=0.0) == [0, 0]

    assert flag() == [0, 0]
    for bad_m in (float("nan"), float("inf"), -float("inf")):
        m2 = m.clone()
        m2[-1] = bad_m  # the last row, in the partly masked program
        assert flag(m=m2) == [0, FLAG_NONFINITE], bad_m
    B2 = B.clone()
    B2[3, 2] = float("nan")
    assert flag(B=B2) == [FLAG_NONFINITE, 0]
    U2 = U.clone()
    U2[0] = 3e38  # 2s*cross overflows: wnorm = inf, g = m/inf = 0 is finite, the flag still fires
    assert flag(U=U2) == [FLAG_NONFINITE, 0]
    # a zero row of W + sBA: wnorm = 0 exactly, den = eps, g = m / eps finite: no flag
    Z = torch.zeros_like(U)
    w, den, bad, _ = norm_tail(Z, torch.zeros_like(B), G, torch.zeros_like(base), two_s, s_sq, m=m, eps=1e-12)
    assert float(w.abs().max()) == 0.0 and not bool(bad.any())
    assert_bitwise(den, torch.full_like(den, 1e-12))


@pytest.mark.parametrize("device", DEVICES)
def test_tail_rejects_bad_arguments_and_handles_empty(device):
    U, B, G, base = exact_tail_inputs(4, 3, device=device)
    ones = torch.ones(5, device=device)
    with pytest.raises(ValueError, match="U must be"):
        norm_tail(U.double(), B, G, base, 1.0, 0.25)
    with pytest.raises(ValueError, match="G must be"):
        norm_tail(U, B, G[:2], base, 1.0, 0.25)
    with pytest.raises(ValueError, match="m must be"):
        norm_tail(U, B, G, base, 1.0, 0.25, m=ones, eps=1e-12)
    with pytest.raises(ValueError, match="eps"):
        norm_tail(U, B, G, base, 1.0, 0.25, m=ones[:4])
    w, den, bad, _ = norm_tail(U[:0], B[:0], G, base[:0], 1.0, 0.25, m=ones[:0], eps=1e-12)
    assert w.shape == (0,) and den.shape == (0,) and not bool(bad.any())


# ---- through the layer: g = m / den, the flag, the bound against the torch tail ----------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m_dtype", [torch.float32, torch.bfloat16], ids=["m-fp32", "m-bf16"])
def test_layer_fast_g_is_magnitude_scale_of_its_norm(m_dtype, device, tail_kernel):
    """DoRALinear's forward g (tail kernel: clamp in the kernel, division in torch) is bitwise
    ``magnitude_scale(m, wnorm)`` of the same norm, and differentiable in m like it."""
    torch.manual_seed(0)
    layer = dn.DoRALinear(torch.nn.Linear(96, 70, bias=False, device=device), rank=12, alpha=24.0)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.05)
        layer.base.weight[5] = 0.0  # a zero row
        layer.lora_B[5] = 0.0
    layer.magnitude.data = layer.magnitude.data.to(m_dtype)
    assert uses_tail_kernel(layer.magnitude.device)
    g, bad = g_and_flag(layer)
    assert not bool(bad.any()) and g.dtype == torch.float32
    want = dn.magnitude_scale(layer.magnitude, layer.weight_norm())
    assert_bitwise(g, want)
    (gm,) = torch.autograd.grad(g.sum(), layer.magnitude)
    (wm,) = torch.autograd.grad(want.sum(), layer.magnitude)
    assert_bitwise(gm, wm)


def _forward_checked(layer, x):
    """The forward and its finiteness check (read at a later call on CUDA: finite_check="deferred")."""
    layer(x)
    dn.check_pending()


@pytest.mark.parametrize("device", DEVICES)
def test_layer_with_tail_kernel_names_bad_input(device, tail_kernel):
    torch.manual_seed(1)
    layer = dn.DoRALinear(torch.nn.Linear(40, 24, device=device), rank=4)
    x = torch.randn(3, 40, device=device)
    y = layer(x)
    assert torch.isfinite(y).all()
    with torch.no_grad():
        layer.lora_A[1, 3] = float("nan")
    with pytest.raises(ValueError, match="A contains non-finite"):
        _forward_checked(layer, x)
    with torch.no_grad():
        layer.lora_A[1, 3] = 0.0
        layer.magnitude[2] = float("inf")
    with pytest.raises(ValueError, match="m contains non-finite"):
        _forward_checked(layer, x)
    with torch.no_grad():  # a norm beyond fp32 stays an error naming its row
        layer.magnitude[2] = 1.0
        layer.base.weight[7] = 3e38
    with pytest.raises(ValueError, match=r"forward call \d+: .*exceeds 3\.4e38 on rows \[7\]"):
        _forward_checked(layer, x)


@pytest.mark.parametrize("tail", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("w7, b7", [(1e30, None), (2e18, 1e20)], ids=["W-squares", "update-terms"])
def test_layer_g_where_fp32_squares_overflow_but_the_norm_fits(tail, w7, b7):
    """Finite rows whose fp32 squares overflow while the norm fits (W's own squares: the cached
    ``base_sq`` is +inf; or the terms of ``W + sBA``): the layer forms them in float64 on either tail,
    so its ``g`` is ``m / ||W + sBA||`` of the float64 oracle within fp32 rounding (the division and
    the one rounding of the float64 norm), the other rows untouched, no error."""
    from dora_num.oracles import row_norm_ref64

    torch.manual_seed(1)
    with override(norm_tail=tail):
        layer = dn.DoRALinear(torch.nn.Linear(40, 24), rank=4)
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.1)
            layer.base.weight[7] = w7
            if b7 is not None:
                layer.lora_B[7] = b7
        x = torch.randn(3, 40)
        y = layer(x)
        dn.check_pending()
        g = layer.magnitude_scale()
    W, A, B = (t.detach() for t in (layer.base.weight, layer.lora_A, layer.lora_B))
    g64 = layer.magnitude.detach().double() / row_norm_ref64(W, A, B, layer.scale)
    rel = ((g.double() - g64).abs() / g64.abs()).max()
    assert torch.isfinite(y).all() and float(rel) <= 2.0**-22, float(rel)
    assert 0 < float(g[7]) < 1e-17


LAYER_CASES = [pytest.param("cpu", 200, 50, 24, torch.float32, 0.05, id="cpu-200x50-r24", marks=DEVICES[0].marks),
               pytest.param("cuda", 4096, 4096, 384, torch.bfloat16, 5e-4, id="cuda-4096x4096-r384-bf16",
                            marks=DEVICES[1].marks)]


@pytest.mark.parametrize("device,d_in,d_out,r,dtype,b_std", LAYER_CASES)
def test_tail_and_torch_paths_agree_within_bound(device, d_in, d_out, r, dtype, b_std):
    """The layer's g through the kernel and through the torch tail (``norm_tail="torch"``):
    the kernel's g is bitwise ``magnitude_scale(m, weight_norm())``, and the two are within the
    norm's bound of each other (bf16 on CUDA: U and G on tensor cores)."""
    torch.manual_seed(2 if device == "cpu" else 4)
    layer = dn.DoRALinear(torch.nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype), rank=r,
                          alpha=2.0 * r if device == "cpu" else 192.0, use_rslora=device == "cuda",
                          adapter_dtype=dtype)  # 16-bit A on CUDA: the tensor-core products of the bound
    with torch.no_grad():
        layer.lora_B.normal_(0, b_std)
    with override(norm_tail="torch"):
        assert not uses_tail_kernel(layer.magnitude.device)
        g_torch, _ = g_and_flag(layer)
    with override(norm_tail="triton"):
        assert uses_tail_kernel(layer.magnitude.device)
        g_tail, bad = g_and_flag(layer)
        assert not bool(bad.any())
        assert_bitwise(g_tail, dn.magnitude_scale(layer.magnitude, layer.weight_norm()))
        w = layer.weight_norm().double().cpu().numpy()
    W, A, B = (t.detach().float().cpu().numpy() for t in (layer.base.weight, layer.lora_A, layer.lora_B))
    # both norms are within factored_norm_bound of the exact one; g inherits (1 + u) of it
    bound = factored_norm_bound(W, A, B, layer.scale, tensor_core_products=dtype != torch.float32)
    rel = torch.from_numpy(2 * bound / w).to(device) + 3 * 2.0**-24
    diff = (g_tail.double() - g_torch.double()).abs()
    assert bool((diff <= rel * g_torch.double().abs()).all()), float((diff / (rel * g_torch.double().abs())).max())
    assert not math.isnan(float(g_tail.sum()))


# ---- the cancellation guard in the kernel -------------------------------------------------

def _one_hot_tail_inputs(d_out, r, device, seed=0):
    """Rows of B with one entry +-1 (the rest 0), small-integer U and G, and base chosen so that
    some rows cancel (Q = 0 or 1) and others do not: every sum of the tail and of the guard's two
    row magnitudes has one nonzero term, so it is exact in any order, and the kernel's guard
    outputs must equal the torch evaluation of lemma 4' bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    U = torch.randint(-8, 9, (d_out, r), generator=gen).float()
    H = torch.randint(-2, 5, (r, r), generator=gen).float()
    G = torch.triu(H) + torch.triu(H, 1).T  # some negative diagonals: max(G_kk, 0) in the magnitudes
    k = torch.randint(0, r, (d_out,), generator=gen)
    sign = torch.where(torch.rand(d_out, generator=gen) < 0.5, -1.0, 1.0)
    B = torch.zeros(d_out, r)
    B[torch.arange(d_out), k] = sign
    cross = sign * U[torch.arange(d_out), k]
    ba = G[k, k]
    # two_s = 1, s_sq = 1/4: Q = base + cross + ba / 4 (exact in fp32 for these integers)
    base = (torch.randint(0, 2**12, (d_out,), generator=gen).float() * 4.0).abs()
    cancel = torch.arange(d_out) % 3 == 0
    base = torch.where(cancel, (-cross - ba / 4 + (torch.arange(d_out) % 2)).clamp_min(0), base)
    return tuple(t.to(device) for t in (U, B, G, base))


@pytest.mark.parametrize("device,d_out,r", _shape_cases())
def test_tail_guard_bitwise_lemma_4_prime_on_exact_sums(device, d_out, r):
    """The kernel's ``kappa`` and ``rel`` are the fp32 sequence of
    ``numerics.norm_bounds.posterior_from_terms`` on ``lora_row_magnitudes`` (the same constants),
    bit for bit, infinities included; its flag is the largest code over each program's rows."""
    from dora_num.numerics.norm_bounds import posterior_constants
    from dora_num.ops.guard import CANCELLATION_REL, FLAG_CANCELLATION, FLAG_COUNT

    U, B, G, base = _one_hot_tail_inputs(d_out, r, device)
    for tc in (False, True):
        C = posterior_constants(1.0, 0.25, d_in=300, r=r, tensor_core_products=tc)
        t = norm_tail(U, B, G, base, 1.0, 0.25, guard=C, rel_max=CANCELLATION_REL)
        rel = assert_tail_bitwise_lemma_4_prime(t, U, B, G, base, C)
        fired = rel > CANCELLATION_REL
        if d_out >= 3:
            assert bool(fired.any()) and not bool(fired.all())  # both kinds of row occur
        bm = get_config().norm_tail_tiles.block_m
        # per program: FLAG_COUNT x (rows flagged) + the largest code (no recompute asked: no rows resolved)
        want = [FLAG_COUNT * int(fired[i:i + bm].sum()) + int(fired[i:i + bm].any()) * FLAG_CANCELLATION
                for i in range(0, d_out, bm)]
        assert t.flag.tolist() == want


@pytest.mark.parametrize("device", DEVICES)
def test_tail_guard_certifies_zero_rows_only_with_the_mask(device):
    """A zero row (W's and B's rows zero) has terms that cannot exclude Q = 0: rel = inf, unless
    the mask of W's exactly zero rows says so; a zero W row with a nonzero B row is not exact."""
    from dora_num.numerics.norm_bounds import posterior_constants
    from dora_num.ops.guard import CANCELLATION_REL

    U, B, G, base = _one_hot_tail_inputs(8, 16, device)
    G = G.abs() + torch.eye(16, device=device)  # ba > 0 on every row with a nonzero B row
    U[:4], base[:4], B[:2] = 0.0, 0.0, 0.0  # rows 0, 1: all zero; rows 2, 3: W row zero, B row not
    zero = torch.zeros(8, dtype=torch.bool, device=device)
    zero[:4] = True
    C = posterior_constants(1.0, 0.25, d_in=64, r=16)
    bare = norm_tail(U, B, G, base, 1.0, 0.25, guard=C, rel_max=CANCELLATION_REL)
    masked = norm_tail(U, B, G, base, 1.0, 0.25, guard=C, rel_max=CANCELLATION_REL, zero_rows=zero)
    assert torch.isinf(bare.rel[:2]).all() and bool((masked.rel[:2] == 0).all())
    assert float(bare.wnorm[:2].abs().max()) == 0.0
    assert_bitwise(masked.rel[2:], bare.rel[2:])
    assert bool((masked.rel[2:4] < CANCELLATION_REL).all())  # Q^ = ba/4 > 0, no cancellation
