"""``compose()`` (:mod:`dora_num.ops.compose`): autograd through the fused tier, the
dispatch, the custom ops, and ``torch.compile`` (with the configuration as a trace-time
constant).  The kernels themselves: tests/ops/kernels/test_compose_kernels.py."""

import dataclasses
import threading

import pytest
import torch

import dora_num as dn
from dora_num.numerics.formulas import scale_constants
from dora_num.ops import compose as C
from dora_num.ops import reference as ref
from dora_num.ops.config import get_config, override
from dora_num.ops.kernels import compose as kc

from .kernels.helpers import DEVICES, INTERPRETED, assert_bitwise, compose_inputs

S = scale_constants(0.37)[0]


@pytest.mark.parametrize("device", DEVICES)
def test_compose_fused_autograd_matches_eager(device):
    base, lora, g, grad = compose_inputs((7, 130), torch.float32, device)
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


@pytest.mark.parametrize("device", DEVICES)
def test_backward_runs_under_the_forwards_configuration(device):
    """The Function keeps the configuration of its forward for the backward (which autograd
    may run on another thread): a backward outside the override, or on a thread that never
    saw it, uses the forward's tiles and placement of dg's stage 2."""
    base, lora, g, grad = compose_inputs((300, 70), torch.float32, device, seed=2)
    tiles = dataclasses.replace(get_config().compose_tiles, bwd_block_m=16, fin_chunk=4)
    inner = ref.compose_inner_ref(base, lora, S)
    with override(compose_tiles=tiles, dg_stage2_in_kernel=False) as cfg:
        want = kc.compose_bwd(grad, inner, g, S, need_dlora=False, need_dbase=False)[2]
    default = kc.compose_bwd(grad, inner, g, S, need_dlora=False, need_dbase=False)[2]
    gg = g.clone().requires_grad_(True)
    with override(compose_tiles=tiles, dg_stage2_in_kernel=False, recompute_inner=False):
        out = C.ComposeFunction.apply(base, lora, gg, S, True)
    got = []
    worker = threading.Thread(target=lambda: got.append(torch.autograd.grad(out, gg, grad)[0]))
    worker.start()
    worker.join()
    assert_bitwise(got[0], want)
    assert cfg.compose_tiles.bwd_block_m == 16
    # the default configuration's tree gives other bits (57 of the 70 columns on the CPU), so
    # a backward that fell back to it would fail the first assertion
    assert not torch.equal(want, default)


def test_dispatch_tiers_and_overrides():
    base, lora, g, _ = compose_inputs((2, 16), torch.float32)
    C.reset_dispatch_counts()
    with override(compose_path="auto"):
        dn.compose(base, lora, g, 0.5)  # CPU: auto -> eager
        dn.compose(base, lora, g, 0.5, path="fused")  # inference -> fused forward
        dn.compose(base, lora, g.clone().requires_grad_(True), 0.5, path="fused")
        assert C.dispatch_counts() == {"eager": 1, "fused_forward": 1, "fused_training": 1}
    with override(compose_path="fused"):
        assert C.select_tier(base, lora, g) == "fused_forward"
        assert C.select_tier(base, lora, g, path="eager") == "eager"  # per call wins over the configuration
    with pytest.raises(ValueError, match="compose_path must be one of"):
        with override(compose_path="turbo"):
            pass
    with pytest.raises(ValueError, match="path must be one of"):
        dn.compose(base, lora, g, 0.5, path="triton")


def test_dispatch_is_logged(caplog):
    base, lora, g, _ = compose_inputs((2, 16), torch.float32)
    with caplog.at_level("DEBUG", logger="dora_num.dispatch"):
        dn.compose(base, lora, g, 0.5, path="fused")
    assert "tier=fused_forward" in caplog.text


