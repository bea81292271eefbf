"""The numerical contract on the GPU (marked ``gpu``; skipped with a visible reason on CPU).

bf16 bit-exactness lives here because the CPU interpreter truncates bf16 casts.
Also: production norm assembly vs torch on CUDA, the PTX of every variant, the
compiled model with the kernels inside, the factored norm's tensor-core product
within its bound and its memory, and the dispatch tiers on CUDA.
"""

import math

import pytest
import torch

import dora_num as dn
from dora_num.numerics.arithmetic import TorchFP32
from dora_num.numerics.formulas import norm_assembly, scale_constants
from dora_num.ops import compose as C
from dora_num.ops import reference as ref
from dora_num.ops.kernels import compose as kc

from ._bitwise import _bits, assert_bitwise  # noqa: F401  (shared with the CPU/GPU kernel tests)

pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.bfloat16, torch.float16, torch.float32)]
SHAPES = [pytest.param(s, id="x".join(map(str, s))) for s in ((1, 1), (3, 63), (257, 4097), (2048, 8192))]
S = scale_constants(0.37)[0]




def _inputs(shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    lora = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    g = 1.0 + 1e-3 * torch.randn(shape[-1], generator=gen, device="cuda")
    grad = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    return base, lora, g, grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_forward_and_backward_bitwise(shape, dtype):
    base, lora, g, grad = _inputs(shape, dtype)
    out, inner = kc.compose_fwd(base, lora, g, S, write_inner=True)
    assert_bitwise(out, ref.compose_stable_ref(base, lora, g, S))
    inner_r = ref.compose_inner_ref(base, lora, S)
    assert_bitwise(inner, inner_r)
    dl, db, dg = kc.compose_bwd(grad, inner, g, S)
    dl_r, db_r, _ = ref.compose_backward_ref(grad, inner_r, g, S)
    assert_bitwise(dl, dl_r)
    assert_bitwise(db, db_r)
    exact = (inner_r.double() * grad.double()).sum(0)
    err = (dg.double() - exact).abs()
    assert bool((err <= kc.dg_error_bound(inner_r, grad)).all())
    assert_bitwise(kc.compose_bwd(grad, inner, g, S)[2], dg)  # deterministic
    # the layer's fold of its output add: y = base + delta, dbase = D + (g-1) D (torch's adds)
    y, _ = kc.compose_fwd(base, lora, g, S, add_base=True)
    assert_bitwise(y, base + out)
    _, db2, _ = kc.compose_bwd(grad, None, g, S, base=base, lora=lora, add_grad=True)
    assert_bitwise(db2, grad + db_r)


@pytest.mark.parametrize("path", ["auto", "eager"])
def test_layer_output_add_fold_bitwise_bf16(path):
    """DoRALinear at bf16 on the H200 (fused training tier under auto): output and gradients
    bitwise those of compose followed by a separate ``base + delta``."""
    from .test_compose_kernels import folded_layer_step, unfolded_layer_step

    torch.manual_seed(6)
    layer = dn.DoRALinear(torch.nn.Linear(1024, 768, bias=False, device="cuda", dtype=torch.bfloat16), rank=32,
                          alpha=64.0, compose_path=path)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.02)
    x = torch.randn(3, 300, 1024, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(3, 300, 768, device="cuda", dtype=torch.bfloat16)
    C.reset_dispatch_counts()
    y_ref, g_ref = unfolded_layer_step(layer, x, D, path)
    y, gr = folded_layer_step(layer, x, D)
    assert C.dispatch_counts()["fused_training" if path == "auto" else "eager"] == 2
    assert_bitwise(y, y_ref)
    for a, b in zip(gr, g_ref):
        assert_bitwise(a, b)
    with torch.no_grad():
        assert_bitwise(layer(x), y_ref)


def test_forward_ptx_has_no_fma():
    base, lora, g, _ = _inputs((64, 1024), torch.bfloat16)
    from dora_num.ops.kernels.norm_assembly import ptx_instruction_counts

    _, _, k = kc.compose_fwd(base, lora, g, S, return_kernel=True)
    assert ptx_instruction_counts(k)["fma.rn.f32"] == 0
    out_on, _, k_on = kc.compose_fwd(base, lora, g, S, fp_fusion=True, return_kernel=True)
    assert ptx_instruction_counts(k_on)["fma.rn.f32"] > 0


def test_norm_assembly_production_bitwise_and_ptx():
    from dora_num.ops.kernels.norm_assembly import norm_assembly_triton, ptx_instruction_counts
    from dora_num.studies.suite import fma_inputs

    _, two_s, s_sq = scale_constants(0.5)
    b, c, a = (torch.from_numpy(v).cuda() for v in fma_inputs(1 << 20))
    want = norm_assembly(TorchFP32, b, c, a, two_s, s_sq)  # torch.sqrt on CUDA is correctly rounded
    got, k = norm_assembly_triton(b, c, a, two_s, s_sq, return_kernel=True)
    assert_bitwise(got, want)
    counts = ptx_instruction_counts(k)
    assert counts["fma.rn.f32"] == 0 and counts["sqrt.approx"] == 0 and counts["sqrt.rn"] >= 1
    got_ptx, k2 = norm_assembly_triton(b, c, a, two_s, s_sq, sqrt="ptx", return_kernel=True)
    assert_bitwise(got_ptx, want)
    approx, k3 = norm_assembly_triton(b, c, a, two_s, s_sq, sqrt="approx", fp_fusion=True, return_kernel=True)
    c3 = ptx_instruction_counts(k3)
    assert c3["sqrt.approx"] >= 1 and c3["fma.rn.f32"] >= 1
    assert not torch.equal(approx, want)  # the non-production variant does differ


def test_compiled_model_runs_kernels_fullgraph():
    torch.manual_seed(0)
    dt = torch.bfloat16
    layers = [dn.DoRALinear(torch.nn.Linear(512, 512, device="cuda", dtype=dt), rank=16, compose_path="fused")
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


def test_factored_norm_tensor_core_within_bound_and_small():
    """At the target shape 8192x8192, r=384, bf16: U within its bound, peak extra memory
    within the memory model (U + G + a few [d_out] vectors: the tail kernel keeps B @ G
    and B's fp32 copy in registers) and <= 1/15 of the dense fp32 norm's."""

    d_out, d_in, r = 8192, 8192, 384
    gen = torch.Generator(device="cuda").manual_seed(3)
    W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).bfloat16()
    A = (torch.randn(r, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).bfloat16()
    B = (1e-2 * torch.randn(d_out, r, device="cuda", generator=gen)).bfloat16()
    s = 192 / math.sqrt(r)
    from dora_num.ops.norm import _u_product

    U = _u_product(W, A, d_in)
    U64 = W.double() @ A.double().T
    n = d_in
    gamma = 2 * n * 2.0**-24 / (1 - 2 * n * 2.0**-24)
    assert bool(((U.double() - U64).abs() <= gamma * (W.double().abs() @ A.double().abs().T)).all())
    base_sq = dn.base_row_norm_sq(W)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    w = dn.factored_row_norm(W, A, B, s, base_sq=base_sq)
    peak = torch.cuda.max_memory_allocated() - before
    dense_bytes = 3 * d_out * d_in * 4  # dense fp32 norm: B@A, W.float(), their sum (measured 805 MB)
    model = d_out * r * 4 + r * r * 4 + 4 * d_out * 4
    assert peak <= model, f"peak extra {peak} B above the model's {model} B"
    assert peak <= dense_bytes / 15, f"peak extra {peak} B vs dense fp32 {dense_bytes} B"
    ref64 = torch.linalg.vector_norm(W.double() + s * (B.double() @ A.double()), dim=1)
    assert float(((w.double() - ref64).abs() / ref64).max()) < 1e-5


@pytest.mark.parametrize("d_out,r", [(100, 65), (4096, 384), (8192, 512)])
def test_norm_tail_bitwise_on_exact_sums_and_flag(d_out, r):
    """The tail kernel on the H200: with sums exact in any order, wnorm and den are bitwise
    torch's assembly and clamp (no contraction, sqrt.rn); the flag fires on a NaN in m."""
    from dora_num.ops.kernels.norm_tail import norm_tail

    from .test_norm_tail import _exact_inputs, _exact_terms

    U, B, G, base = _exact_inputs(d_out, r, torch.bfloat16, device="cuda")
    _, two_s, s_sq = scale_constants(0.37)
    m = 0.5 + torch.rand(d_out, device="cuda")
    w, den, bad = norm_tail(U, B, G, base, two_s, s_sq, m=m, eps=1e-12)
    cross, ba = _exact_terms(U, B, G)
    want = norm_assembly(TorchFP32, base, cross, ba, two_s, s_sq)  # torch.sqrt on CUDA: correctly rounded
    assert_bitwise(w, want)
    assert_bitwise(den, want.clamp_min(1e-12))
    assert not bool(bad.any())
    m[-1] = float("nan")
    assert bool(norm_tail(U, B, G, base, two_s, s_sq, m=m, eps=1e-12)[2].any())


def test_dg_arrival_counters_are_reused_and_left_zero():
    """The in-kernel stage 2 resets its arrival counters: backward after backward, of
    varying column-block counts and on a second stream, dg stays within its bound and equal
    run to run, and every cached counter reads zero afterwards."""
    shapes = [(257, 4097), (64, 130), (2048, 8192), (3, 63), (257, 4097)]
    side = torch.cuda.Stream()
    first = {}
    for i, shape in enumerate(shapes * 2):
        base, lora, g, grad = _inputs(shape, torch.bfloat16, seed=i % len(shapes))
        stream = side if i % 3 == 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dg = kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2]
        torch.cuda.current_stream().wait_stream(stream)
        inner = ref.compose_inner_ref(base, lora, S)
        exact = (inner.double() * grad.double()).sum(0)
        assert bool(((dg.double() - exact).abs() <= kc.dg_error_bound(inner, grad)).all()), shape
        key = (shape, i % len(shapes))
        if key in first:
            assert_bitwise(dg, first[key])
        first[key] = dg
    torch.cuda.synchronize()
    assert kc._COUNTERS and all(int(buf.abs().sum()) == 0 for buf in kc._COUNTERS.values())


def test_dg_counters_under_cuda_graph_capture():
    """Each captured backward owns its zeroed counters: two graphs captured in turn and
    replayed in any order, and eager calls in between, give the eager dg bit for bit."""
    base, lora, g, grad = _inputs((2048, 8192), torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph wants
        want = kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2].clone()
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2])
        graphs.append(graph)
    for i in (1, 0, 1, 1, 0):
        graphs[i].replay()
        assert_bitwise(kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2], want)
    torch.cuda.synchronize()
    for out in outs:
        assert_bitwise(out, want)


