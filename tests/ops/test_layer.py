"""``DoRALinear`` (:mod:`dora_num.ops.layer`): the folded output add, the seams studies use
(``norm=``, ``compose_fn=``, ``forward(x, g=...)``), the finiteness check of ``g`` and its
modes, and (on the H200) the step without a device sync.  Against PEFT:
tests/ops/test_layer_vs_peft.py; bad input: tests/ops/test_bad_input.py."""

import pytest
import torch
import torch.nn.functional as Fn

import dora_num as dn
from dora_num.ops import compose as C
from dora_num.ops.config import override
from dora_num.ops.norm import dense_row_norm, factored_row_norm, magnitude_scale
from dora_num.ops.weight_norm import magnitude_scale_and_flag

from .kernels.helpers import CPU, CUDA, assert_bitwise


def layer_g(layer):
    """The ``g`` the layer's forward takes (norm="cached")."""
    return magnitude_scale_and_flag(layer.base.weight, layer.lora_A, layer.lora_B, layer.scale, layer.magnitude,
                                    chunk_bytes=layer.chunk_bytes)[0]


def unfolded_layer_step(layer, x, D, path):
    """``DoRALinear``'s step written out as separate autograd ops (compose, then ``base + delta``):
    the reference for the layer's folded output add.  Returns the output and the gradients."""
    xr = x.detach().clone().requires_grad_(True)
    base = Fn.linear(xr, layer.base.weight)
    lora = Fn.linear(Fn.linear(xr, layer.lora_A), layer.lora_B)
    y = base + dn.compose(base, lora, layer_g(layer), layer.scale, path=path)
    y.backward(D)
    grads = (xr.grad, layer.lora_A.grad, layer.lora_B.grad, layer.magnitude.grad)
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


def layer_step(layer, x, D, **forward_kwargs):
    xr = x.detach().clone().requires_grad_(True)
    y = layer(xr, **forward_kwargs)
    y.backward(D)
    grads = (xr.grad, layer.lora_A.grad, layer.lora_B.grad, layer.magnitude.grad)
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


FOLD_CASES = [pytest.param("cpu", dtype, path, (48, 40, 6, 12.0, (2, 5)), 5, 0.1, id=f"cpu-{name}-{path}",
                           marks=CPU.marks if path == "fused" else ())
              for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16)) for path in ("eager", "fused")]
FOLD_CASES += [pytest.param("cuda", torch.bfloat16, path, (1024, 768, 32, 64.0, (3, 300)), 6, 0.02,
                            id=f"cuda-bf16-{path}", marks=CUDA.marks) for path in ("auto", "eager")]


@pytest.mark.parametrize("device,dtype,path,dims,seed,b_std", FOLD_CASES)
def test_layer_output_add_folded_into_compose_is_bitwise(device, dtype, path, dims, seed, b_std):
    """DoRALinear (no bias, no dropout) adds base inside the compose; output and every
    gradient are bitwise those of the separate ops, on every tier (on the H200 ``auto`` takes
    the fused training tier), and with the fold switched off (``fold_output_add=False``)."""
    d_in, d_out, r, alpha, lead = dims
    torch.manual_seed(seed)
    layer = dn.DoRALinear(torch.nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype), rank=r,
                          alpha=alpha, compose_path=path, adapter_dtype=dtype)  # one dtype: the unfolded ops
    with torch.no_grad():
        layer.lora_B.normal_(0, b_std)
    x = torch.randn(*lead, d_in, device=device).to(dtype)
    D = torch.randn(*lead, d_out, device=device).to(dtype)
    C.reset_dispatch_counts()
    y_ref, g_ref = unfolded_layer_step(layer, x, D, path)
    y, gr = layer_step(layer, x, D)
    if device == "cuda":
        assert C.dispatch_counts()["fused_training" if path == "auto" else "eager"] == 2
    assert_bitwise(y, y_ref)
    for a, b in zip(gr, g_ref):
        assert_bitwise(a, b)
    with override(fold_output_add=False):
        y2, gr2 = layer_step(layer, x, D)
    assert_bitwise(y2, y_ref)
    for a, b in zip(gr2, g_ref):
        assert_bitwise(a, b)
    with torch.no_grad():  # inference: written over the lora buffer, same bits
        assert_bitwise(layer(x), y_ref)


# ---- seams ----------------------------------------------------------------------------


def test_norm_seam_uses_the_norm_it_names():
    """``norm="dense"`` / ``"factored"``: the magnitude starts at that norm, ``weight_norm()``
    and the forward's ``g`` come from it (the forward is bitwise the layer run with that ``g``
    given), and ``"factored"`` keeps no cache of ``rowsum(W*W)`` on W."""
    x = torch.randn(3, 40)
    D = torch.randn(3, 24)
    for norm, fn in (("dense", lambda W, A, B, s: dense_row_norm(W, A, B, s)),
                     ("factored", lambda W, A, B, s: factored_row_norm(W, A, B, s))):
        torch.manual_seed(3)
        W = torch.nn.Linear(40, 24, bias=False)
        layer = dn.DoRALinear(W, rank=4, alpha=8.0, norm=norm)
        assert torch.equal(layer.magnitude.detach(), fn(W.weight, layer.lora_A.detach(), layer.lora_B.detach(),
                                                        layer.scale))
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.1)
        args = (layer.base.weight, layer.lora_A.detach(), layer.lora_B.detach(), layer.scale)
        assert torch.equal(layer.weight_norm(), fn(*args))
        g = magnitude_scale(layer.magnitude, fn(*args))
        assert torch.equal(layer.magnitude_scale(), g)
        y, grads = layer_step(layer, x, D)
        y_g, grads_g = layer_step(layer, x, D, g=magnitude_scale(layer.magnitude, fn(*args)))
        assert_bitwise(y, y_g)
        for a, b in zip(grads, grads_g):
            assert_bitwise(a, b)
        if norm == "factored":
            assert not hasattr(layer.base.weight, "_dora_num_base_sq")
    with pytest.raises(ValueError, match="norm must be one of"):
        dn.DoRALinear(torch.nn.Linear(4, 4), rank=2, norm="sparse")


