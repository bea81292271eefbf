"""The fused compose kernels (:mod:`dora_num.ops.kernels.compose`) against the eager reference.

Each test runs on the CPU under the Triton interpreter and on CUDA (``gpu``; the H200
also runs the large shapes).  The contract is bitwise equality with
:mod:`dora_num.ops.reference` for the forward and the elementwise backward; ``dg`` is
checked against an fp64 sum within the a-priori bound
:func:`dora_num.ops.kernels.compose.dg_error_bound` and for determinism.  bf16 bit
equality is checked on CUDA only (helpers.BF16_ON_INTERPRETER).  The autograd Function,
the dispatch and the custom ops are tested in tests/ops/test_compose.py.
"""

import dataclasses

import pytest
import torch

from dora_num.numerics.formulas import scale_constants
from dora_num.ops import reference as ref
from dora_num.ops.config import get_config, override
from dora_num.ops.kernels import compose as kc

from .helpers import CPU, CUDA, DEVICES, INTERPRETED, assert_bitwise, compose_inputs, device_dtype_cases

S = scale_constants(0.37)[0]
SHAPES = [(1, 1), (3, 3), (5, 63), (2, 4097), (2, 3, 1000)]
CUDA_SHAPES = [(3, 63), (257, 4097), (2048, 8192)]  # the GPU also takes tiles full of rows


def _cases(dtypes=("fp32", "fp16", "bf16")):
    """``(device, dtype, shape)``: the small shapes on both devices, the large ones on CUDA."""
    out = []
    for case in device_dtype_cases(dtypes):
        device, dtype = case.values
        for shape in SHAPES + (CUDA_SHAPES if device == "cuda" else []):
            out.append(pytest.param(device, dtype, shape, id=f"{case.id}-{'x'.join(map(str, shape))}",
                                    marks=case.marks))
    return out


def _exact_dg(inner, grad):
    return (inner.double() * grad.double()).reshape(-1, inner.shape[-1]).sum(0)


@pytest.mark.parametrize("device,dtype,shape", _cases())
def test_forward_bitwise(device, dtype, shape):
    base, lora, g, _ = compose_inputs(shape, dtype, device)
    out, inner = kc.compose_fwd(base, lora, g, S, write_inner=True)
    assert_bitwise(out, ref.compose_stable_ref(base, lora, g, S))
    assert_bitwise(inner, ref.compose_inner_ref(base, lora, S))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g_spread", [0.0, 0.3], ids=["g=1", "g-in-[0.5,2]"])
def test_forward_bitwise_g_regimes_fp16_near_overflow(g_spread, device):
    base, lora, g, _ = compose_inputs((4, 257), torch.float16, device, g_spread)
    base = (base.float() * 3e4).clamp(-6e4, 6e4).half()  # near fp16's max 65504
    out, _ = kc.compose_fwd(base, lora, g.clamp(0.5, 2.0), S)
    assert_bitwise(out, ref.compose_stable_ref(base, lora, g.clamp(0.5, 2.0), S))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alias", ["base", "lora"])
def test_forward_in_place(alias, device):
    base, lora, g, _ = compose_inputs((4, 300), torch.float32, device)
    want = ref.compose_stable_ref(base, lora, g, S)
    target = base if alias == "base" else lora
    out, _ = kc.compose_fwd(base, lora, g, S, out=target)
    assert out.data_ptr() == target.data_ptr()
    assert_bitwise(out, want)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_in_place_rejects_non_contiguous(device):
    base, lora, g, _ = compose_inputs((8, 16), torch.float32, device)
    with pytest.raises(ValueError, match="out must be contiguous"):
        kc.compose_fwd(base, lora, g[:8], S, out=torch.empty(16, 8, device=device).T)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs_are_copied(device):
    base, lora, g, _ = compose_inputs((70, 9), torch.float32, device)
    bt, lt = base.T, lora.T  # [9, 70], non-contiguous
    gg = 1.0 + 1e-3 * torch.randn(70, generator=torch.Generator().manual_seed(1)).to(device)
    out, _ = kc.compose_fwd(bt, lt, gg, S)
    assert_bitwise(out, ref.compose_stable_ref(bt, lt, gg, S))


