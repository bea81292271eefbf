"""``torch.compile`` of :class:`~dora_num.DoRALinear`: one graph, no state of its own, the eager bits.

Under the compiler the layer's ``g`` comes from ``dora_num::weight_den`` (no read of the device, an
explicit running flag it raises, ``rowsum(W*W)`` and W's zero rows from the layer's buffers, formed again
only when W changes) and ``dora_num::magnitude_div``, the compose from ``dora_num::compose_fwd``/``compose_bwd``;
:func:`dora_num.check_flags` reads the flags.  On the CPU the ops run the torch tail and the eager compose
(the Triton kernels under the interpreter in the ``interpreter`` cases); on CUDA with ``OpConfig.traced_ops``
on, the fused compose and the norm's products are traced ops whose kernels Inductor launches (``gpu`` cases,
which also add no device sync and CUDA graphs).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import replace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dora_num as dn
from dora_num.numerics.formulas import scale_constants
from dora_num.ops.config import override
from dora_num.ops.guard import CancellationWarning
from dora_num.ops.terms import base_passes
from dora_num.ops.weight_norm import FLAG_FIELDS, clear_base_sq_cache, new_flag, weight_den

from .kernels.helpers import assert_bitwise


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each case compiles from scratch (recompile limits and caches are per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(f, layer, x, g=None):
    for p in (layer.magnitude, layer.lora_A, layer.lora_B, x):
        p.grad = None
    y = f(x) if g is None else f(x, g=g)
    y.square().sum().backward()
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in (layer.magnitude, layer.lora_A,
                                                                           layer.lora_B)]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_layer_compiles_to_one_graph_with_the_eager_bits(bias, small_layer):
    """Inductor (CPU), fullgraph: one graph, no recompile on repeated calls, output and every gradient
    bitwise the eager layer's (fp32: Inductor keeps each fp32 operation's rounding)."""
    layer = small_layer(16, 12, bias=bias, m_noise=1e-3)
    x = torch.randn(5, 16, requires_grad=True)
    want = _step(layer, layer, x)
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=cnt)
    for _ in range(3):
        got = _step(compiled, layer, x)
        for a, b in zip(got, want):
            assert_bitwise(a, b)
    assert cnt.frame_count == 1
    with torch.no_grad():  # inference: one more graph (no autograd), the same bits
        assert_bitwise(compiled(x), want[0])
    assert cnt.frame_count == 2


def test_compiled_layer_keeps_no_state(small_layer):
    """A layer never run eagerly, compiled: the forward leaves no cache on W and no norm cache on the
    layer (rowsum(W*W) and the zero rows live in the layer's buffers, op inputs), and its g is
    bitwise the eager (cached) one."""
    layer = small_layer(16, 12, m_noise=1e-3)
    W = layer.base.weight
    clear_base_sq_cache(W)  # the initial magnitude's norm (eager, at construction) filled it
    x = torch.randn(5, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    y = compiled(x)
    assert [a for a in vars(W) if a.startswith("_dora_num")] == []
    assert "_norm_cache" not in layer.__dict__
    assert_bitwise(y, layer(x))  # the eager call fills the caches now
    assert any(a.startswith("_dora_num") for a in vars(W))


def test_weight_den_raises_its_running_flag_and_matches_eager(small_layer):
    layer = small_layer(16, 12, m_noise=1e-3)
    W, A, B, m = layer.base.weight, layer.lora_A, layer.lora_B, layer.magnitude
    acc = new_flag("cpu")
    den = weight_den(W, A, B, layer.scale, m, acc=acc)
    g_eager = layer.magnitude_scale()
    assert_bitwise(m.detach() / den, g_eager.detach())
    assert dict(zip(FLAG_FIELDS, acc.tolist())) == {"code": 0, "rows_flagged": 0, "calls": 1}
    torch.library.opcheck(torch.ops.dora_num.weight_den.default,
                          (W.detach(), A.detach(), B.detach(), m.detach(), acc, torch.empty(12),
                           torch.empty(12, dtype=torch.bool), layer.scale, 1 << 20,
                           dn.ops.config.get_config().key, "recompute"),
                          test_utils=("test_schema", "test_faketensor"))


def _tiny_model(small_layer):
    """Two DoRA layers with a ReLU between (the second on its own seed), trainable base weights."""
    model = torch.nn.Sequential(small_layer(16, 12, m_noise=1e-3), torch.nn.ReLU(),
                                small_layer(12, 8, m_noise=1e-3, seed=4))
    for lyr in (model[0], model[2]):
        lyr.base.weight.requires_grad_(True)
    return model


def _fresh_eager(model, x):
    """The eager output of a copy of ``model`` (new storage: its norm formed from W as it is now)."""
    return copy.deepcopy(model)(x)


@pytest.mark.parametrize("cfg", [pytest.param({}, id="torch-tail"),
                                 pytest.param(dict(norm_tail="triton"), id="triton-tail",
                                              marks=pytest.mark.interpreter)])
def test_compiled_model_forms_base_sq_once_and_again_when_w_changes(cfg, small_layer):
    """fullgraph compile of a tiny model: rowsum(W*W) and W's zero rows are formed once per layer (the
    first call), not per call; an optimizer step on a trainable base forms them again for that W only
    (its version counter moved), and a write through ``W.data`` after ``clear_base_sq_cache`` (which
    no version counter sees) for every layer once; each output bitwise the eager one of W as it is."""
    with override(**cfg):
        model = _tiny_model(small_layer)
        x = torch.randn(5, 16)
        cnt = CompileCounterWithBackend("inductor")
        compiled = torch.compile(model, fullgraph=True, backend=cnt)
        with torch.no_grad():
            n0 = base_passes()
            y = compiled(x)
            assert base_passes() - n0 == 2  # one pass per layer: the buffers start empty
            for _ in range(3):
                n0 = base_passes()
                assert_bitwise(compiled(x), y)
                assert base_passes() == n0  # read from the buffers, not formed from W
            assert_bitwise(y, _fresh_eager(model, x))
        opt = torch.optim.SGD([model[0].base.weight], lr=0.1)
        compiled(x).square().sum().backward()
        opt.step()  # changes W of the first layer only (bumps its version counter)
        with torch.no_grad():
            n0 = base_passes()
            y = compiled(x)
            assert base_passes() - n0 == 1
            assert_bitwise(y, _fresh_eager(model, x))
            W = model[2].base.weight
            W.data.copy_(W.data.flip(0))  # through .data: no version counter sees it
            clear_base_sq_cache(W)
            n0 = base_passes()
            y = compiled(x)
            assert base_passes() - n0 == 2  # every layer's cache was marked stale
            assert_bitwise(y, _fresh_eager(model, x))
        assert cnt.frame_count == 2  # training and no_grad: one graph each, no recompile on W's changes
        dn.check_flags(model)


def test_compiled_base_cache_follows_the_layer_to_another_dtype(small_layer):
    """``.to(float64)`` converts the layer but not its cache: the buffers start again as fp32 and bool
    on W's device, formed at the next call (the first compiled call formed them for the fp32 W)."""
    layer = small_layer(16, 12, m_noise=1e-3)
    x = torch.randn(5, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    with torch.no_grad():
        compiled(x)
        layer.to(torch.float64)
        assert layer._base_sq.dtype == torch.float32 and layer._zero_rows.dtype == torch.bool
        n0 = base_passes()
        y = compiled(x.double())
        assert base_passes() - n0 == 1
        assert torch.equal(y.view(torch.int64), layer(x.double()).view(torch.int64))  # bitwise


def test_nonfinite_m_is_flagged_and_named_by_check_flags(small_layer):
    """No read of the device in the graph: the compiled forward returns, the flag is set, and
    check_flags raises naming the tensor at fault (as the eager forward would); the flag is reset."""
    layer = small_layer(16, 12, m_noise=1e-3)
    x = torch.randn(5, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    compiled(x)
    assert dn.check_flags(layer) == 1
    with torch.no_grad():
        layer.magnitude[3] = float("nan")
    compiled(x)
    assert int(layer._flags[0]) == 3 and int(layer._flags[2]) == 1
    with pytest.raises(ValueError, match=r"m contains non-finite values \(1 NaN, 0 Inf\)"):
        dn.check_flags(layer)
    assert layer._flags.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="m contains non-finite"):  # eager: at once
        layer(x)


def test_nonfinite_given_g_is_flagged(small_layer):
    layer = small_layer(16, 12, m_noise=1e-3)
    x = torch.randn(5, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    g = torch.ones(12)
    compiled(x, g=g)
    dn.check_flags(layer)
    g[0] = float("inf")
    compiled(x, g=g)
    with pytest.raises(dn.NotFiniteError, match=r"compiled; 1 call\(s\) since the last check_flags\): g was not"):
        dn.check_flags(layer)


def _cancelling_layer(on_cancellation):
    """A layer whose rows 2 and 7 are cancelled by the update (W ~ -sBA): the guard recomputes them."""
    gen = torch.Generator().manual_seed(0)
    d_out, d_in, r = 16, 32, 4
    lin = torch.nn.Linear(d_in, d_out, bias=False)
    A = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
    B = torch.randn(d_out, r, generator=gen)
    layer = dn.DoRALinear(lin, rank=r, alpha=2.0 * r, lora_A=A, lora_B=B, magnitude=torch.ones(d_out),
                          on_cancellation=on_cancellation)
    s = scale_constants(layer.scale)[0]
    V = s * (B.double() @ A.double())
    with torch.no_grad():
        W = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64) / math.sqrt(d_in)
        for j in (2, 7):
            W[j] = -V[j] + 1e-7 * V[j].norm() * W[j]
        lin.weight.copy_(W.float())
    return layer


def test_guard_recomputes_under_compile():
    """The compiled g of rows the guard recomputes is bitwise the eager one (far from the bare
    factored value), and the flag records the two rows."""
    layer = _cancelling_layer("recompute")
    x = torch.randn(3, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="inductor")(x)
    assert_bitwise(got, want)
    code, rows, calls = layer._flags.tolist()
    assert (code, rows, calls) == (1, 2, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dn.check_flags(layer)  # recompute mode: nothing to report
    with override(norm_cache="off"):
        bare = _cancelling_layer("off")
        assert not torch.equal(bare(x), want)


def test_guard_warns_under_compile():
    layer = _cancelling_layer("warn")
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    with pytest.warns(CancellationWarning, match=r"2 row\(s\) recomputed in float64"):
        compiled(torch.randn(3, 32))


def test_recompile_on_configuration_change_only(small_layer):
    """Calls under one configuration reuse a graph; another configuration is traced once more."""
    layer = small_layer(16, 12, m_noise=1e-3)
    x = torch.randn(5, 16)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=cnt)
    for _ in range(2):
        compiled(x)
    with override(fold_output_add=False):
        compiled(x)
        compiled(x)
    compiled(x)
    assert cnt.frame_count == 2


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_compiled_fused_kernels_give_the_eager_bits(dtype, small_layer):
    """The fused compose and the Triton norm tail (its running flag raised by atomics) under the
    interpreter: the output and the adapter gradients (the kernels' outputs and the GEMMs of their
    outputs) bitwise the eager layer's, on every CPU.

    ``x.grad`` is not the kernels' output: Inductor folds its two terms (through A, then through W)
    into one ``addmm(dx_A, gy, W)`` where eager runs ``mm`` then ``add``.  Whether the BLAS adds ``dx_A``
    after the product (the eager bits: seen on an Intel Xeon) or accumulates onto it (92 of 384 fp32
    elements differ: seen on an AMD EPYC) is the library's choice per CPU, so ``x.grad`` is held to the
    bound both orders meet: each is within ``gamma_{K+1} (|dx_A| + |gy| |W|)`` of ``dx_A + gy W``
    (K = d_out products and one addition), hence ``|dx_c - dx| <= 2 gamma_{K+1} (|dx_A| + |gy| |W|)``,
    with ``dx_A`` and ``gy`` (the gradient at the base output) measured apart in eager
    (``forward(x_A, base_out=x_W W^T)``).  In 16 bits each GEMM accumulates in fp32 and rounds once, so
    ``|dx_c - dx| <= 2 u (|dx_W| + |dx_A|)`` plus the same fp32 term."""
    with override(compose_path="fused", norm_tail="triton"):
        layer = small_layer(64, 48, rank=8, dtype=dtype, adapter_dtype=dtype, m_noise=1e-3)
        x = torch.randn(6, 64, dtype=dtype, requires_grad=True)
        want = _step(layer, layer, x)
        compiled = torch.compile(layer, fullgraph=True, backend="inductor")
        got = _step(compiled, layer, x)
        for i in (0, 2, 3, 4):  # y, m.grad, A.grad, B.grad
            assert_bitwise(got[i], want[i])
        assert layer._flags.tolist() == [0, 0, 1]
        x_w, x_a = (x.detach().clone().requires_grad_(True) for _ in range(2))
        base_out = torch.nn.functional.linear(x_w, layer.base.weight)
        base_out.retain_grad()
        y = layer(x_a, base_out=base_out)
        assert_bitwise(y, want[0])
        y.square().sum().backward()
    W = layer.base.weight.detach().double()
    K = W.shape[0]
    gamma = lambda n, u: n * u / (1 - n * u)  # noqa: E731  (Higham's gamma_n)
    fp32_gemm = 2 * gamma(K + 1, 2.0**-24) * (x_a.grad.double().abs() + base_out.grad.double().abs() @ W.abs())
    bound = fp32_gemm
    if dtype != torch.float32:
        u = torch.finfo(dtype).eps / 2  # unit roundoff of the 16-bit output
        bound = bound + 2 * u * (x_w.grad.double().abs() + x_a.grad.double().abs())
    diff = (got[1].double() - want[1].double()).abs()
    bad = (diff > bound).nonzero().tolist()
    assert not bad, (f"x.grad outside the bound at {len(bad)} of {diff.numel()} elements, first (row, col) {bad[:5]}: "
                     f"compiled {[float(got[1][i, j]) for i, j in bad[:5]]}, eager {[float(want[1][i, j]) for i, j in bad[:5]]}, "
                     f"bound {[float(bound[i, j]) for i, j in bad[:5]]}")


def _traced_graphs(fn, *args):
    """The forward and backward FX graphs AOT autograd hands to the compiler for ``fn(*args)`` (then
    ``.square().sum().backward()``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(*args).square().sum().backward()
    return graphs


PATHS = [pytest.param({}, id="default"),
         pytest.param(dict(compose_path="fused", norm_tail="triton"), id="fused-triton", marks=pytest.mark.interpreter)]
# aten/prims ops whose CUDA lowering by inductor need not be correctly rounded (div.full.f32, approximate
# sqrt/rsqrt/exp/log, reductions in its own order)
INEXACT = ("div", "true_divide", "reciprocal", "sqrt", "rsqrt", "pow", "exp", "log", "mean", "softmax", "norm")


@pytest.mark.parametrize("paths", PATHS)
@pytest.mark.parametrize("m_dtype, bias, autocast", [(torch.float32, False, False), (torch.bfloat16, False, False),
                                                     (torch.float32, True, True)],
                         ids=["fp32-m", "bf16-m", "bias-bf16-autocast"])
def test_no_division_is_left_to_the_compiler(m_dtype, bias, autocast, paths, small_layer):
    """Inductor lowers a traced fp32 division to Triton's ``div.full.f32`` on CUDA (not correctly
    rounded: the probe on the H200 found the compiled m.grad up to 1 ulp off eager): every division,
    square root or reduction of the compiled layer, forward and backward (``m.grad = dg / den``),
    sits inside an op of this package."""
    with override(**paths):
        layer = small_layer(16, 12, bias=bias, m_noise=1e-3)
        layer.magnitude.data = layer.magnitude.data.to(m_dtype)
        x = torch.randn(5, 16, requires_grad=True)

        def fn(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return layer(x).float()
        graphs = _traced_graphs(fn, x)
    assert len(graphs) == 2  # forward, backward
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert any("dora_num" in t for t in targets)  # the graphs hold the layer's ops
    inexact = [t for t in targets if t.startswith(("aten.", "prims.")) and t.split(".")[1] in INEXACT]
    assert inexact == [], inexact


@pytest.mark.parametrize("paths", PATHS)
@pytest.mark.parametrize("recompute_lora", [True, False], ids=["lora-compose", "compose"])
def test_compiled_forward_folds_the_output_add_as_eager(recompute_lora, paths, small_layer):
    """The compiled layer runs the eager layer's passes: the output add ``base + delta`` inside the
    compose op (``add_base``), not as one more pass over the output in the graph, and in the backward
    ``dbase = grad + (g-1) grad`` from the op's own pass.  A graph with an ``aten.add`` in its forward
    would read and write every output element once more (0.35 ms per 8B decoder layer in bf16)."""
    with override(recompute_lora=recompute_lora, **paths):
        layer = small_layer(16, 12, bias=False, m_noise=1e-3)
        x = torch.randn(5, 16, requires_grad=True)
        graphs = _traced_graphs(layer, x)
        fwd = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
        ops = [n for n in fwd if "compose_fwd" in str(n.target)]
        assert len(ops) == 1, [str(n.target) for n in fwd]
        assert True in ops[0].args[5:], ops[0].args  # add_base (positional: after s and the tier's flags)
        adds = [str(n.target) for n in fwd if str(n.target).startswith("aten.add")]
        assert adds == [], adds
        # inference: the same op, and no copy of its output into a buffer of the graph
        with torch.no_grad():
            inf = _traced_graphs_no_grad(layer, x)
        targets = [str(n.target) for n in inf.graph.nodes if n.op == "call_function"]
        assert not [t for t in targets if t.startswith(("aten.add", "aten.copy"))], targets


def _traced_graphs_no_grad(fn, *args):
    """The single inference graph AOT autograd hands to the compiler for ``fn(*args)`` under no_grad."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, inference_compiler=keep))(*args)
    assert len(graphs) == 1
    return graphs[0]