def test_dense_and_cached_norms_agree_within_the_bound(small_layer):
    from dora_num.numerics.bounds import dense_norm_bound, factored_norm_bound

    dense, cached = small_layer(norm="dense"), small_layer(norm="cached")
    W, A, B = (t.detach().numpy() for t in (cached.base.weight, cached.lora_A, cached.lora_B))
    bound = factored_norm_bound(W, A, B, cached.scale) + dense_norm_bound(W, A, B, cached.scale)
    diff = (dense.weight_norm() - cached.weight_norm()).abs().double().numpy()
    assert (diff <= bound).all()


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_compose_fn_seam(bias, small_layer):
    """``compose_fn`` is called instead of ``compose`` with its public signature; the layer adds
    ``base`` (and the bias) to what it returns: with ``compose`` itself as ``compose_fn`` the
    layer is bitwise the default one (which folds the add into the compose) in training and
    in inference."""
    calls = []

    def spy(base, lora, g, scale, *, path, out):
        calls.append((tuple(base.shape), path, out is not None))
        return dn.compose(base, lora, g, scale, path=path, out=out)

    x = torch.randn(2, 3, 40)
    D = torch.randn(2, 3, 24)
    plain, seam = small_layer(bias=bias), small_layer(compose_fn=spy, bias=bias)
    y_p, g_p = layer_step(plain, x, D)
    y_s, g_s = layer_step(seam, x, D)
    assert calls == [((2, 3, 24), "auto", False)]
    assert_bitwise(y_s, y_p)
    for a, b in zip(g_s, g_p):
        assert_bitwise(a, b)
    with torch.no_grad():
        assert_bitwise(seam(x), plain(x))
    assert calls[-1] == ((2, 3, 24), "auto", True)  # inference: out= is the lora buffer
    assert "compose_fn=" in repr(seam) and "compose_fn=" not in repr(plain)
    with pytest.raises(TypeError, match="compose_fn must be callable"):
        dn.DoRALinear(torch.nn.Linear(4, 4), rank=2, compose_fn=3)


def test_forward_with_a_given_g(small_layer):
    """``forward(x, g=...)`` uses ``g`` as given: the layer's own ``g`` reproduces the default
    forward bit for bit; another ``g`` changes the output as the compose says; a bad ``g`` is
    named, and a non-finite one is refused as given (the layer's own inputs are fine)."""
    layer = small_layer()
    x = torch.randn(4, 40)
    with torch.no_grad():
        y = layer(x)
        g = layer_g(layer)
        assert_bitwise(layer(x, g=g), y)
        g2 = g * 1.001
        base = Fn.linear(x, layer.base.weight)
        lora = Fn.linear(Fn.linear(x, layer.lora_A), layer.lora_B)
        assert_bitwise(layer(x, g=g2), base + dn.compose(base, lora, g2, layer.scale))
        with pytest.raises(TypeError, match="g has dtype"):
            layer(x, g=g.double())
        with pytest.raises(ValueError, match=r"g must be float32 \[out_features\]"):
            layer(x, g=g[:5])
        g2[3] = float("nan")
        with pytest.raises(ValueError, match="the given g contains non-finite"):
            layer(x, g=g2)


@pytest.mark.parametrize("mode", ["deferred", "late", "sync", "off"])
def test_finite_check_modes(mode, small_layer):
    """``OpConfig.finite_check``: ``late`` and ``sync`` give the same output and both name the
    input at fault; ``off`` does not check (a NaN in A propagates: for timing only)."""
    layer = small_layer()
    x = torch.randn(3, 40)
    want = layer(x)
    with override(finite_check=mode):
        assert_bitwise(layer(x), want)
        with torch.no_grad():
            layer.lora_A[1, 3] = float("nan")
        if mode == "off":
            assert not bool(torch.isfinite(layer(x)).all())
        else:
            with pytest.raises(ValueError, match="A contains non-finite"):
                layer(x)
    with pytest.raises(ValueError, match="finite_check must be one of"):
        with override(finite_check="never"):
            pass


@pytest.mark.gpu
def test_dora_linear_step_has_no_implicit_sync_and_still_names_bad_input():
    """A DoRALinear training step queues its work without a device sync (torch's sync
    debug mode raises on any implicit one); the finiteness check of g is read later
    (deferred) or at the end of the call (late), and still raises naming the input at fault."""
    torch.manual_seed(0)
    layer = dn.DoRALinear(torch.nn.Linear(1024, 2048, bias=True).cuda().bfloat16(), 16)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().square().mean().backward()  # warm-up: cache, Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.no_grad():
        layer.lora_A[3, 5] = float("nan")
    from dora_num.ops.finite import check_pending

    layer(x)  # finite_check="deferred": the call returns; its flag is pending
    with pytest.raises(ValueError, match="A contains non-finite"):
        check_pending()
    with override(finite_check="late"):  # read at the end of the call
        with pytest.raises(ValueError, match="A contains non-finite"):
            layer(x)

