"""Fused compose / norm-assembly kernels against the eager reference.

On CPU these run under TRITON_INTERPRET=1 (tests/conftest.py).  The contract is
bitwise equality with :mod:`dora_num.ops.reference` for the forward and the
elementwise backward; ``dg`` is checked against an fp64 sum within the a-priori
bound :func:`dora_num.ops.kernels.compose.dg_error_bound`.  bf16 is NOT tested
for bit equality here: the interpreter truncates on ``.to(tl.bfloat16)``
(PLATFORM.md), so bf16 bit-exactness is covered by tests/ops/kernels/test_gpu_kernels.py.
"""

import pytest
import torch

import dora_num as dn
from dora_num.numerics.arithmetic import TorchFP32CorrectSqrt
from dora_num.numerics.formulas import norm_assembly, scale_constants
from dora_num.ops import compose as C
from dora_num.ops import reference as ref
from dora_num.ops.kernels import compose as kc

from ._bitwise import _bits, assert_bitwise  # noqa: F401  (shared with the CPU/GPU kernel tests)
from dora_num.ops.kernels.norm_assembly import norm_assembly_triton

CPU_DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        kc.INTERPRET, reason="TRITON_INTERPRET truncates .to(tl.bfloat16) (GPU rounds to nearest): bf16 "
                             "bit-exactness is tested on the H200 in tests/ops/kernels/test_gpu_kernels.py")),
]
SHAPES = [
    pytest.param((1, 1), id="1x1"),
    pytest.param((3, 3), id="3x3"),
    pytest.param((5, 63), id="5x63"),
    pytest.param((2, 4097), id="2x4097"),
    pytest.param((2, 3, 1000), id="2x3x1000"),
]
S = scale_constants(0.37)[0]




def _inputs(shape, dtype, g_spread=1e-3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen).to(dtype)
    lora = torch.randn(shape, generator=gen).to(dtype)
    g = 1.0 + g_spread * torch.randn(shape[-1], generator=gen)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return base, lora, g, grad


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_bitwise(shape, dtype):
    base, lora, g, _ = _inputs(shape, dtype)
    out, inner = kc.compose_fwd(base, lora, g, S, write_inner=True)
    assert_bitwise(out, ref.compose_stable_ref(base, lora, g, S))
    assert_bitwise(inner, ref.compose_inner_ref(base, lora, S))


@pytest.mark.parametrize("g_spread", [0.0, 0.3], ids=["g=1", "g-in-[0.5,2]"])
def test_forward_bitwise_g_regimes_fp16_near_overflow(g_spread):
    base, lora, g, _ = _inputs((4, 257), torch.float16, g_spread)
    base = (base.float() * 3e4).clamp(-6e4, 6e4).half()  # near fp16's max 65504
    out, _ = kc.compose_fwd(base, lora, g.clamp(0.5, 2.0), S)
    assert_bitwise(out, ref.compose_stable_ref(base, lora, g.clamp(0.5, 2.0), S))


@pytest.mark.parametrize("alias", ["base", "lora"])
def test_forward_in_place(alias):
    base, lora, g, _ = _inputs((4, 300), torch.float32)
    want = ref.compose_stable_ref(base, lora, g, S)
    target = base if alias == "base" else lora
    out, _ = kc.compose_fwd(base, lora, g, S, out=target)
    assert out.data_ptr() == target.data_ptr()
    assert_bitwise(out, want)


def test_forward_in_place_rejects_non_contiguous():
    base, lora, g, _ = _inputs((8, 16), torch.float32)
    with pytest.raises(ValueError, match="out must be contiguous"):
        kc.compose_fwd(base, lora, g[:8], S, out=torch.empty(16, 8).T)