def _cuda_step(f, layer, x):
    """A training step under bf16 autocast (PEFT's fp32 adapters): y, m.grad, A.grad, B.grad."""
    for p in (layer.magnitude, layer.lora_A, layer.lora_B):
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = f(x)
    y.float().square().mean().backward()
    return [y.detach().clone()] + [p.grad.clone() for p in (layer.magnitude, layer.lora_A, layer.lora_B)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 257], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("traced", ["tail", True, False], ids=["traced-tail", "traced-ops", "opaque-ops"])
def test_cuda_compiled_layer_runs_its_kernels_from_inductor_with_the_eager_bits(traced, tokens, small_layer):
    """On CUDA (``OpConfig.traced_ops``) the fused compose's forward and backward and the norm's products are
    traced into the graph: Inductor's generated code launches ``_compose_fwd_kernel``, ``_compose_bwd_kernel``,
    ``_split_kernel``, ``_block_sum_kernel``, ``_div_rn_kernel`` (``g = m / den`` and its gradient) and, with
    ``OpConfig.traced_tail``, the norm's tail ``_norm_tail_kernel`` itself, and of this package's opaque ops
    only the base cache's refresh (``dora_num::base_refresh``; without ``traced_tail`` the refresh and the
    tail's launch, ``dora_num::norm_den``) and, in the backward,
    the product ``lora`` formed again (``dora_num::lora_again``: opaque, so that the joint graph does not merge
    it with the forward's and keep it) are left.  Inductor compiles a wrapped kernel with
    FMA contraction on, which the kernels' ``mul_rn`` makes harmless: the output and the adapter gradients are
    bitwise the eager layer's, training and inference, and ``rowsum(W*W)`` is formed once, not per call.
    With the switch off the opaque ops run (the A/B baseline), with the same bits.  An unaligned token count
    too (``pad_mm`` may pad a product Inductor sees), and no fallback of Inductor's analysis of what a wrapped
    kernel writes (it then copies every argument: the bits hold, the time does not)."""
    import logging

    from torch._inductor.utils import run_and_get_code

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.seen = []

        def emit(self, record):
            self.seen.append(record.getMessage())

    keep = Keep()
    wrap_log = logging.getLogger("torch._higher_order_ops.triton_kernel_wrap")
    wrap_log.addHandler(keep)
    try:
        with override(traced_ops=bool(traced), traced_tail=traced == "tail"):
            layer = small_layer(1024, 768, rank=16, alpha=32.0, dtype=torch.bfloat16, adapter_dtype=torch.float32,
                                m_noise=1e-3, b_std=0.02, device="cuda")
            x = torch.randn(2, tokens, 1024, device="cuda", dtype=torch.bfloat16)  # >= 393,216 outputs: fused tier
            want = _cuda_step(layer, layer, x)
            compiled = torch.compile(layer, fullgraph=True)
            got, code = run_and_get_code(lambda: _cuda_step(compiled, layer, x))
    finally:
        wrap_log.removeHandler(keep)
    assert not [m for m in keep.seen if "assuming every input is mutated" in m], keep.seen
    with override(traced_ops=bool(traced), traced_tail=traced == "tail"):
        for a, b in zip(got, want):
            assert_bitwise(a, b)
        n0 = base_passes()
        for _ in range(2):
            for a, b in zip(_cuda_step(compiled, layer, x), want):
                assert_bitwise(a, b)
        assert base_passes() == n0  # the layer's buffers, refreshed only when W changes
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            y_inf, code_inf = run_and_get_code(lambda: compiled(x))
            assert_bitwise(y_inf, layer(x))
        assert layer._flags.tolist()[:2] == [0, 0]
    text = "\n".join(code + code_inf)
    kernels = [k for k in ("_compose_fwd_kernel", "_compose_bwd_kernel", "_split_kernel", "_block_sum_kernel",
                           "_norm_tail_kernel", "_div_rn_kernel") if k in text]
    opaque = [op for op in ("lora_compose_fwd", "compose_bwd", "compose_fwd", "weight_den", "magnitude_div")
              if f"dora_num.{op}.default" in text]
    if traced == "tail":
        assert len(kernels) == 6 and not opaque, (kernels, opaque)
        assert "dora_num.base_refresh.default" in text and "dora_num.lora_again.default" in text
    elif traced:
        assert len(kernels) == 5 and "_norm_tail_kernel" not in kernels and not opaque, (kernels, opaque)
        assert "dora_num.norm_den.default" in text and "dora_num.lora_again.default" in text
    else:
        assert not kernels and len(opaque) == 5, (kernels, opaque)


