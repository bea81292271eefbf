"""The factored norm of DoRALinear replayed as a CUDA graph (dora_num.ops.norm_graph) against the
eager norm (OpConfig.norm_graph=False): bitwise the same g, flags, outputs and gradients over
training steps that update A, B and m in place, with the cancellation guard's in-kernel recompute,
after the parameters' storage changes, with non-finite values, and without a host sync."""

import copy
import pickle

import pytest
import torch

import dora_num as dn
from dora_num.ops import finite, norm_graph
from dora_num.ops.config import override

pytestmark = pytest.mark.gpu


def _layer(d_in=256, d_out=384, r=16, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(d_in, d_out, bias=False, dtype=torch.bfloat16, device="cuda")
    layer = dn.DoRALinear(lin, r, 2.0 * r)
    with torch.no_grad():
        layer.lora_B.normal_(0, 1e-2)
    return layer


def _train(graph: bool, steps: int = 5, cancel: bool = False):
    layer = _layer()
    if cancel:  # rows where s B A cancels W but for W's bf16 rounding: the guard flags and recomputes them
        with torch.no_grad():
            C = torch.randn(8, layer.rank, device="cuda")
            layer.base.weight[:8] = (C @ layer.lora_A.float()).bfloat16()
            layer.lora_B[:8] = -C / layer.scale
        g, bad = dn.ops.norm.magnitude_scale_and_flag(layer.base.weight, layer.lora_A, layer.lora_B, layer.scale,
                                                     layer.magnitude)
        assert dn.ops.guard.decode(bad)[1] > 0  # rows flagged (and recomputed in the kernel)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-2)
    torch.manual_seed(1)
    xs = [torch.randn(64, 256, dtype=torch.bfloat16, device="cuda") for _ in range(steps)]
    out = []
    with override(norm_graph=graph):
        for x in xs:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.float().pow(2).mean().backward()
            g = layer.magnitude_scale().detach().clone()
            out.append([y.detach(), g] + [p.grad.clone() for p in (layer.lora_A, layer.lora_B, layer.magnitude)])
            opt.step()
            opt.zero_grad()
        finite.check_pending()
    return out, layer


@pytest.mark.parametrize("cancel", [False, True])
def test_graphed_norm_bitwise_eager_over_training_steps(cancel):
    graphed, layer = _train(True, cancel=cancel)
    eager, _ = _train(False, cancel=cancel)
    assert norm_graph._STATE[layer].graph is not None  # it was replayed, not only eager
    for a, b in zip(graphed, eager):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_graphed_norm_no_host_sync_and_pool_reported():
    layer = _layer()
    x = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # eager, capture, replays
            with torch.autocast("cuda", dtype=torch.bfloat16):
                layer(x).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    finite.check_pending()
    assert norm_graph._STATE[layer].graph is not None
    assert norm_graph.pool_bytes() > 0


def test_storage_change_recaptures_then_stays_eager():
    layer = _layer()
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    for i in range(2 * norm_graph.MAX_CAPTURES + 4):
        if i % 2 == 0:  # a new A every other call (as an unshard that reallocates would)
            layer.lora_A = torch.nn.Parameter(layer.lora_A.detach().clone())
        with torch.no_grad():
            y = layer(x)
        with torch.no_grad(), override(norm_graph=False):
            assert torch.equal(y, layer(x))
    st = norm_graph._STATE[layer]
    assert st.captures == norm_graph.MAX_CAPTURES and st.off


def test_nonfinite_m_raises_through_the_graph():
    layer = _layer()
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        with torch.no_grad():
            layer(x)
    finite.check_pending()
    assert norm_graph._STATE[layer].graph is not None
    with torch.no_grad():
        layer.magnitude[3] = float("nan")  # in place: the same storage, the graph replays
        layer(x)
    with pytest.raises(ValueError, match="m"):
        finite.check_pending()


def test_layer_with_a_graph_copies_and_pickles():
    layer = _layer()
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        with torch.no_grad():
            y = layer(x)
    clone = copy.deepcopy(layer)
    again = pickle.loads(pickle.dumps(layer))
    with torch.no_grad():
        assert torch.equal(clone(x), y) and torch.equal(again(x), y)