def test_non_contiguous_inputs_are_copied():
    base, lora, g, _ = _inputs((70, 9), torch.float32)
    bt, lt = base.T, lora.T  # [9, 70], non-contiguous
    gg = 1.0 + 1e-3 * torch.randn(70)
    out, _ = kc.compose_fwd(bt, lt, gg, S)
    assert_bitwise(out, ref.compose_stable_ref(bt, lt, gg, S))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_bitwise_and_dg_bound(shape, dtype):
    base, lora, g, grad = _inputs(shape, dtype)
    inner = ref.compose_inner_ref(base, lora, S)
    dl, db, dg = kc.compose_bwd(grad, inner, g, S)
    dl_r, db_r, _ = ref.compose_backward_ref(grad, inner, g, S)
    assert_bitwise(dl, dl_r)
    assert_bitwise(db, db_r)
    exact = (inner.double() * grad.double()).reshape(-1, shape[-1]).sum(0)
    bound = kc.dg_error_bound(inner, grad)
    err = (dg.double() - exact).abs()
    assert bool((err <= bound).all()), f"dg error {float(err.max())} exceeds its bound"
    # deterministic: the same bits on a second run
    assert_bitwise(kc.compose_bwd(grad, inner, g, S)[2], dg)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_base_and_add_grad_are_torchs_adds(shape, dtype):
    """The layer's fold: y = base + delta in the forward's pass, and dbase = D + (g-1)*D in the
    backward's, bitwise torch's add of the separately rounded tensors (and in place)."""
    base, lora, g, grad = _inputs(shape, dtype)
    delta = ref.compose_stable_ref(base, lora, g, S)
    y, _ = kc.compose_fwd(base, lora, g, S, add_base=True)
    assert_bitwise(y, base + delta)
    target = lora.clone()
    y2, _ = kc.compose_fwd(base, target, g, S, out=target, add_base=True)
    assert y2.data_ptr() == target.data_ptr()
    assert_bitwise(y2, base + delta)
    inner = ref.compose_inner_ref(base, lora, S)
    dl, db, dg = kc.compose_bwd(grad, None, g, S, base=base, lora=lora, add_grad=True)
    dl_r, db_r, _ = ref.compose_backward_ref(grad, inner, g, S)
    assert_bitwise(dl, dl_r)
    assert_bitwise(db, grad + db_r)
    assert_bitwise(dg, kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_backward_recompute_inner_is_bitwise_the_same(dtype):
    base, lora, g, grad = _inputs((9, 777), dtype)
    inner = ref.compose_inner_ref(base, lora, S)
    saved = kc.compose_bwd(grad, inner, g, S)
    recomputed = kc.compose_bwd(grad, None, g, S, base=base, lora=lora)
    for a, b in zip(saved, recomputed):
        assert_bitwise(a, b)


def test_backward_partial_outputs():
    base, lora, g, grad = _inputs((6, 50), torch.float32)
    inner = ref.compose_inner_ref(base, lora, S)
    dl, db, dg = kc.compose_bwd(grad, None, g, S, need_dbase=False, need_dg=False)
    assert db is None and dg is None
    assert_bitwise(dl, ref.compose_backward_ref(grad, inner, g, S)[0])
    with pytest.raises(ValueError, match="inner is required"):
        kc.compose_bwd(grad, None, g, S)
    with pytest.raises(ValueError, match="base and lora must have"):
        kc.compose_bwd(grad, None, g, S, base=base[:3], lora=lora[:3])
    with pytest.raises(ValueError, match="inner must be float32"):
        kc.compose_bwd(grad, inner.half(), g, S)


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (0, 0)], ids=["0x8", "4x0", "0x0"])
def test_empty(shape):
    base, lora, g, grad = _inputs(shape, torch.float32) if shape[-1] else (
        torch.empty(shape), torch.empty(shape), torch.empty(0), torch.empty(shape))
    out, inner = kc.compose_fwd(base, lora, g, S, write_inner=True)
    assert out.shape == shape and inner.shape == shape
    dl, db, dg = kc.compose_bwd(grad, inner, g, S)
    assert dl.shape == shape and dg.shape == (shape[-1],)
    assert bool((dg == 0).all())


# ---- norm assembly ------------------------------------------------------------------

def _norm_inputs(n=3000, seed=1):
    gen = torch.Generator().manual_seed(seed)
    base_sq = torch.rand(n, generator=gen) * 100 + 1
    cross = torch.randn(n, generator=gen)
    ba = torch.rand(n, generator=gen)
    cross[:100] = -base_sq[:100] / 0.74 * (1 - 1e-4)  # the update cancels the row
    base_sq[100:110] = 0.0
    cross[100:110] = 0.0
    ba[100:110] = 0.0  # zero rows
    return base_sq, cross, ba


@pytest.mark.parametrize("sqrt", ["rn", "approx"])
def test_norm_assembly_bitwise(sqrt):
    """Production (no contraction, sqrt.rn) equals the correctly rounded reference.

    Under the interpreter every sqrt is numpy's (correctly rounded), so "approx"
    also matches here; the GPU test shows where it does not.
    """
    _, two_s, s_sq = scale_constants(0.37)
    b, c, a = _norm_inputs()
    got = norm_assembly_triton(b, c, a, two_s, s_sq, sqrt=sqrt)
    assert_bitwise(got, norm_assembly(TorchFP32CorrectSqrt, b, c, a, two_s, s_sq))
    assert bool((got[100:110] == 0).all())