def _run_and_get_new_code(fn):
    """``(fn(), the Inductor code it compiled)``, keeping TorchDynamo's cache (``torch._inductor.utils.
    run_and_get_code`` resets it first, so every call would compile again from scratch, shapes static)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        return fn(), codes


def _norm_over_changing_shapes(device, dtype, gen):
    """``g`` of ``magnitude_scale_and_flag`` compiled (``fullgraph=True``, traced ops on) and called on W of three
    shapes, each ``g`` held to the eager bits; the Inductor code each call compiled."""
    from dora_num.ops.products import clear_mm_probes
    from dora_num.ops.weight_norm import magnitude_scale_and_flag

    def g_of(W, A, B, m):
        return magnitude_scale_and_flag(W, A, B, 2.0, m)[0]

    torch._dynamo.reset()
    clear_mm_probes()  # as in a fresh process: nothing probed yet
    codes = []
    with override(traced_ops=True):
        compiled = torch.compile(g_of, fullgraph=True)
        for d_out, d_in in ((768, 1024), (1024, 1536), (1536, 512)):  # three shapes, three sizes d_out + d_in
            W = torch.randn(d_out, d_in, device=device, generator=gen).to(dtype)
            A = 0.02 * torch.randn(16, d_in, device=device, generator=gen)
            B = 0.02 * torch.randn(d_out, 16, device=device, generator=gen)
            m = W.float().norm(dim=1) * (1 + 1e-3 * torch.randn(d_out, device=device, generator=gen))
            with torch.no_grad():
                got, code = _run_and_get_new_code(lambda: compiled(W, A, B, m))
                assert_bitwise(got, g_of(W, A, B, m))
            codes.append("\n".join(code))
    return codes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_norm_over_changing_shapes_compiles_twice_with_the_eager_bits(dtype):
    """On the CPU (the opaque denominator): the first shape compiles a static graph, the second one with
    symbolic shapes, which serves the third; ``g`` is bitwise the eager one on every shape."""
    codes = _norm_over_changing_shapes("cpu", dtype, torch.Generator().manual_seed(0))
    assert codes[0] and codes[1] and not codes[2], [len(c) for c in codes]
    assert all("dora_num.weight_den.default" in c for c in codes[:2])


@pytest.mark.gpu
def test_cuda_compiled_norm_over_changing_shapes_keeps_the_eager_bits():
    """The same on CUDA, as a study looping over a model's projections calls it: the second shape compiles
    again with symbolic shapes (and with them the default byte budget of the column chunks, an expression of
    W's size, which differs between the shapes), the third compiles nothing.  A 16-bit W takes the traced
    denominator (its products take W whole) and an fp32 W the opaque one (its routes read the matmul switches,
    which Dynamo cannot trace); ``g`` is bitwise the eager one on every shape.  Each dtype is compiled before
    any eager call of it: the probe of ``torch.mm(..., out_dtype=float32)`` then runs while Dynamo traces."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        codes = _norm_over_changing_shapes("cuda", dtype, gen)
        assert codes[0] and codes[1] and not codes[2], (dtype, [len(c) for c in codes])  # one symbolic recompile
        traced = dtype != torch.float32
        for text in codes[:2]:
            assert ("_split_kernel" in text) == traced and ("dora_num.weight_den.default" in text) != traced, dtype


@pytest.mark.interpreter
def test_traced_ops_run_eagerly_as_the_opaque_ones(small_layer):
    """The bodies of the traced ops (what Inductor traces on CUDA), run eagerly on the CPU under the
    interpreter: ``dora_num::weight_den_traced`` gives the opaque ``weight_den``'s denominator and raises
    the running flag alike, ``dora_num::lora_compose_fused`` with its backward the opaque
    ``lora_compose_fwd``'s output and gradients, and ``dora_num::magnitude_div_traced`` torch's division, bit
    for bit (the GPU test is to hold the traced graphs to the eager bits:
    ``test_cuda_compiled_layer_runs_its_kernels_from_inductor_with_the_eager_bits``)."""
    from dora_num.ops import lora_compose as lc
    from dora_num.ops import weight_norm as wn
    from dora_num.ops.config import get_config

    with override(compose_path="fused", norm_tail="triton"):
        cfg = get_config()
        layer = small_layer(64, 48, rank=8, m_noise=1e-3)
        W, A, B, m = (t.detach() for t in (layer.base.weight, layer.lora_A, layer.lora_B, layer.magnitude))
        dens, flags = [], []
        keys = {"opaque": cfg.key, "traced": cfg.key, "traced tail": replace(cfg, traced_tail=True).key}
        for name, key in keys.items():  # the traced body with the tail in norm_den, and launched itself
            op = wn._weight_den_op if name == "opaque" else wn._weight_den_traced_op
            acc = new_flag("cpu")
            base = (torch.empty(48), torch.empty(48, dtype=torch.bool))
            last = "recompute" if name == "opaque" else True
            dens.append(op(W, A, B, m, acc, base[0], base[1], layer.scale, 2**20, key, last))
            flags.append(acc.tolist())
        for d in dens[1:]:
            assert_bitwise(d, dens[0])
        assert flags == [[0, 0, 1]] * 3
        from dora_num.ops import magnitude as mg

        den = dens[0].clone()
        den[:3] = torch.tensor([3.0, 2.0**-140, 7.0])  # a subnormal denominator: kept, as torch's division keeps it
        gs = []
        for op in (mg._magnitude_div_op, mg._magnitude_div_traced_op):
            mm = m.clone().requires_grad_(True)
            gv = op(mm, den)
            gv.sum().backward()
            gs.append((gv.detach(), mm.grad))
        assert_bitwise(gs[1][0], gs[0][0])
        assert_bitwise(gs[1][1], gs[0][1])
        x = torch.randn(6, 64)
        xa = (x @ A.T).requires_grad_(True)
        base_out = (x @ W.T).requires_grad_(True)
        g = (m / dens[0]).requires_grad_(True)
        B_ = B.clone().requires_grad_(True)
        outs = []
        for op in (lambda: lc._lora_compose_fwd_op(base_out, xa, B_, g, 0.5, True, True, cfg.key),
                   lambda: lc._lora_compose_fused_op(base_out, xa, B_, g, 0.5, True, cfg.key)):
            for t in (xa, base_out, g, B_):
                t.grad = None
            y = op()
            y.square().sum().backward()
            outs.append([y.detach(), xa.grad, base_out.grad, g.grad, B_.grad])
    for a, b in zip(*outs):
        assert_bitwise(b, a)