def test_compose_out_is_inference_only():
    base, lora, g, _ = compose_inputs((3, 20), torch.float32)
    want = ref.compose_stable_ref(base, lora, g, S)
    out = dn.compose(base, lora, g, 0.37, path="fused", out=lora)
    assert out.data_ptr() == lora.data_ptr()
    assert_bitwise(out, want)
    with pytest.raises(ValueError, match="inference only"):
        dn.compose(base, lora, g.requires_grad_(True), 0.37, out=torch.empty_like(base))


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["eager", "fused"])
def test_custom_op_opcheck(fused):
    base, lora, g, grad = compose_inputs((3, 20), torch.float32)
    g.requires_grad_(True)
    key = get_config().key
    inner = ref.compose_inner_ref(base, lora, S)
    for add_base in (False, True):  # the output add in the compose's pass (and its gradient), or not
        torch.library.opcheck(torch.ops.dora_num.compose_fwd.default, (base, lora, g, S, True, fused, key, add_base),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        torch.library.opcheck(torch.ops.dora_num.compose_bwd.default,
                              (grad, inner, base, lora, g.detach(), S, True, True, True, fused, key, add_base),
                              test_utils=("test_schema", "test_faketensor"))


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


def test_compiled_layer_under_override():
    """What torch.compile does with the configuration (documented in dora_num.ops.config).

    Observed with torch 2.13 on CPU: the graph traced under the default holds the default's
    key as a constant argument of ``dora_num::compose_fwd``; a call under an override is not
    served by it but traced again (Dynamo's guards on the configuration), with the override's
    key; back under the default, and under the same override again, the graphs traced before
    are reused; another override is traced once more.  Every call gives the eager layer's bits
    (the configurations differ in tier and fold only, which do not change the result)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def op_keys(gm):
        return [n.args[-1] for n in gm.graph.nodes if n.op == "call_function" and "compose_fwd" in str(n.target)]

    torch.manual_seed(0)
    layer = dn.DoRALinear(torch.nn.Linear(16, 12, bias=False), rank=4)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(5, 16)
    want = layer(x)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    change = {"fold_output_add": False, "compose_path": "fused" if INTERPRETED else "eager"}
    outs = [compiled(x)]
    assert len(graphs) == 1 and op_keys(graphs[0]) == [get_config().key]
    with override(**change) as cfg:
        outs.append(compiled(x))
    assert len(graphs) == 2 and op_keys(graphs[1]) == [cfg.key]
    outs.append(compiled(x))
    with override(**change):
        outs.append(compiled(x))
    assert len(graphs) == 2  # both configurations' graphs reused
    with override(norm_tail="torch"):
        outs.append(compiled(x))
    assert len(graphs) == 3
    for y in outs:
        assert_bitwise(y, want)


@pytest.mark.gpu
def test_compiled_model_runs_kernels_fullgraph():
    torch.manual_seed(0)
    dt = torch.bfloat16
    layers = [dn.DoRALinear(torch.nn.Linear(512, 512, device="cuda", dtype=dt), rank=16, compose_path="fused",
                            adapter_dtype=dt)
              for _ in range(2)]
    for layer in layers:
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.01)
    model = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1])
    x = torch.randn(256, 512, device="cuda", dtype=dt, requires_grad=True)
    y = model(x)
    y.float().square().sum().backward()
    gm = [layer.magnitude.grad.clone() for layer in layers]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    yc = compiled(x)
    yc.float().square().sum().backward()
    # inductor may fuse the bf16 adds around the compose (one rounding instead of two)
    torch.testing.assert_close(yc, y, rtol=2**-7, atol=2**-7 * float(y.abs().max()))
    for a, layer in zip(gm, layers):
        torch.testing.assert_close(layer.magnitude.grad, a, rtol=2**-6, atol=2**-6 * float(a.abs().max()))


@pytest.mark.gpu
def test_dispatch_on_cuda():
    small = compose_inputs((2, 64), torch.bfloat16, "cuda")[:3]
    big = compose_inputs((C.FUSED_TRAIN_MIN_ELEMENTS // 4096 + 1, 4096), torch.bfloat16, "cuda")[:3]
    with override(compose_path="auto"):
        assert C.select_tier(*small) == "fused_forward"
        g = small[2].clone().requires_grad_(True)
        expect_small = "fused_training" if small[0].numel() >= C.FUSED_TRAIN_MIN_ELEMENTS else "eager"
        assert C.select_tier(small[0], small[1], g) == expect_small
        assert C.select_tier(big[0], big[1], big[2].clone().requires_grad_(True)) == "fused_training"