def test_norm_assembly_errors():
    b, c, a = _norm_inputs(10)
    with pytest.raises(NotImplementedError, match="inline PTX"):
        norm_assembly_triton(b, c, a, 1.0, 0.25, sqrt="ptx")
    with pytest.raises(ValueError, match="sqrt must be one of"):
        norm_assembly_triton(b, c, a, 1.0, 0.25, sqrt="fast")
    with pytest.raises(TypeError, match="cross must be a float32"):
        norm_assembly_triton(b, c.double(), a, 1.0, 0.25)
    with pytest.raises(ValueError, match="ba must match"):
        norm_assembly_triton(b, c, a[:5], 1.0, 0.25)


# ---- compose(): autograd through the fused tier, dispatch ---------------------------

def test_compose_fused_autograd_matches_eager():
    base, lora, g, grad = _inputs((7, 130), torch.float32)
    res = {}
    for path in ("eager", "fused"):
        b = base.clone().requires_grad_(True)
        lo = lora.clone().requires_grad_(True)
        gg = g.clone().requires_grad_(True)
        out = dn.compose(b, lo, gg, 0.37, path=path)
        out.backward(grad)
        res[path] = (out.detach(), b.grad, lo.grad, gg.grad)
    for a, b in zip(res["eager"][:3], res["fused"][:3]):
        assert_bitwise(a, b)
    inner = ref.compose_inner_ref(base, lora, S)
    exact = (inner.double() * grad.double()).sum(0)
    assert bool(((res["fused"][3].double() - exact).abs() <= kc.dg_error_bound(inner, grad)).all())


def unfolded_layer_step(layer, x, D, path):
    """``DoRALinear``'s step written out as separate autograd ops (compose, then ``base + delta``):
    the reference for the layer's folded output add.  Returns the output and the gradients."""
    import torch.nn.functional as Fn

    xr = x.detach().clone().requires_grad_(True)
    base = Fn.linear(xr, layer.base.weight)
    lora = Fn.linear(Fn.linear(xr, layer.lora_A), layer.lora_B)
    g = layer._g_fast()[0]
    y = base + dn.compose(base, lora, g, layer.scale, path=path)
    y.backward(D)
    grads = (xr.grad, layer.lora_A.grad, layer.lora_B.grad, layer.magnitude.grad)
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


def folded_layer_step(layer, x, D):
    xr = x.detach().clone().requires_grad_(True)
    y = layer(xr)
    y.backward(D)
    grads = (xr.grad, layer.lora_A.grad, layer.lora_B.grad, layer.magnitude.grad)
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


