"""``DoRALinear``'s fast path: the norm cache, fp32 adapters on a 16-bit W (products through
the split of A, LoRA products as PEFT computes them), and the GPU's split products.

The cache is checked for what it must not change: outputs and gradients bitwise those of the
layer with ``OpConfig.norm_cache="off"``, before and after an optimizer step (whose in-place
updates bump the version counters the cache is keyed on), with gradient checkpointing (whose
recompute is the cache's main use), and a miss after any in-place change of W, A, B or m.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as Fn
from torch.utils.checkpoint import checkpoint

import dora_num as dn
from dora_num.ops.config import override

from .kernels.helpers import assert_bitwise


def _step(layer, x, D):
    y = layer(x)
    y.backward(D)
    grads = [p.grad.clone() for p in (layer.lora_A, layer.lora_B, layer.magnitude)]
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


def test_norm_cache_hits_while_unchanged_and_misses_after_any_in_place_change(small_layer):
    layer = small_layer()
    x = torch.randn(5, 40)
    with override(norm_cache="always"):
        layer(x)
        first = layer.__dict__["_norm_cache"]
        layer(x)
        assert layer.__dict__["_norm_cache"] is first  # a hit: nothing recomputed
        for p in (layer.lora_A, layer.lora_B, layer.magnitude, layer.base.weight):
            with torch.no_grad():
                p.mul_(1.0)  # same values, new version
            layer(x)
            assert layer.__dict__["_norm_cache"] is not first
            first = layer.__dict__["_norm_cache"]
    layer(x)  # the default ("recompute"): an ordinary forward never reuses it
    assert layer.__dict__["_norm_cache"] is not first
    layer.clear_norm_cache()
    assert "_norm_cache" not in layer.__dict__


def test_norm_cache_by_default_is_not_stale_after_a_fused_optimizer_step(small_layer):
    """torch.optim.AdamW(fused=True) (the HF Trainer's default) writes the parameters without
    bumping their version counters: the default cache ("recompute") must still see the step,
    while "always" would keep the stale norm (the reason it is not the default)."""
    for mode, stale in (("recompute", False), ("always", True)):
        layer = small_layer()
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.1)
        opt = torch.optim.AdamW([layer.lora_A, layer.lora_B, layer.magnitude], lr=1e-1, fused=True)
        x = torch.randn(5, 40)
        with override(norm_cache=mode):
            layer(x).square().sum().backward()
            versions = [p._version for p in (layer.lora_A, layer.lora_B)]
            opt.step()
            assert [p._version for p in (layer.lora_A, layer.lora_B)] == versions  # the premise
            with torch.no_grad():
                y = layer(x)
        with override(norm_cache="off"), torch.no_grad():
            want = layer(x)
        assert torch.equal(y, want) != stale, mode


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_norm_cache_is_bitwise_invisible_across_optimizer_steps(checkpointed, small_layer):
    a, b = small_layer(), small_layer()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW([p for p in a.parameters() if p.requires_grad], lr=1e-2)
    opt_b = torch.optim.AdamW([p for p in b.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(6, 40)
    D = torch.randn(6, 24)

    def run(layer):
        if not checkpointed:
            return _step(layer, x, D)
        xr = x.clone().requires_grad_(True)
        y = checkpoint(layer, xr, use_reentrant=False)
        y.backward(D)
        grads = [p.grad.clone() for p in (layer.lora_A, layer.lora_B, layer.magnitude)]
        layer.zero_grad(set_to_none=True)
        return y.detach(), grads

    for _ in range(3):
        ya, ga = run(a)
        with override(norm_cache="off"):
            yb, gb = run(b)
        assert_bitwise(ya, yb)
        for u, v in zip(ga, gb):
            assert_bitwise(u, v)
        for layer, opt, grads in ((a, opt_a, ga), (b, opt_b, gb)):
            for p, gr in zip((layer.lora_A, layer.lora_B, layer.magnitude), grads):
                p.grad = gr
            opt.step()  # in place: bumps the version counters the cache is keyed on
            opt.zero_grad(set_to_none=True)
    assert not torch.equal(a.lora_B, small_layer().lora_B)  # the adapter did move


def test_fp32_adapters_on_a_16_bit_base_follow_peft_autocast_semantics(small_layer):
    """Under bf16 autocast the LoRA products are autocast's (x, A, B cast to bf16), exactly
    as PEFT's lora_B(lora_A(x)); without autocast x is cast to A's dtype (PEFT's
    _cast_input_dtype): fp32 products, the compose and the output add in fp32, rounded once to
    W's dtype (PEFT's result.to(torch_result_dtype))."""
    layer = small_layer(dtype=torch.bfloat16, adapter_dtype=torch.float32)
    assert layer.lora_A.dtype == torch.float32 and layer.base.weight.dtype == torch.bfloat16
    x = torch.randn(7, 40).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        lora_peft = Fn.linear(Fn.linear(x.float(), layer.lora_A), layer.lora_B)  # PEFT: x cast to fp32 first
        base = Fn.linear(x, layer.base.weight)
        g = dn.magnitude_scale(layer.magnitude, layer.weight_norm())
    assert lora_peft.dtype == torch.bfloat16  # autocast re-casts it: bf16 GEMMs
    assert_bitwise(y, base + dn.compose(base, lora_peft, g, layer.scale))
    with torch.no_grad():
        y2 = layer(x)
        lora32 = Fn.linear(Fn.linear(x.float(), layer.lora_A), layer.lora_B)
        base = Fn.linear(x, layer.base.weight)
    assert lora32.dtype == torch.float32
    base32 = base.float()
    assert_bitwise(y2, (base32 + dn.compose(base32, lora32, g, layer.scale)).bfloat16())


def test_fp32_adapter_norm_matches_fp64_on_a_bf16_base(small_layer):
    """The norm of a bf16 W with fp32 A, B uses A and B as given (not rounded to bf16): within
    factored_norm_bound of the exact norm, and far from the norm of the bf16-rounded adapter."""
    from dora_num.numerics.bounds import factored_norm_bound
    from dora_num.oracles import row_norm_ref64, row_norm_ref64_error_bound

    layer = small_layer(96, 32, 8, dtype=torch.bfloat16, adapter_dtype=torch.float32)
    with torch.no_grad():
        layer.lora_B.normal_(0, 1.0)
    W, A, B = layer.base.weight, layer.lora_A, layer.lora_B
    w = layer.weight_norm().double()
    ref = row_norm_ref64(W, A, B, layer.scale)
    tol = torch.from_numpy(factored_norm_bound(W.double().numpy(), A.detach().numpy(), B.detach().numpy(),
                                               layer.scale)) + row_norm_ref64_error_bound(W, A, B, layer.scale)
    assert bool(((w - ref).abs() <= tol).all())
    rounded = row_norm_ref64(W, A.bfloat16(), B.bfloat16(), layer.scale)
    assert float((rounded - ref).abs().max()) > 10 * float(tol.max())


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_split_products_within_bound_and_no_fp32_copy_of_w(w_dtype, regimes):
    """On the H200: U and G of a 16-bit W and an fp32 A (all 24 significand bits random, as
    trained adapters have: then two fp16 pieces do lose a unit, and the bound's residual term is
    exercised) from the split (production path), three pieces and two, each within its own
    split_u_error / split_gram_error of the exact values; the whole norm within
    factored_norm_bound(split_pieces=3); its peak extra memory without any fp32 chunk of W.
    Which split is the more accurate: test_gpu_third_piece_pays_where_the_two_piece_split_dominates."""
    from dora_num.numerics.bounds import factored_norm_bound
    from dora_num.numerics.split_products import split_gram_error, split_u_error
    from dora_num.ops.norm import _products, chunk_columns
    from dora_num.ops.config import get_config
    from dora_num.oracles import row_norm_ref64, row_norm_ref64_error_bound
    from dora_num.studies.bench import peak_extra_bytes

    d_out, d_in, r = 512, 1024, 16
    gen = torch.Generator(device="cuda").manual_seed(11)
    W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).to(w_dtype)
    A = regimes.full_significands(r, d_in, gen)
    B = 0.3 * torch.randn(d_out, r, device="cuda", generator=gen)
    s = 0.5
    fmt = "bf16" if w_dtype == torch.bfloat16 else "fp16"
    W64, A64, B64 = (t.double().cpu().numpy() for t in (W, A, B))
    for pieces in (3, 2):
        with override(split_pieces=pieces):
            U, G = _products(W, A, chunk_columns(d_out, d_in, None), get_config())[:2]
        U64, G64 = W64 @ A64.T, A64 @ A64.T
        eU = np.abs(U.double().cpu().numpy() - U64)
        eG = np.abs(G.double().cpu().numpy() - G64)
        slack = 1e-15 * d_in * (np.abs(W64) @ np.abs(A64).T)
        assert (eU <= split_u_error(W64, A64, pieces, fmt) + slack).all()
        assert (eG <= split_gram_error(A64, pieces, fmt) + 1e-15 * d_in * (np.abs(A64) @ np.abs(A64).T)).all()
    base_sq = dn.base_row_norm_sq(W)
    peak, w = peak_extra_bytes(lambda: dn.factored_row_norm(W, A, B, s, base_sq=base_sq))
    model = 3 * r * d_in * 2 + 3 * r * d_in * 4 + d_out * 3 * r * 4 * 2 + 9 * r * r * 4 * 2 + 16 * d_out * 4
    assert peak <= model, f"peak extra {peak} B above the split's model {model} B"
    assert peak < d_out * 256 * 4  # not even a 256-column fp32 chunk of W
    ref = row_norm_ref64(W, A, B, s).cpu()
    tol = torch.from_numpy(factored_norm_bound(W64, A64, B64, s, split_pieces=3, split_format=fmt))
    tol = tol + row_norm_ref64_error_bound(W.cpu(), A.cpu(), B.cpu(), s)
    assert bool(((w.double().cpu() - ref).abs() <= tol).all())


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_third_piece_pays_where_the_two_piece_split_dominates(w_dtype, regimes):
    """The split's docstring ("Two pieces or three"), on the H200's production products: the error
    of U from p pieces is the split's own, ``W (A - A~_p)^T`` (exact, from the inputs), plus the
    accumulation's, ``U^_p - W A~_p^T`` (measured against the exact product of what the split kept).
    Three pieces are the more accurate where the two-piece split error dominates the accumulation's:
    bf16 (two pieces keep ~17 bits of A; at d_in = 256 the split's median 2.2e-6 against an
    accumulation of at most 2.9e-7 even on the truncating accumulator of the bound, CPU).  Two fp16
    pieces keep A to one fp32 unit: their split error is below the accumulation's, and no order
    between the two is claimed (that one is set by the GEMM's accumulation order)."""
    from dora_num.numerics.split_products import split_residual
    from dora_num.ops.config import get_config
    from dora_num.ops.norm import _products, chunk_columns

    d_out, d_in, r = 512, 256, 16
    gen = torch.Generator(device="cuda").manual_seed(12)
    W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / math.sqrt(d_in)).to(w_dtype)
    A = regimes.full_significands(r, d_in, gen)
    fmt = "bf16" if w_dtype == torch.bfloat16 else "fp16"
    W64, A64 = W.double().cpu().numpy(), A.double().cpu().numpy()
    aU = np.abs(W64 @ A64.T)
    split, acc, err = {}, {}, {}
    for pieces in (3, 2):
        with override(split_pieces=pieces):
            U = _products(W, A, chunk_columns(d_out, d_in, None), get_config()).U
        U = U.double().cpu().numpy()
        _, _, A_kept, _ = split_residual(A64, fmt, pieces)
        split[pieces] = float(np.median(np.abs(W64 @ (A64 - A_kept).T) / aU))
        acc[pieces] = float(np.median(np.abs(U - W64 @ A_kept.T) / aU))
        err[pieces] = float(np.median(np.abs(U - W64 @ A64.T) / aU))
    numbers = f"split {split}, accumulation {acc}, total {err} (median relative errors of U)"
    if fmt == "bf16":
        assert split[3] == 0 and split[2] > 2 * max(acc.values()), numbers  # the condition holds
        assert err[3] < err[2], numbers
    else:
        assert 0 < split[2] < acc[3] / 2, numbers  # the condition fails: nothing to claim


def test_a_cached_non_finite_norm_is_reported_at_every_call(small_layer):
    layer = small_layer()
    x = torch.randn(3, 40)
    with torch.no_grad():
        layer.magnitude[2] = float("inf")
    for _ in range(2):  # the second call hits the cache and is still refused
        with pytest.raises(ValueError, match="m contains non-finite"):
            layer(x)