@pytest.mark.parametrize("device,dtype,shape", _cases())
def test_backward_bitwise_and_dg_bound(device, dtype, shape):
    base, lora, g, grad = compose_inputs(shape, dtype, device)
    inner = ref.compose_inner_ref(base, lora, S)
    dl, db, dg = kc.compose_bwd(grad, inner, g, S)
    dl_r, db_r, _ = ref.compose_backward_ref(grad, inner, g, S)
    assert_bitwise(dl, dl_r)
    assert_bitwise(db, db_r)
    err = (dg.double() - _exact_dg(inner, grad)).abs()
    assert bool((err <= kc.dg_error_bound(inner, grad)).all()), f"dg error {float(err.max())} exceeds its bound"
    assert_bitwise(kc.compose_bwd(grad, inner, g, S)[2], dg)  # deterministic: the same bits on a second run


@pytest.mark.parametrize("device,dtype,shape", _cases())
def test_add_base_and_add_grad_are_torchs_adds(device, dtype, shape):
    """The layer's fold: y = base + delta in the forward's pass, and dbase = D + (g-1)*D in the
    backward's, bitwise torch's add of the separately rounded tensors (and in place)."""
    base, lora, g, grad = compose_inputs(shape, dtype, device)
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


@pytest.mark.parametrize("device,dtype", device_dtype_cases())
def test_backward_recompute_inner_is_bitwise_the_same(device, dtype):
    base, lora, g, grad = compose_inputs((9, 777), dtype, device)
    inner = ref.compose_inner_ref(base, lora, S)
    saved = kc.compose_bwd(grad, inner, g, S)
    recomputed = kc.compose_bwd(grad, None, g, S, base=base, lora=lora)
    for a, b in zip(saved, recomputed):
        assert_bitwise(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_partial_outputs(device):
    base, lora, g, grad = compose_inputs((6, 50), torch.float32, device)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (0, 0)], ids=["0x8", "4x0", "0x0"])
def test_empty(shape, device):
    base, lora, grad = (torch.empty(shape, device=device) for _ in range(3))
    g = torch.ones(shape[-1], device=device)
    out, inner = kc.compose_fwd(base, lora, g, S, write_inner=True)
    assert out.shape == shape and inner.shape == shape
    dl, db, dg = kc.compose_bwd(grad, inner, g, S)
    assert dl.shape == shape and dg.shape == (shape[-1],)
    assert bool((dg == 0).all())


# ---- dg: both placements of stage 2 --------------------------------------------------

DG_CASES = [pytest.param("cpu", torch.float32, (rows, 5), id=f"cpu-{rows}x5", marks=CPU.marks)
            for rows in (1, 65, 64 * 64 + 3)]  # 64*64+3 rows: 65 partials, two chunks
DG_CASES += [pytest.param("cuda", torch.bfloat16, shape, id="cuda-" + "x".join(map(str, shape)), marks=CUDA.marks)
             for shape in ((4097, 3), (65536, 384), (8192, 8192))]


@pytest.mark.parametrize("in_kernel", [True, False], ids=["stage2_in_kernel", "stage2_launch"])
@pytest.mark.parametrize("device,dtype,shape", DG_CASES)
def test_dg_two_stage_variants_bound_and_deterministic(device, dtype, shape, in_kernel):
    """Both placements of stage 2 (the arrival-counter one has programs racing to be
    last) stay within the bound and give the same bits on every run."""
    base, lora, g, grad = compose_inputs(shape, dtype, device, seed=5)
    inner = ref.compose_inner_ref(base, lora, S)
    with override(dg_stage2_in_kernel=in_kernel):
        dg = kc.compose_bwd(grad, inner, g, S, need_dlora=False, need_dbase=False)[2]
        assert bool(((dg.double() - _exact_dg(inner, grad)).abs() <= kc.dg_error_bound(inner, grad)).all())
        for _ in range(5):
            assert_bitwise(kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2], dg)


@pytest.mark.skipif(not INTERPRETED, reason="a property of the interpreter's order (tl.sum row by row); "
                                            "on the GPU each tile shape has its own fixed order")
@pytest.mark.parametrize("rows", [1, 65, 64 * 64 + 3], ids=lambda r: f"{r}rows")
def test_dg_stage2_placements_agree_under_the_interpreter(rows):
    """Under the interpreter both placements of stage 2 reduce axis 0 row by row, so they
    give the same bits."""
    base, lora, g, grad = compose_inputs((rows, 5), torch.float32)
    inner = ref.compose_inner_ref(base, lora, S)
    got = {}
    for in_kernel in (True, False):
        with override(dg_stage2_in_kernel=in_kernel):
            got[in_kernel] = kc.compose_bwd(grad, inner, g, S)[2]
    assert_bitwise(got[True], got[False])