@pytest.mark.parametrize("path", ["eager", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_layer_output_add_folded_into_compose_is_bitwise(path, dtype):
    """DoRALinear (no bias, no dropout) adds base inside the compose; output and every
    gradient are bitwise those of the separate ops, on both tiers."""
    torch.manual_seed(5)
    layer = dn.DoRALinear(torch.nn.Linear(48, 40, bias=False).to(dtype), rank=6, alpha=12.0, compose_path=path)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(2, 5, 48).to(dtype)
    D = torch.randn(2, 5, 40).to(dtype)
    y_ref, g_ref = unfolded_layer_step(layer, x, D, path)
    y, gr = folded_layer_step(layer, x, D)
    assert_bitwise(y, y_ref)
    for a, b in zip(gr, g_ref):
        assert_bitwise(a, b)
    with torch.no_grad():  # inference: written over the lora buffer, same bits
        assert_bitwise(layer(x), y_ref)


def test_dispatch_tiers_and_overrides(monkeypatch):
    monkeypatch.delenv(C.ENV_PATH, raising=False)
    base, lora, g, _ = _inputs((2, 16), torch.float32)
    C.reset_dispatch_counts()
    dn.compose(base, lora, g, 0.5)  # CPU: auto -> eager
    dn.compose(base, lora, g, 0.5, path="fused")  # inference -> fused forward
    dn.compose(base, lora, g.clone().requires_grad_(True), 0.5, path="fused")
    assert C.dispatch_counts() == {"eager": 1, "fused_forward": 1, "fused_training": 1}
    monkeypatch.setenv(C.ENV_PATH, "fused")
    assert C.select_tier(base, lora, g) == "fused_forward"
    assert C.select_tier(base, lora, g, path="eager") == "eager"  # per call wins over the env
    monkeypatch.setenv(C.ENV_PATH, "turbo")
    with pytest.raises(ValueError, match="DORA_NUM_COMPOSE_PATH"):
        dn.compose(base, lora, g, 0.5)
    with pytest.raises(ValueError, match="path must be one of"):
        dn.compose(base, lora, g, 0.5, path="triton")


def test_dispatch_is_logged(caplog, monkeypatch):
    monkeypatch.delenv(C.ENV_PATH, raising=False)
    base, lora, g, _ = _inputs((2, 16), torch.float32)
    with caplog.at_level("DEBUG", logger="dora_num.dispatch"):
        dn.compose(base, lora, g, 0.5, path="fused")
    assert "tier=fused_forward" in caplog.text


def test_compose_out_is_inference_only():
    base, lora, g, _ = _inputs((3, 20), torch.float32)
    want = ref.compose_stable_ref(base, lora, g, S)
    out = dn.compose(base, lora, g, 0.37, path="fused", out=lora)
    assert out.data_ptr() == lora.data_ptr()
    assert_bitwise(out, want)
    with pytest.raises(ValueError, match="inference only"):
        dn.compose(base, lora, g.requires_grad_(True), 0.37, out=torch.empty_like(base))


def test_custom_op_opcheck():
    base, lora, g, _ = _inputs((3, 20), torch.float32)
    g.requires_grad_(True)
    torch.library.opcheck(C._compose_fwd_op, (base, lora, g, S, True, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compile_fullgraph_no_graph_break():
    """A model of DoRALinear layers compiles with fullgraph=True (AOT autograd, eager
    inside the custom ops on CPU) and gives the eager model's outputs and gradients."""
    torch.manual_seed(0)
    layers = [dn.DoRALinear(torch.nn.Linear(16, 12), rank=4), dn.DoRALinear(torch.nn.Linear(12, 8), rank=2)]
    for layer in layers:
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.1)
    model = torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1])
    x = torch.randn(5, 16)
    y = model(x)
    y.sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    yc = compiled(x)
    yc.sum().backward()
    assert_bitwise(yc, y)
    for a, p in zip(grads, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(p.grad, a, rtol=0, atol=0)


def test_weight_norm_op_and_base_sq_cache():
    """The weight-norm custom op equals factored_row_norm; the base_sq cache lives on W and
    is recomputed when W is written in place."""
    from dora_num.ops import norm as N

    gen = torch.Generator().manual_seed(5)
    W = torch.randn(24, 40, generator=gen)
    A = torch.randn(4, 40, generator=gen)
    B = torch.randn(24, 4, generator=gen)
    torch.library.opcheck(N._weight_norm_op, (W, A, B, 0.7, N.DEFAULT_CHUNK_BYTES, True),
                          test_utils=("test_schema", "test_faketensor"))
    want = dn.factored_row_norm(W, A, B, 0.7)
    assert_bitwise(N.weight_norm_cached(W, A, B, 0.7), want)
    first = N.cached_base_row_norm_sq(W)
    assert N.cached_base_row_norm_sq(W) is first  # a hit: the same tensor
    with torch.no_grad():
        W[0].mul_(2.0)  # bumps W's version counter
    again = N.cached_base_row_norm_sq(W)
    assert again is not first
    assert_bitwise(again, dn.base_row_norm_sq(W))


@pytest.mark.parametrize("rows", [1, 65, 64 * 64 + 3], ids=lambda r: f"{r}rows")
def test_dg_stage2_in_kernel_equals_second_launch(rows, monkeypatch):
    """Under the interpreter both placements of stage 2 reduce axis 0 row by row, so
    they give the same bits (on the GPU each tile shape has its own fixed order:
    test_gpu_kernels checks each for its bound and determinism instead); rows =
    64*64+3 gives 65 partials, two chunks."""
    base, lora, g, grad = _inputs((rows, 5), torch.float32)
    inner = ref.compose_inner_ref(base, lora, S)
    got = {}
    for in_kernel in (True, False):
        monkeypatch.setattr(kc, "DG_FINAL_IN_KERNEL", in_kernel)
        got[in_kernel] = kc.compose_bwd(grad, inner, g, S)[2]
    assert_bitwise(got[True], got[False])
    exact = (inner.double() * grad.double()).sum(0)
    assert bool(((got[True].double() - exact).abs() <= kc.dg_error_bound(inner, grad)).all())