def test_layer_g_tail_kernel_vs_torch_tail_within_bound(monkeypatch):
    """4096->4096, r=384, bf16: the layer's g through the tail kernel (the default on CUDA)
    is bitwise magnitude_scale(m, weight_norm()), and within the norm's bound of the torch tail's."""
    from dora_num.numerics.bounds import factored_norm_bound
    from dora_num.ops import norm as N

    torch.manual_seed(4)
    d, r = 4096, 384
    layer = dn.DoRALinear(torch.nn.Linear(d, d, bias=False, device="cuda", dtype=torch.bfloat16), rank=r,
                          alpha=192.0, use_rslora=True)
    with torch.no_grad():
        layer.lora_B.normal_(0, 1e-2)
    assert N._tail_kernel_used(layer.magnitude.device)
    g_tail, bad = layer._g_fast()
    assert not bool(bad.any())
    assert_bitwise(g_tail, dn.magnitude_scale(layer.magnitude, layer.weight_norm()))
    monkeypatch.setattr(N, "NORM_TAIL", "torch")
    g_torch, _ = layer._g_fast()
    W, A, B = (t.detach().float().cpu().numpy() for t in (layer.base.weight, layer.lora_A, layer.lora_B))
    w = layer.weight_norm().double().cpu().numpy()
    bound = factored_norm_bound(W, A, B, layer.scale, tensor_core_products=True)  # bf16 U, G on tensor cores
    rel = torch.from_numpy(2 * bound / w).cuda() + 3 * 2.0**-24
    diff = (g_tail.double() - g_torch.double()).abs()
    assert bool((diff <= rel * g_torch.double().abs()).all()), float((diff / (rel * g_torch.double().abs())).max())


