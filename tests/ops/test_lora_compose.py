"""The one-node training forward of DoRALinear (dora_num.ops.lora_compose) against the layer's
unfused path (OpConfig.one_node=False): bitwise the same output and gradients, every dtype route
it serves; the one documented difference (autocast's shared cast of an adapter used twice in
one autocast region) within its stated bound; the routes it does not serve left to the unfused
path."""

import itertools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dora_num as dn
from dora_num.ops.config import override

D_IN, D_OUT, R = 16, 24, 4


def _layer(w_dtype, adapter_dtype, bias, device="cpu"):
    torch.manual_seed(1)
    lin = torch.nn.Linear(D_IN, D_OUT, bias=bias, dtype=w_dtype, device=device)
    layer = dn.DoRALinear(lin, R, 2.0 * R, adapter_dtype=adapter_dtype)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    return layer


def _step(one_node, *, w_dtype, adapter_dtype, autocast, x_shape, bias, x_grad, fold=True, ckpt=False,
          device="cpu", nodes=None):
    layer = _layer(w_dtype, adapter_dtype, bias, device)
    x_dtype = torch.bfloat16 if autocast else w_dtype
    torch.manual_seed(2)
    x = torch.randn(*x_shape, dtype=x_dtype, device=device).requires_grad_(x_grad)
    D = torch.randn(*x_shape[:-1], D_OUT, device=device)
    with override(one_node=one_node, fold_output_add=fold):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = checkpoint(layer, x, use_reentrant=False) if ckpt else layer(x)
        if nodes is not None:
            nodes.append(_node_names(y))
        y.backward(D.to(y.dtype))
    grads = [p.grad for p in (layer.lora_A, layer.lora_B, layer.magnitude)]
    return [y.detach()] + grads + ([x.grad] if x_grad else [])


def _node_names(y) -> set[str]:
    seen, todo = set(), [y.grad_fn]
    while todo:
        f = todo.pop()
        if f is None or type(f).__name__ in seen:
            continue
        seen.add(type(f).__name__)
        todo.extend(n for n, _ in f.next_functions)
    return seen


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(u, v), (u - v).abs().max()


CASES = list(itertools.product(
    [torch.float32, torch.bfloat16],  # W
    [torch.float32, None],  # adapters: fp32 (the default) or W's dtype
    [False, True],  # autocast (bf16)
    [(5, D_IN), (2, 3, D_IN)],
    [False, True],  # bias
))


@pytest.mark.parametrize("w_dtype,adapter_dtype,autocast,x_shape,bias", CASES)
def test_one_node_bitwise_unfused(w_dtype, adapter_dtype, autocast, x_shape, bias):
    kw = dict(w_dtype=w_dtype, adapter_dtype=adapter_dtype, autocast=autocast, x_shape=x_shape, bias=bias)
    for x_grad, fold in ((True, True), (False, True), (True, False)):
        nodes = []
        fused = _step(True, x_grad=x_grad, fold=fold, nodes=nodes, **kw)
        _assert_bitwise(fused, _step(False, x_grad=x_grad, fold=fold, **kw))
        served = autocast or adapter_dtype is None or w_dtype == torch.float32
        assert ("LoraComposeFunctionBackward" in nodes[0]) == served, nodes[0]


def test_one_node_under_checkpoint_bitwise():
    kw = dict(w_dtype=torch.bfloat16, adapter_dtype=torch.float32, autocast=True, x_shape=(2, 3, D_IN), bias=False,
              x_grad=True, ckpt=True)
    _assert_bitwise(_step(True, **kw), _step(False, **kw))


def test_one_node_not_for_promotion_dropout_or_inference():
    # fp32 adapters on a bf16 W without autocast: the promoting route stays unfused
    nodes = []
    _step(True, w_dtype=torch.bfloat16, adapter_dtype=torch.float32, autocast=False, x_shape=(5, D_IN), bias=False,
          x_grad=True, nodes=nodes)
    assert "LoraComposeFunctionBackward" not in nodes[0]
    layer = _layer(torch.float32, torch.float32, False)
    layer.dropout = torch.nn.Dropout(0.5)
    y = layer(torch.randn(5, D_IN))
    assert "LoraComposeFunctionBackward" not in _node_names(y)
    layer.dropout = torch.nn.Identity()
    with torch.no_grad():
        assert layer(torch.randn(5, D_IN)).grad_fn is None