def test_the_kernel_tests_run_poisoned():
    """tests/ops/kernels/conftest.py fills every launcher's buffers with NaN first."""
    assert get_config().poison
    assert bool(kc.new_buffer((3,), torch.float32, "cpu", get_config().poison).isnan().all())


@pytest.mark.parametrize("device", DEVICES)
def test_tiles_come_from_the_configuration(device):
    """The launchers take their tiles from ``OpConfig.compose_tiles`` at call time: another
    ``bwd_block_m`` changes the dg tree (partials of 16 rows: the bound grows with it, the
    elementwise outputs do not change), and the forward is bitwise the same for any tile."""
    base, lora, g, grad = compose_inputs((300, 70), torch.float32, device, seed=3)
    inner = ref.compose_inner_ref(base, lora, S)
    want_out = ref.compose_stable_ref(base, lora, g, S)
    want_dl, want_db, _ = ref.compose_backward_ref(grad, inner, g, S)
    tiles = dataclasses.replace(get_config().compose_tiles, fwd_tile_elems=256, fwd_max_block_n=32,
                                bwd_block_m=16, bwd_max_block_n=32, fin_block_n=32, fin_chunk=4)
    with override(compose_tiles=tiles) as cfg:
        assert_bitwise(kc.compose_fwd(base, lora, g, S)[0], want_out)
        dl, db, dg = kc.compose_bwd(grad, inner, g, S)
        bound = kc.dg_error_bound(inner, grad)
    assert_bitwise(dl, want_dl)
    assert_bitwise(db, want_db)
    assert bool(((dg.double() - _exact_dg(inner, grad)).abs() <= bound).all())
    assert_bitwise(kc.compose_bwd(grad, inner, g, S, config=cfg)[2], dg)  # config= is what override sets
    assert not torch.equal(bound, kc.dg_error_bound(inner, grad))  # the bound follows the tiles


# ---- GPU only: PTX, the arrival counters, CUDA graphs ----------------------------------

@pytest.mark.gpu
def test_forward_ptx_has_no_fma():
    from dora_num.ops.kernels.norm_assembly import ptx_instruction_counts

    base, lora, g, _ = compose_inputs((64, 1024), torch.bfloat16, "cuda")
    _, _, k = kc.compose_fwd(base, lora, g, S, return_kernel=True)
    assert ptx_instruction_counts(k)["fma.rn.f32"] == 0
    _, _, k_on = kc.compose_fwd(base, lora, g, S, fp_fusion=True, return_kernel=True)
    assert ptx_instruction_counts(k_on)["fma.rn.f32"] > 0


@pytest.mark.gpu
def test_dg_arrival_counters_are_reused_and_left_zero():
    """The in-kernel stage 2 resets its arrival counters: backward after backward, of
    varying column-block counts and on a second stream, dg stays within its bound and equal
    run to run, and every cached counter reads zero afterwards."""
    shapes = [(257, 4097), (64, 130), (2048, 8192), (3, 63), (257, 4097)]
    side = torch.cuda.Stream()
    first = {}
    for i, shape in enumerate(shapes * 2):
        base, lora, g, grad = compose_inputs(shape, torch.bfloat16, "cuda", seed=i % len(shapes))
        stream = side if i % 3 == 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dg = kc.compose_bwd(grad, None, g, S, base=base, lora=lora)[2]
        torch.cuda.current_stream().wait_stream(stream)
        inner = ref.compose_inner_ref(base, lora, S)
        assert bool(((dg.double() - _exact_dg(inner, grad)).abs() <= kc.dg_error_bound(inner, grad)).all()), shape
        key = (shape, i % len(shapes))
        if key in first:
            assert_bitwise(dg, first[key])
        first[key] = dg
    torch.cuda.synchronize()
    assert kc._COUNTERS and all(int(buf.abs().sum()) == 0 for buf in kc._COUNTERS.values())


@pytest.mark.gpu
def test_dg_counters_under_cuda_graph_capture():
    """Each captured backward owns its zeroed counters: two graphs captured in turn and
    replayed in any order, and eager calls in between, give the eager dg bit for bit."""
    base, lora, g, grad = compose_inputs((2048, 8192), torch.bfloat16, "cuda")
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
