"""Bad input: each case raises a clear exception that names the
argument and the problem (exception type AND message checked), or gives a
documented finite result.

"meta" tensors serve as a cheap second device for device mismatches.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import dora_num as dn

D_OUT, D_IN, R = 8, 70, 4
NAN, INF = float("nan"), float("inf")


def W_(**kw):
    return torch.randn(D_OUT, D_IN, generator=torch.Generator().manual_seed(0), **kw)


def A_(**kw):
    return torch.randn(R, D_IN, generator=torch.Generator().manual_seed(1), **kw)


def B_(**kw):
    return torch.randn(D_OUT, R, generator=torch.Generator().manual_seed(2), **kw)


def act(n=3, d=D_OUT, dtype=torch.float32):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(3)).to(dtype)


def with_value(t, value, index=(0, 0)):
    t = t.clone()
    t[index] = value
    return t


def layer(**kw):
    torch.manual_seed(0)
    return dn.DoRALinear(nn.Linear(D_IN, D_OUT), R, **kw)


# (id, callable, exception type, regex the message must match)
RAISES = [
    # --- shapes -----------------------------------------------------------
    ("norm-W-1d", lambda: dn.dense_row_norm(W_()[0], A_(), B_(), 0.5), ValueError, r"W must be 2-D"),
    ("norm-A-wrong-d_in", lambda: dn.factored_row_norm(W_(), A_()[:, :-1], B_(), 0.5), ValueError,
     r"A has shape \(4, 69\); expected \[r, d_in\] with d_in = 70"),
    ("norm-B-wrong-rank", lambda: dn.factored_row_norm(W_(), A_(), B_()[:, :-1], 0.5), ValueError,
     r"B has shape \(8, 3\); expected \[d_out, r\] = \[8, 4\]"),
    ("norm-rank-0", lambda: dn.factored_row_norm(W_(), A_()[:0], B_()[:, :0], 0.5), ValueError, r"rank r = 0"),
    ("norm-d_in-0", lambda: dn.factored_row_norm(W_()[:, :0], A_()[:, :0], B_(), 0.5), ValueError,
     r"W has shape \(8, 0\): d_in = 0"),
    ("norm-base_sq-wrong-shape", lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, base_sq=torch.ones(D_OUT + 1)),
     ValueError, r"base_sq must be float32 \[d_out\] = \[8\]"),
    ("magnitude-shape-mismatch", lambda: dn.magnitude_scale(torch.ones(D_OUT), torch.ones(D_OUT - 1)), ValueError,
     r"m has shape \(8,\) but wnorm has \(7,\)"),
    ("compose-g-wrong-length", lambda: dn.compose(act(), act(), torch.ones(D_OUT - 1), 0.5), ValueError,
     r"g has 7 entries; expected d_out = 8"),
    ("compose-g-2d", lambda: dn.compose(act(), act(), torch.ones(1, D_OUT), 0.5), ValueError, r"g must be 1-D"),
    ("compose-base-lora-shape", lambda: dn.compose(act(3), act(4), torch.ones(D_OUT), 0.5), ValueError,
     r"base and lora must have one shape"),
    ("compose-0d-base", lambda: dn.compose(torch.tensor(1.0), torch.tensor(1.0), torch.ones(1), 0.5), ValueError,
     r"base must have at least one dimension"),
    ("compose-scale-tensor-not-scalar", lambda: dn.compose(act(), act(), torch.ones(D_OUT), torch.ones(2)),
     ValueError, r"scale must be a scalar"),
    # --- dtypes ----------------------------------------------------------
    ("norm-W-int64", lambda: dn.factored_row_norm(W_().long(), A_(), B_(), 0.5), TypeError,
     r"W has dtype torch.int64; expected one of"),
    ("norm-A-int32", lambda: dn.dense_row_norm(W_(), A_().int(), B_(), 0.5), TypeError, r"A has dtype torch.int32"),
    ("norm-base_sq-fp64", lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, base_sq=torch.ones(D_OUT).double()),
     TypeError, r"base_sq has dtype torch.float64"),
    ("norm-W-not-tensor", lambda: dn.dense_row_norm(W_().tolist(), A_(), B_(), 0.5), TypeError,
     r"W must be a torch.Tensor, got list"),
    ("magnitude-m-bool", lambda: dn.magnitude_scale(torch.ones(D_OUT, dtype=torch.bool), torch.ones(D_OUT)),
     TypeError, r"m has dtype torch.bool"),
    ("magnitude-wnorm-bf16", lambda: dn.magnitude_scale(torch.ones(D_OUT), torch.ones(D_OUT).bfloat16()),
     TypeError, r"wnorm has dtype torch.bfloat16"),
    ("compose-g-bf16", lambda: dn.compose(act(), act(), torch.ones(D_OUT).bfloat16(), 0.5), TypeError,
     r"g has dtype torch.bfloat16; the numerical contract keeps g in float32"),
    ("compose-g-fp16-stable", lambda: dn.compose_stable(act(), act(), torch.ones(D_OUT).half(), 0.5), TypeError,
     r"g has dtype torch.float16"),
    ("compose-base-int", lambda: dn.compose(act().long(), act().long(), torch.ones(D_OUT), 0.5), TypeError,
     r"base has dtype torch.int64"),
    ("compose-base-lora-dtype", lambda: dn.compose(act(), act(dtype=torch.bfloat16), torch.ones(D_OUT), 0.5),
     TypeError, r"base and lora must have one dtype"),
    ("compose-scale-bool", lambda: dn.compose(act(), act(), torch.ones(D_OUT), True), TypeError,
     r"scale must be a real number, got bool"),
    # --- devices ---------------------------------------------------------
    ("norm-W-on-meta", lambda: dn.dense_row_norm(W_().to("meta"), A_(), B_(), 0.5), ValueError,
     r"tensors must be on one device: W on meta, A on cpu, B on cpu"),
    ("norm-B-on-meta", lambda: dn.factored_row_norm(W_(), A_(), B_().to("meta"), 0.5), ValueError,
     r"B on meta"),
    ("magnitude-device", lambda: dn.magnitude_scale(torch.ones(D_OUT), torch.ones(D_OUT, device="meta")), ValueError,
     r"m is on cpu but wnorm on meta"),
    ("compose-g-on-meta", lambda: dn.compose(act(), act(), torch.ones(D_OUT, device="meta"), 0.5), ValueError,
     r"g on meta"),
    # --- NaN / Inf -------------------------------------------------------
    ("norm-W-nan", lambda: dn.factored_row_norm(with_value(W_(), NAN), A_(), B_(), 0.5), ValueError,
     r"W contains non-finite values \(1 NaN, 0 Inf\)"),
    ("norm-A-inf", lambda: dn.factored_row_norm(W_(), with_value(A_(), INF), B_(), 0.5), ValueError,
     r"A contains non-finite values \(0 NaN, 1 Inf\)"),
    ("norm-B-neg-inf-dense", lambda: dn.dense_row_norm(W_(), A_(), with_value(B_(), -INF), 0.5), ValueError,
     r"B contains non-finite values"),
    ("norm-base_sq-nan", lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, base_sq=torch.full((D_OUT,), NAN)),
     ValueError, r"base_sq has 8 entries that are NaN or negative \(rows \[0, 1, 2, 3, 4, 5, 6, 7\]\)"),
    ("norm-base_sq-negative", lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, base_sq=with_value(
        dn.base_row_norm_sq(W_()), -1.0, 2), on_cancellation="off"), ValueError,
     r"base_sq has 1 entries that are NaN or negative \(rows \[2\]\): not a sum of squares"),
    ("norm-base_sq-neg-inf", lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, base_sq=with_value(
        dn.base_row_norm_sq(W_()), -INF, 1)), ValueError, r"base_sq has 1 entries that are NaN or negative"),
    ("norm-overflow", lambda: dn.factored_row_norm(torch.full((2, D_IN), 3e38), A_(), B_()[:2], 0.5), ValueError,
     r"overflowed float32 \(inputs are finite\): the row norm of W \+ sBA exceeds 3.4e38 on rows \[0, 1\]"),
    ("magnitude-m-nan", lambda: dn.magnitude_scale(with_value(torch.ones(D_OUT), NAN, 0), torch.ones(D_OUT)),
     ValueError, r"m contains non-finite"),
    ("compose-g-inf", lambda: dn.compose(act(), act(), with_value(torch.ones(D_OUT), INF, 0), 0.5), ValueError,
     r"g contains non-finite"),
    ("compose-stable-lora-nan", lambda: dn.compose_stable(act(), with_value(act(), NAN), torch.ones(D_OUT), 0.5),
     ValueError, r"lora contains non-finite"),
    ("compose-naive-base-inf", lambda: dn.compose_naive(with_value(act(), INF), act(), torch.ones(D_OUT), 0.5),
     ValueError, r"base contains non-finite"),
    # --- scale -----------------------------------------------------------
    ("norm-scale-nan", lambda: dn.factored_row_norm(W_(), A_(), B_(), NAN), ValueError, r"scale must be finite, got nan"),
    ("norm-scale-inf", lambda: dn.dense_row_norm(W_(), A_(), B_(), INF), ValueError, r"scale must be finite, got inf"),
    ("compose-scale-neg-inf", lambda: dn.compose(act(), act(), torch.ones(D_OUT), -INF), ValueError,
     r"scale must be finite"),
    ("compose-scale-nan-tensor", lambda: dn.compose(act(), act(), torch.ones(D_OUT), torch.tensor(NAN)), ValueError,
     r"scale must be finite"),
    # --- chunk budget, eps, path -------------------------------------------
    ("chunk-bytes-zero", lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, chunk_bytes=0), ValueError,
     r"chunk_bytes must be positive, got 0"),
    ("chunk-bytes-negative", lambda: dn.base_row_norm_sq(W_(), chunk_bytes=-1), ValueError,
     r"chunk_bytes must be positive, got -1"),
    ("chunk-bytes-below-one-64-col-chunk",
     lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, chunk_bytes=64 * 8 * D_OUT - 1), ValueError,
     r"chunk_bytes=\d+ is smaller than one 64-column"),
    ("chunk-bytes-float", lambda: dn.factored_row_norm(W_(), A_(), B_(), 0.5, chunk_bytes=1e9), TypeError,
     r"chunk_bytes must be an int"),
    ("magnitude-eps-zero", lambda: dn.magnitude_scale(torch.ones(D_OUT), torch.ones(D_OUT), eps=0.0), ValueError,
     r"eps must be positive"),
    ("compose-path-unknown", lambda: dn.compose(act(), act(), torch.ones(D_OUT), 0.5, path="cuda"), ValueError,
     r"path must be one of"),
    # --- DoRALinear construction ---------------------------------------------
    ("layer-base-not-linear", lambda: dn.DoRALinear(nn.Conv1d(3, 3, 1), 2), TypeError,
     r"base must be an nn.Linear, got Conv1d"),
    ("layer-rank-0", lambda: dn.DoRALinear(nn.Linear(3, 3), 0), ValueError, r"rank must be a positive int, got 0"),
    ("layer-rank-bool", lambda: dn.DoRALinear(nn.Linear(3, 3), True), ValueError, r"rank must be a positive int"),
    ("layer-alpha-inf", lambda: dn.DoRALinear(nn.Linear(3, 3), 2, INF), ValueError, r"alpha must be finite"),
    ("layer-compose-path", lambda: dn.DoRALinear(nn.Linear(3, 3), 2, compose_path="gpu"), ValueError,
     r"compose_path must be one of"),
    ("layer-chunk-bytes-zero", lambda: dn.DoRALinear(nn.Linear(3, 3), 2, chunk_bytes=0), ValueError,
     r"chunk_bytes must be positive"),
    ("layer-nan-in-lora_B", lambda: _layer_with_nan_B()(torch.randn(2, D_IN)), ValueError,
     r"B contains non-finite"),
]


def _layer_with_nan_B():
    lay = layer()
    with torch.no_grad():
        lay.lora_B[0, 0] = NAN
    return lay


@pytest.mark.parametrize("fn, exc, match", [c[1:] for c in RAISES], ids=[c[0] for c in RAISES])
def test_bad_input_raises(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_at_least_20_cases():
    assert len(RAISES) + len(FINITE) >= 20
    assert len({c[0] for c in RAISES}) == len(RAISES), "duplicate case ids"


# --------------------------------------------------------------------------
# Inputs to DoRALinear.forward: the layer names ``x`` (not torch's matmul error).
# --------------------------------------------------------------------------

LAYER_X = [
    ("layer-x-wrong-features", lambda: layer()(torch.randn(2, D_IN + 1)), r"\bx\b.*(70|in_features)"),
    ("layer-x-int", lambda: layer()(torch.ones(2, D_IN, dtype=torch.int64)), r"\bx\b.*dtype"),
    ("layer-x-dtype-mismatch", lambda: layer()(torch.randn(2, D_IN, dtype=torch.float64)), r"\bx\b.*dtype"),
]


@pytest.mark.parametrize("fn, match", [c[1:] for c in LAYER_X], ids=[c[0] for c in LAYER_X])
def test_layer_input_named(fn, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fn()


# --------------------------------------------------------------------------
# Documented finite results
# --------------------------------------------------------------------------

def _zero_rows_layer():
    """W with all-zero rows (PEFT divides 0/0 there). dora_num: the factored norm
    gives wnorm = 0 exactly, m is initialised to eps (the denominator of g there), and
    g = eps/eps = 1: the layer output is finite (= bias) and equals the base layer's."""
    torch.manual_seed(0)
    lin = nn.Linear(D_IN, D_OUT)
    with torch.no_grad():
        lin.weight[::2] = 0.0
    lay = dn.DoRALinear.from_linear(lin, R)
    x = torch.randn(5, D_IN, requires_grad=True)
    y = lay(x)
    y.sum().backward()
    zero = slice(None, None, 2)
    assert torch.equal(lay.weight_norm()[zero], torch.zeros(D_OUT // 2))
    assert torch.equal(lay.magnitude.detach()[zero], torch.full((D_OUT // 2,), 1e-12))
    assert torch.equal(lay.magnitude_scale().detach()[zero], torch.ones(D_OUT // 2))
    assert torch.equal(y.detach()[:, zero], lin.bias.detach()[zero].expand(5, -1))
    for t in (y, x.grad, lay.lora_A.grad, lay.lora_B.grad, lay.magnitude.grad):
        assert torch.isfinite(t).all()


def _zero_wnorm_scale():
    """magnitude_scale(m, 0) = m / eps with the dtype-aware eps: finite."""
    g32 = dn.magnitude_scale(torch.full((3,), 2.0), torch.zeros(3))
    assert torch.equal(g32, torch.full((3,), 2.0) / 1e-12)
    g16 = dn.magnitude_scale(torch.full((3,), 2.0).bfloat16(), torch.zeros(3))
    assert g16.dtype == torch.float32 and torch.isfinite(g16).all()
    assert float(g16[0]) == pytest.approx(2.0 / 1e-6, rel=2**-24)


def _empty_tokens_layer():
    """0 tokens: empty output of the right shape; backward runs and gives zero grads."""
    lay = layer()
    x = torch.randn(0, D_IN, requires_grad=True)
    y = lay(x)
    assert y.shape == (0, D_OUT) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.shape == (0, D_IN)
    for p in (lay.lora_A, lay.lora_B, lay.magnitude):
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))


def _empty_tokens_compose():
    """compose / compose_stable on 0 tokens return [0, d_out]; backward gives dg = 0."""
    g = torch.ones(D_OUT, requires_grad=True)
    base = torch.randn(2, 0, D_OUT, requires_grad=True)
    out = dn.compose(base, torch.randn(2, 0, D_OUT), g, 0.5)
    assert out.shape == (2, 0, D_OUT)
    out.sum().backward()
    assert torch.equal(g.grad, torch.zeros(D_OUT))
    assert dn.compose_stable(torch.randn(0, D_OUT), torch.randn(0, D_OUT), torch.ones(D_OUT), 0.5).shape == (0, D_OUT)


def _empty_rows_norm():
    """d_out = 0: the norms of no rows, an empty fp32 vector."""
    out = dn.factored_row_norm(torch.randn(0, D_IN), A_(), torch.randn(0, R), 0.5)
    assert out.shape == (0,) and out.dtype == torch.float32


def _nan_activations_propagate():
    """compose (the fast, autograd path) does not scan activations: NaN propagates as in
    any torch layer, to the affected rows only; compose_stable rejects it (table above)."""
    base = with_value(act(), NAN, (1, 2))
    out = dn.compose(base, act(), torch.full((D_OUT,), 1.001), 0.5)
    assert torch.isnan(out[1, 2]) and torch.isfinite(out[0]).all()


def _scale_zero():
    """scale = 0: the adapter contributes nothing; g = m / ||W||."""
    W, A, B = W_(), A_(), B_()
    ref = torch.linalg.vector_norm(W.double(), dim=1)
    out = dn.factored_row_norm(W, A, B, 0.0)
    assert ((out.double() - ref).abs() <= (D_IN + 3) * 2**-24 * ref).all()


FINITE = [
    ("zero-rows-of-W-finite-g", _zero_rows_layer),
    ("zero-wnorm-eps-guard", _zero_wnorm_scale),
    ("empty-tokens-layer-fwd-bwd", _empty_tokens_layer),
    ("empty-tokens-compose-fwd-bwd", _empty_tokens_compose),
    ("empty-d_out-norm", _empty_rows_norm),
    ("nan-activations-propagate", _nan_activations_propagate),
    ("scale-zero", _scale_zero),
]


@pytest.mark.parametrize("fn", [c[1] for c in FINITE], ids=[c[0] for c in FINITE])
def test_documented_result(fn):
    fn()