def test_adapter_used_twice_in_one_autocast_region():
    """Autocast casts a leaf adapter once per autocast region and shares the cast, so the unfused
    path sums the gradients of two uses in bf16 before the cast back to fp32; the one-node path
    casts per use and AccumulateGrad sums in fp32.  Each use's term is bitwise the same, so the two
    differ by the bf16 rounding of the sum: at most one bf16 half-ulp of the larger of the two
    results (2^-8 relative), elementwise; m's gradient (fp32 throughout) is bitwise the same."""

    def run(one_node):
        layer = _layer(torch.bfloat16, torch.float32, False)
        torch.manual_seed(3)
        x1, x2 = (torch.randn(33, D_IN, dtype=torch.bfloat16) for _ in range(2))
        with override(one_node=one_node):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x1) + layer(x2)
            y.float().pow(2).sum().backward()
        return layer.lora_A.grad, layer.lora_B.grad, layer.magnitude.grad

    fused, unfused = run(True), run(False)
    for u, v in zip(fused[:2], unfused[:2]):
        bound = 2.0**-8 * torch.maximum(u.abs(), v.abs())
        assert bool(((u - v).abs() <= bound).all())
        assert not torch.equal(u, v)  # the case is real: the bf16 sum does round here
    assert torch.equal(fused[2], unfused[2])


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("x_shape", [(64, D_IN), (2, 96, D_IN)])
def test_one_node_bitwise_unfused_cuda(ckpt, x_shape):
    """On CUDA (cuBLAS, the fused Triton compose tier): bitwise the unfused path's output and grads."""
    kw = dict(w_dtype=torch.bfloat16, adapter_dtype=torch.float32, autocast=True, x_shape=x_shape, bias=False,
              x_grad=True, ckpt=ckpt, device="cuda")
    with override(compose_path="fused"):
        nodes = []
        fused = _step(True, nodes=nodes, **kw)
        assert "LoraComposeFunctionBackward" in nodes[0]
        _assert_bitwise(fused, _step(False, **kw))


@pytest.mark.gpu
def test_one_node_bitwise_unfused_cuda_model_shape():
    """At a model's shapes (4096 -> 1024, r=64, 2 x 512 tokens), where cuBLAS picks other kernels."""
    torch.manual_seed(0)

    def run(one_node):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4096, 1024, bias=False, dtype=torch.bfloat16, device="cuda")
        layer = dn.DoRALinear(lin, 64, 128.0)
        with torch.no_grad():
            layer.lora_B.normal_(0, 1e-3)
        x = torch.randn(2, 512, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        with override(one_node=one_node), torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(torch.randn_like(y))
        return [y.detach(), layer.lora_A.grad, layer.lora_B.grad, layer.magnitude.grad, x.grad]

    _assert_bitwise(run(True), run(False))


@pytest.mark.gpu
def test_cached_norm_flag_read_once_cuda():
    """A reused norm (norm_cache="always") whose flag was read clean is not watched again: no new
    pending flag per forward (the host cost of a copy and an event), and the output is the same."""
    from dora_num.ops import finite

    layer = _layer(torch.bfloat16, torch.float32, False, device="cuda")
    x = torch.randn(8, D_IN, dtype=torch.bfloat16, device="cuda")
    with override(norm_cache="always"), torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        y0 = layer(x)
        finite.check_pending()
        y1 = layer(x)
        assert finite.pending_count() == 0
        with torch.no_grad():
            layer.magnitude[0] = float("nan")  # a new version of m: the norm cache misses, g is checked
        layer(x)
        with pytest.raises(ValueError):
            finite.check_pending()
    assert torch.equal(y0, y1)