def test_dispatch_on_cuda(monkeypatch):
    monkeypatch.delenv(C.ENV_PATH, raising=False)
    small = _inputs((2, 64), torch.bfloat16)[:3]
    big_shape = (C.FUSED_TRAIN_MIN_ELEMENTS // 4096 + 1, 4096)
    big = _inputs(big_shape, torch.bfloat16)[:3]
    assert C.select_tier(*small) == "fused_forward"
    g = small[2].clone().requires_grad_(True)
    expect_small = "fused_training" if small[0].numel() >= C.FUSED_TRAIN_MIN_ELEMENTS else "eager"
    assert C.select_tier(small[0], small[1], g) == expect_small
    assert C.select_tier(big[0], big[1], big[2].clone().requires_grad_(True)) == "fused_training"


@pytest.mark.parametrize("in_kernel", [True, False], ids=["stage2_in_kernel", "stage2_launch"])
@pytest.mark.parametrize("shape", [(4097, 3), (65536, 384), (8192, 8192)], ids=lambda s: "x".join(map(str, s)))
def test_dg_two_stage_variants_bound_and_deterministic(shape, in_kernel, monkeypatch):
    """Both placements of stage 2 (the arrival-counter one has programs racing to be
    last) stay within the bound and give the same bits on every run."""
    monkeypatch.setattr(kc, "DG_FINAL_IN_KERNEL", in_kernel)
    base, lora, g, grad = _inputs(shape, torch.bfloat16, seed=5)
    inner = ref.compose_inner_ref(base, lora, S)
    dg = kc.compose_bwd(grad, inner, g, S, need_dlora=False, need_dbase=False)[2]
    exact = (inner.double() * grad.double()).sum(0)
    assert bool(((dg.double() - exact).abs() <= kc.dg_error_bound(inner, grad)).all())
    for _ in range(5):
        assert_bitwise(kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2], dg)


def test_dora_linear_step_has_no_implicit_sync_and_still_names_bad_input():
    """A DoRALinear training step queues its work without a device sync (torch's sync
    debug mode raises on any implicit one); the finiteness check of g waits on an
    event instead, and still raises naming the input at fault."""
    from dora_num.ops.layer import DoRALinear

    torch.manual_seed(0)
    layer = DoRALinear(torch.nn.Linear(1024, 2048, bias=True).cuda().bfloat16(), 16)
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
    with pytest.raises(ValueError, match="A contains non-finite"):
        layer(x)
