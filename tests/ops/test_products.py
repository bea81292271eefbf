"""``tensor_core_gemms`` names the GEMMs the factored norm runs on tensor cores: the shapes and strides that
reach ``mm`` through the operator's own product functions (its seam), one block past TC_BLOCK_K included."""

import pytest
import torch

from dora_num.numerics.standard_model import TC_BLOCK_K
from dora_num.ops.products import (ProductModel, TensorCoreGemm, _mm32, _u_product, product_model,
                                   split_gram, split_mm, takes_w_whole, tensor_core_gemms)


def _recorder(seen: list):
    def mm(a, b):
        # (M, K, N, row stride of a, row stride of b's transpose): what picks the GEMM kernel
        seen.append((a.shape[0], a.shape[1], b.shape[1], a.stride(0), b.stride(1)))
        return torch.zeros(a.shape[0], b.shape[1])
    return mm


def _as_seen(gemms: list[TensorCoreGemm]) -> set:
    return {(g.M, g.K, g.N, g.lead, g.lead) for g in gemms}


@pytest.mark.parametrize("d_in", [40, TC_BLOCK_K + 24], ids=["one block", "two blocks"])
def test_tensor_core_route(d_in):
    W = torch.zeros(6, d_in, dtype=torch.bfloat16)
    A = torch.zeros(3, d_in, dtype=torch.bfloat16)
    seen = []
    _mm32(W, A.T, _recorder(seen))  # U, as _u_product forms it
    _mm32(A, A.T, _recorder(seen))  # G, as _gram forms it
    gemms = tensor_core_gemms(W, A, ProductModel("tensor_core", None, "bf16"))
    assert set(seen) == _as_seen(gemms) and len(gemms) == len(set(seen))
    blocks = [d_in] if d_in <= TC_BLOCK_K else [TC_BLOCK_K, 24]
    assert gemms == [TensorCoreGemm(p, "bf16", m, 3, k, d_in) for p, m in (("U", 6), ("G", 3)) for k in blocks]


def test_split_route():
    W = torch.zeros(5, 40, dtype=torch.float16)
    A = torch.full((2, 40), 0.1)  # fp32: split into three fp16 pieces
    seen = []
    split_mm(W, A, 3, mm=_recorder(seen))
    split_gram(A, torch.float16, 3, mm=_recorder(seen))
    gemms = tensor_core_gemms(W, A, ProductModel("split", 3, "fp16"))
    assert set(seen) == _as_seen(gemms)
    assert gemms == [TensorCoreGemm("U split", "fp16", 5, 6, 40, 40), TensorCoreGemm("G split", "fp16", 6, 6, 40, 40)]


@pytest.mark.parametrize("route", ["fp32", "fp64"])
def test_other_routes_run_no_tensor_core_gemm(route):
    W, A = torch.zeros(4, 8), torch.zeros(2, 8)
    assert tensor_core_gemms(W, A, ProductModel(route)) == []


def test_routes_that_chunk_w_require_the_column_width():
    """The fp64 route and the fp32 route with a 16-bit W form U over column chunks of W and refuse a missing
    ``cols``; the fp32 route with fp32 W and A takes W whole (as the tensor-core and split routes, whose
    traced body passes None)."""
    W, A = torch.randn(8, 96), torch.randn(3, 96)
    assert torch.equal(_u_product(W, A, None, model=ProductModel("fp32")), W @ A.T)
    with pytest.raises(ValueError, match="cols is required"):
        _u_product(W, A, None, model=ProductModel("fp64"))
    with pytest.raises(ValueError, match="cols is required"):
        _u_product(W.bfloat16(), A, None, model=ProductModel("fp32"))


def test_the_traced_route_test_compiles_for_every_dtype():
    """``takes_w_whole`` runs inside TorchDynamo's trace (a compiled layer asks it before choosing the traced
    denominator): it compiles with ``fullgraph=True`` for 32- and 16-bit W and agrees with the route
    :func:`product_model` chooses (on the CPU: never a tensor-core route).  ``product_model`` itself reads the
    matmul switches, which Dynamo cannot trace: the route test must not (the CUDA case: the GPU test of a
    compiled fp32 W, tests/ops/test_compiled.py)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        W, A = torch.randn(8, 96).to(dtype), torch.randn(3, 96)
        f = torch.compile(lambda W, A: A * 2 if takes_w_whole(W) else A - 1, fullgraph=True)
        whole = product_model(W, A).u in ("tensor_core", "split")
        assert torch.equal(f(W, A), A * 2 if whole else A - 1) and takes_w_whole(W) == whole
