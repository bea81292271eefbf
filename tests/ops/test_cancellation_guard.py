"""The factored norm's cancellation guard (dora_num.ops.guard; lemma 4', 5' of docs/bounds.md).

- On notebook 03's conditioning sweep (``W = -sBA + tau ||sBA|| N``, ``s = 2/sqrt(7)``, tau down to
  1e-9: kappa up to ~1e16) the guarded factored norm is within the dense fp32 norm's bound
  (lemma 5) on every row, against certified ground truth (``mp_dense_row_norm``); the bare
  factored norm (``on_cancellation="off"``) is not, so the check can fail.  Both tails.
- On the real MiniLM adapter (every row of all 36 modules) and on realistic random adapters
  (``||sBA|| = rho ||W||``, rho up to 0.1, ranks up to 384) the guard never fires: counted,
  both product models.
- The modes: ``"recompute"``, ``"warn"`` (once per layer, naming rows), ``"raise"`` (naming rows
  and kappa), ``"off"``; the layer's late flag (no sync on the fast path) and its rare path.
- The float64 recompute of flagged rows and its bound (lemma 5'), underflowing rows, zero rows.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction as Fr

import numpy as np
import pytest
import torch

import dora_num as dn
from dora_num.numerics.bounds import dense_norm_bound
from dora_num.numerics.formulas import scale_constants
from dora_num.numerics.ground_truth import mp_dense_row_norm
from dora_num.numerics.norm_bounds import lora_row_magnitudes, posterior_constants, posterior_from_terms
from dora_num.ops.config import get_config, override
from dora_num.ops.guard import (CANCELLATION_REL, FLAG_CANCELLATION, FLAG_COUNT, FLAG_NONFINITE, CancellationError,
                                CancellationWarning, decode, dense_rows_fp64)
from dora_num.ops.norm import _factored_core, chunk_columns, factored_terms
from dora_num.ops.weight_norm import magnitude_scale_and_flag
from dora_num.oracles import measure_cpu_allocations, perturbed_adapter
from dora_num.studies.inputs import conditioning_rows as conditioning_inputs

S_RSLORA = 2 / math.sqrt(7)  # notebook 03's COND_SCALE: s^2 inexact in fp32
TAILS = [pytest.param("torch", id="torch-tail"),
         pytest.param("triton", id="triton-tail", marks=pytest.mark.interpreter)]
LAYER_DEVICES = [pytest.param("cpu", t, id=f"cpu-{t}-tail", marks=p.marks) for t, p in (("torch", TAILS[0]),
                                                                                       ("triton", TAILS[1]))]
LAYER_DEVICES.append(pytest.param("cuda", "auto", id="cuda-kernel-tail", marks=pytest.mark.gpu))


def _t(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float32))


def _exact_norms(W, A, B, s) -> np.ndarray:
    """``||W_j + s (BA)_j||`` (``s = fl32(scale)``) rounded to float64 from exact rationals."""
    sf = Fr(scale_constants(s)[0])
    out = []
    for j in range(W.shape[0]):
        q = Fr(0)
        for i in range(W.shape[1]):
            x = Fr(float(W[j, i])) + sf * sum(Fr(float(B[j, k])) * Fr(float(A[k, i])) for k in range(A.shape[0]))
            q += x * x
        out.append(math.sqrt(q.numerator / q.denominator) if q else 0.0)  # float64 of the root: 1e-16 relative
    return np.array(out)


@pytest.mark.parametrize("tail", TAILS)
def test_guarded_norm_within_the_dense_bound_on_the_conditioning_sweep(tail, record):
    rows, d_in, r = 96, 256, 8
    W, A, B, s = conditioning_inputs(rows, d_in, r, seed=0, tau_min=1e-9, scale=S_RSLORA)
    exact = mp_dense_row_norm(W, A, B, s).value
    bound_dense = dense_norm_bound(W, A, B, s)
    with override(norm_tail=tail), warnings.catch_warnings():
        warnings.simplefilter("error", CancellationWarning)  # no row stays unresolved here
        guarded = dn.factored_row_norm(_t(W), _t(A), _t(B), s).double().numpy()
        bare = dn.factored_row_norm(_t(W), _t(A), _t(B), s, on_cancellation="off").double().numpy()
        dense = dn.dense_row_norm(_t(W), _t(A), _t(B), s).double().numpy()
    assert np.isfinite(bound_dense).all()
    err_g, err_b, err_d = (np.abs(x - exact) for x in (guarded, bare, dense))
    assert (err_d <= bound_dense).all()  # the dense norm itself, for reference
    assert (err_g <= bound_dense).all(), f"worst guarded err / dense bound {np.max(err_g / bound_dense):.3g}"
    n_bare = int((err_b > bound_dense).sum())
    assert n_bare > rows // 2  # the bare factored norm breaks the dense bound here: the check can fail
    W64, A64, B64 = (np.asarray(t, dtype=np.float64) for t in (W, A, B))
    kappa = ((W64**2).sum(1) + np.abs(2 * s * (B64 * (W64 @ A64.T)).sum(1)) + s * s * ((B64 @ A64) ** 2).sum(1)) \
        / exact**2  # the condition (float64 terms: for the report only)
    changed = guarded != bare  # rows the guard recomputed (in float64): accurate to the fp32 rounding
    assert changed.any() and bool((err_g[changed] / exact[changed] < 2.0**-20).all())
    fired = int(changed.sum())
    record("guard", case=f"conditioning sweep ({tail} tail)", rows=rows, log10_kappa_max=float(np.log10(kappa.max())),
           ratio_guarded_err_to_dense_bound=float(np.max(err_g / bound_dense)),
           ratio_bare_err_to_dense_bound=float(np.max(err_b / bound_dense)), bare_rows_beyond_dense_bound=n_bare,
           rows_changed_by_the_guard=fired,
           summary=f"conditioning sweep ({tail}): guarded within the dense bound on {rows}/{rows} rows "
                   f"(worst ratio {np.max(err_g / bound_dense):.3g}); bare factored beyond it on {n_bare} rows")


def _fired(W, A, B, s, tensor_core_products: bool) -> tuple[int, float]:
    """Rows the guard flags, and the largest rel, under the given product model (torch tail terms)."""
    base, cross, ba, two_s, s_sq = factored_terms(W, A, B, s)
    C = posterior_constants(two_s, s_sq, d_in=W.shape[1], r=A.shape[0], tensor_core_products=tensor_core_products)
    Af = A.float()
    la, bb = lora_row_magnitudes(B, Af @ Af.T, constants=C)  # G as the CPU tail computes it
    _, rel = posterior_from_terms(base, cross, ba, la, bb, C)
    return int((rel > CANCELLATION_REL).sum()), float(rel.max())


def test_guard_never_fires_on_the_real_trained_minilm_adapter(record):
    """The committed export of a MiniLM DoRA adapter trained on the H200 (r = 16, lr 1e-3, until
    MRR@10 plateaued; notebook 01): the guard fires on no row under either product model."""
    from dora_num.adapters.model import load_base_model
    from dora_num.repro.paths import COMMITTED_DATA_DIR

    model, _ = load_base_model()
    states = dn.load_peft_dora(COMMITTED_DATA_DIR / "adapters" / "trained" / "exported" / "r16_lr0.001", model)
    assert len(states) == 36
    n_rows = fired = 0
    worst = 0.0
    for st in states:
        for tc in (False, True):  # the CPU's and the CUDA tensor-core product models
            f, rel = _fired(st.W, st.A, st.B, st.scale, tc)
            fired += f
            worst = max(worst, rel)
        n_rows += st.W.shape[0]
        # and through the operator (the guarded default): bitwise the bare norm where nothing fires
        assert torch.equal(dn.factored_row_norm(st.W, st.A, st.B, st.scale),
                           dn.factored_row_norm(st.W, st.A, st.B, st.scale, on_cancellation="off"))
    record("guard", case="trained MiniLM r16 lr1e-3 (36 modules)", rows=n_rows, fired=fired, rel_max=worst,
           ratio_rel_max_to_threshold=worst / CANCELLATION_REL,
           summary=f"MiniLM r16: the guard fired on {fired} of {n_rows} rows (x2 product models); "
                   f"largest rel {worst:.3g} vs threshold {CANCELLATION_REL:.3g}")
    assert fired == 0


# (d_out, d_in, r, scale, update ratio rho = ||sBA|| / ||W||): realistic adapters, up to the
# largest update the threshold is set for (docstring of dora_num.ops.guard)
REALISTIC = {
    "384x384-r16-rho0.05": (384, 384, 16, 2.0, 0.05),
    "256x1536-r8-rho0.1": (256, 1536, 8, 2.0, 0.1),
    "128x4096-r64-rsLoRA-rho0.05": (128, 4096, 64, 192 / math.sqrt(64), 0.05),
    "128x4096-r384-rsLoRA-rho0.1": (128, 4096, 384, 192 / math.sqrt(384), 0.1),
    "64x8192-r384-rsLoRA-rho0.05": (64, 8192, 384, 192 / math.sqrt(384), 0.05),
    "32x14336-r64-rho0.05": (32, 14336, 64, 2.0, 0.05),
}


@pytest.mark.parametrize("case", list(REALISTIC))
def test_guard_never_fires_on_realistic_rows(case, record):
    d_out, d_in, r, s, rho = REALISTIC[case]
    gen = torch.Generator().manual_seed(d_in + r)
    W = torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)
    A = (torch.rand(r, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)  # PEFT's kaiming_uniform(a=sqrt(5))
    B, _ = perturbed_adapter(W, A, s, seed=r, update_ratio=rho)
    out = {tc: _fired(W, A, B, s, tc) for tc in (False, True)}
    fired = sum(f for f, _ in out.values())
    worst = max(rel for _, rel in out.values())
    record("guard", case=case, rows=d_out, fired=fired, rel_max=worst, ratio_rel_max_to_threshold=worst / CANCELLATION_REL,
           summary=f"realistic {case}: fired on {fired} of {2 * d_out} rows (2 product models), largest rel {worst:.3g}")
    assert fired == 0
    for dtype in (torch.float32, torch.bfloat16):  # and the operator's own decision (CPU: fp32 model)
        Wd, Ad, Bd = W.to(dtype), A.to(dtype), B.to(dtype)
        g, bad = magnitude_scale_and_flag(Wd, Ad, Bd, s, torch.ones(d_out))
        assert int(bad.max()) == 0


# ---------------------------------------------------------------------------- the modes

def _cancelling(d_out=48, d_in=64, r=4, rows=(2, 7), tau=1e-7, seed=0):
    """Random fp32 W, A, B with the given rows of W set to ``-sBA + tau ||sBA|| N``."""
    gen = torch.Generator().manual_seed(seed)
    s = scale_constants(S_RSLORA)[0]
    W = torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)
    A = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
    B = torch.randn(d_out, r, generator=gen)
    V = s * (B.double() @ A.double())
    N = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64) / math.sqrt(d_in)
    for j in rows:
        W[j] = (-V[j] + tau * V[j].norm() * N[j]).float()
    return W, A, B, S_RSLORA


def test_modes_recompute_warn_raise_off():
    W, A, B, s = _cancelling()
    exact = _exact_norms(W.numpy(), A.numpy(), B.numpy(), s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec = dn.factored_row_norm(W, A, B, s)  # the default: silent, accurate
    # the rows the guard recomputed are the float64 norm rounded once (2^-24, and float64's own error);
    # every other row is the factored value, within its own bound rel (lemma 4', from the same terms)
    d_out, d_in = W.shape
    core = _factored_core(W, A, B, scale_constants(s), chunk_columns(d_out, d_in, None), None, None, get_config())
    flagged = (core.rel > CANCELLATION_REL).numpy()
    assert list(np.flatnonzero(flagged)) == [2, 7]
    err = np.abs(rec.double().numpy() - exact) / exact
    assert float(err[flagged].max()) < 2**-23
    assert torch.equal(rec[~torch.from_numpy(flagged)], core.wnorm[~torch.from_numpy(flagged)])
    assert bool((err[~flagged] <= core.rel.double().numpy()[~flagged] * (1 + 1e-12)).all())
    bare = dn.factored_row_norm(W, A, B, s, on_cancellation="off")
    assert float(np.max(np.abs(bare.double().numpy() - exact) / exact)) > 0.5  # wrong in the leading digit
    with pytest.warns(CancellationWarning, match=r"2 row\(s\) recomputed in float64 \(cancellation .*: 2 \(kappa .*\), 7 \(kappa"):
        warned = dn.factored_row_norm(W, A, B, s, on_cancellation="warn")
    assert torch.equal(warned, rec)
    with pytest.raises(CancellationError, match=r"cannot guarantee 2 row\(s\): cancellation \(.*\): "
                                                r"2 \(kappa [0-9.]+e\+1[0-9], rel inf\), 7 "):
        dn.factored_row_norm(W, A, B, s, on_cancellation="raise")
    with pytest.raises(ValueError, match="on_cancellation must be one of"):
        dn.factored_row_norm(W, A, B, s, on_cancellation="ignore")
    with pytest.raises(ValueError, match="on_cancellation must be one of"):
        dn.DoRALinear(torch.nn.Linear(8, 4), 2, on_cancellation="never")


def _cancelling_layer(on_cancellation, bias=False, rows=(2, 7), device="cpu"):
    W, A, B, s = _cancelling(rows=rows)
    lin = torch.nn.Linear(W.shape[1], W.shape[0], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(W)
    layer = dn.DoRALinear(lin, A.shape[0], on_cancellation=on_cancellation)
    with torch.no_grad():
        layer.lora_A.copy_(A)
        layer.lora_B.copy_(B)
        layer.scale = s  # the sweep's rsLoRA scale
        layer.magnitude.copy_(torch.from_numpy(_exact_norms(W.numpy(), A.numpy(), B.numpy(), s)).float())
    return layer.to(device)


@pytest.mark.parametrize("device,tail", LAYER_DEVICES)
@pytest.mark.parametrize("finite_check", ["deferred", "late", "sync"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_layer_guard_recomputes_before_the_compose(device, tail, finite_check, grad):
    """The layer's g on cancelling rows: the flagged rows are recomputed where the norm is formed
    (in the Triton tail, or on the host after the torch tail), before the compose runs, so the
    forward is the DoRA output of the recomputed norm (m = the exact norm: g = 1 to 2^-23) in every
    finite_check mode, the deferred one included; the flag carries the guard's code and count."""
    layer = _cancelling_layer("recompute", device=device)
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(1)).to(device)
    with override(norm_tail=tail, finite_check=finite_check), warnings.catch_warnings():
        warnings.simplefilter("error")
        g_fast, bad = magnitude_scale_and_flag(layer.base.weight, layer.lora_A, layer.lora_B, layer.scale,
                                               layer.magnitude)
        assert decode(bad) == (FLAG_CANCELLATION, 2)  # the guard's code and count, no non-finite value
        assert float((g_fast.detach()[[2, 7]] - 1).abs().max()) <= 2**-23  # recomputed already (the bare norm: > 0.5)
        with torch.set_grad_enabled(grad):
            y = layer(x)
    g = layer.magnitude_scale().detach().double()
    assert float((g[[2, 7]] - 1).abs().max()) <= 2**-23  # recomputed: m and wnorm both the exact norm, rounded
    assert float((g - 1).abs().max()) <= 2 * CANCELLATION_REL  # every row within the guard's guarantee
    W, A, B = (t.detach().double() for t in (layer.base.weight, layer.lora_A, layer.lora_B))
    x64, s = x.double(), layer.scale
    want = x64 @ W.T + (g - 1) * (x64 @ W.T) + g * s * (x64 @ A.T @ B.T)  # with the layer's own (guarded) g
    # fp32 evaluation of the products and the compose: dot products of d_in and r terms (gamma), 4 roundings
    n = layer.in_features + layer.rank + 4
    tol = n * 2.0**-24 / (1 - n * 2.0**-24) * 2 * (x64.abs() @ W.abs().T + g.abs() * s * (x64.abs() @ A.abs().T @ B.abs().T))
    assert bool(((y.detach().double() - want).abs() <= tol).all())
    if grad:
        y.sum().backward()
        assert torch.isfinite(layer.magnitude.grad).all()


def test_layer_warn_once_and_raise():
    layer = _cancelling_layer("warn")
    x = torch.randn(3, layer.in_features)
    with pytest.warns(CancellationWarning, match=r"DoRALinear\(64->48, r=4\): 2 row\(s\) recomputed"):
        layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)  # once per layer
    strict = _cancelling_layer("raise")
    with pytest.raises(CancellationError, match=r"DoRALinear\(64->48, r=4\): .* 2 row\(s\): cancellation .*: 2 \(kappa"):
        strict(x)
    off = _cancelling_layer("off")
    assert float((off.magnitude_scale().detach() - 1).abs().max()) > 0.5  # the bare norm: wrong g


def test_layer_warns_once_when_the_guard_recomputes_most_rows():
    layer = _cancelling_layer("recompute", rows=tuple(range(48)))
    x = torch.randn(3, layer.in_features)
    with pytest.warns(CancellationWarning, match="recomputes 48 of 48 rows"):
        layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)


def test_zero_rows_are_certified_exact_without_the_recompute():
    """Zero rows of W with zero B rows (padding rows at init): the cached mask of W's zero rows
    certifies them, so the layer's flag stays 0 (no rare path); without the mask (a bare call)
    they are flagged and resolve exactly, silently, also under "raise"."""
    lin = torch.nn.Linear(40, 10, bias=False)
    with torch.no_grad():
        lin.weight[::3] = 0.0
    layer = dn.DoRALinear(lin, 4, on_cancellation="raise")
    _, bad = magnitude_scale_and_flag(lin.weight, layer.lora_A, layer.lora_B, layer.scale, layer.magnitude)
    assert int(bad.max()) == 0
    w = dn.factored_row_norm(lin.weight.detach(), layer.lora_A.detach(), layer.lora_B.detach(), layer.scale,
                             on_cancellation="raise")
    assert torch.equal(w[::3], torch.zeros(4))


# ---------------------------------------------------------------------------- the recompute

def test_dense_rows_fp64_within_its_bound_and_underflow_rows(record):
    """Lemma 5' against exact rationals: cancelling rows (tau down to 1e-9), rows whose fp32 squares
    all underflow (their norm is still normal, or subnormal in fp32: resolved to the fp32 spacing),
    a row whose norm is a few fp32 subnormal steps (reported: no accurate fp32 norm exists), a zero row."""
    W, A, B, s = _cancelling(d_out=10, d_in=48, r=3, rows=(0, 1, 2, 3), tau=1e-9)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        W[4] = torch.randn(48, generator=gen) * 1e-30  # squares 1e-60: all underflow in fp32
        W[5] = torch.randn(48, generator=gen) * 1e-40  # subnormal entries: the norm is subnormal (7e-40)
        W[6] = torch.randint(-3, 4, (48,), generator=gen) * 2.0**-149  # a norm of a few 2^-149
        W[7] = 0.0
        B[4:8] = 0.0
    rows = torch.arange(10)
    w, rel, _ = dense_rows_fp64(W, A, B, scale_constants(s)[0], rows)
    exact = _exact_norms(W.numpy(), A.numpy(), B.numpy(), s)
    worst = 0.0
    for j in range(10):
        err = abs(float(w[j]) - exact[j])
        if exact[j] == 0:
            assert float(w[j]) == 0.0 and float(rel[j]) == 0.0
            continue
        assert err <= float(rel[j]) * exact[j] * (1 + 1e-12), (j, err / exact[j], float(rel[j]))
        worst = max(worst, err / exact[j] / float(rel[j]))
    assert float(rel[:5].max()) < 2**-20  # accurate: cancellation and underflow are gone
    assert float(rel[5]) < CANCELLATION_REL < float(rel[6])  # a subnormal norm: the fp32 spacing 2^-149 decides
    record("guard", case="dense_rows_fp64 (lemma 5')", ratio_err_over_bound=worst)
    # through the operator: the cancelling and underflowing rows are flagged (rel = inf from the terms)
    # and recomputed; row 6 is reported by name
    with pytest.warns(CancellationWarning, match=r"no accurate fp32 norm even in float64 .*rows 6 "):
        out = dn.factored_row_norm(W, A, B, s)
    assert torch.equal(out[:7], w[:7])


def test_recompute_memory_is_o_of_the_flagged_rows(record):
    """Flagged rows are gathered: the guard's extra memory (guarded minus bare, measured allocations)
    does not grow with d_out beyond a few fp32 vectors per row, and is far below a dense [d_out, d_in]."""
    extra = {}
    for d_out in (512, 2048):
        W, A, B, s = _cancelling(d_out=d_out, d_in=1024, r=8, rows=(3, 100, 400))
        guarded = measure_cpu_allocations(lambda: dn.factored_row_norm(W, A, B, s))
        bare = measure_cpu_allocations(lambda: dn.factored_row_norm(W, A, B, s, on_cancellation="off"))
        extra[d_out] = guarded["peak_extra"] - bare["peak_extra"]
        assert guarded["largest_block"] <= d_out * 1024 * 4 // 8  # the factored norm's own chunk budget
    assert extra[2048] - extra[512] <= 16 * 4 * (2048 - 512), extra  # per-row vectors (kappa, rel, magnitudes)
    assert extra[2048] < 2048 * 1024 * 4 // 16, extra
    record("guard", case="recompute memory (3 flagged rows, d_in 1024)", extra_bytes_512=extra[512],
           extra_bytes_2048=extra[2048], dense_bytes_2048=2048 * 1024 * 4)


@pytest.mark.parametrize("tail", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_underflowing_rows_are_recomputed_not_blamed_on_the_adapter(tail):
    """A row of W whose fp32 squares underflow (norm 4e-25, a normal number; B = 0) is flagged by the guard
    (its terms cannot certify it) and recomputed, but it does not cancel: "raise" does not raise for it,
    "warn" names the cause as underflow, and kappa is reported >= 1 by both tails (a reviewer's reproducer)."""
    W = torch.zeros(2, 8)
    W[0] = 1e-25
    W[1] = 1e-40  # subnormal entries: a norm of 2.8e-40, below fp32's normal range
    A, B = torch.zeros(2, 8), torch.zeros(2, 2)
    exact = _exact_norms(W.numpy(), A.numpy(), B.numpy(), 1.0)
    with override(norm_tail=tail), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = dn.factored_row_norm(W, A, B, 1.0, on_cancellation="raise")  # no CancellationError
        dn.factored_row_norm(W, A, B, 1.0, on_cancellation="warn")
    assert abs(float(w[0]) - exact[0]) <= 2**-23 * exact[0]
    text = " ".join(str(c.message) for c in caught)
    assert "fp32 terms near the underflow range (a tiny norm, no cancellation): 0 (kappa 1" in text, text
    assert "cancellation (the update" not in text and "large update" not in text, text
    assert "kappa 0" not in text, text


# ---------------------------------------------------------------------------- what the reports say

def _exactly_formed_rows(d_in=16, c=(1, 3, -2, 5)):
    """Rows where float64 forms ``x = W + s B A`` exactly although W and sBA cancel to 2^-48: W = 1,
    B_j = [1, 2^-24], A_0 = -1 + 2^-24, A_1 = -1 + 2^-24 c_i, so x_i = 2^-48 c_i (every product and
    sum exact in float64; the norm a few 2^-48 against ||W|| = 4)."""
    ci = torch.tensor([c[i % len(c)] for i in range(d_in)], dtype=torch.float64)
    W = torch.ones(2, d_in)
    A = torch.stack([torch.full((d_in,), -1 + 2.0**-24, dtype=torch.float64), -1 + 2.0**-24 * ci]).float()
    B = torch.tensor([[1.0, 2.0**-24], [1.0, 2.0**-24]])
    return W, A, B, 1.0


@pytest.mark.parametrize("tail", TAILS)
def test_exactly_formed_row_is_certified_not_reported(tail):
    """Lemma 5' charges an element only where float64 may round it: a row formed exactly (its norm a
    correctly rounded fp32 value) is certified to fp32's rounding, not reported as "no accurate fp32
    norm even in float64", and "raise" does not raise for it (the host's recompute and the kernel's)."""
    W, A, B, s = _exactly_formed_rows()
    exact = _exact_norms(W.numpy(), A.numpy(), B.numpy(), s)
    w, rel, _ = dense_rows_fp64(W, A, B, s, torch.arange(2))
    assert np.allclose(exact, 2.0**-48 * math.sqrt(4 * (1 + 9 + 4 + 25)), rtol=1e-15)
    assert float(w[0]) == float(np.float32(exact[0]))  # correctly rounded
    assert float(rel.max()) <= 2.0**-23  # the fp32 rounding and float64's sums of squares only
    with override(norm_tail=tail), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no accurate fp32 norm" warning
        out = dn.factored_row_norm(W, A, B, s, on_cancellation="recompute")
    assert torch.equal(out, w)


def test_flagged_rows_are_named_by_their_cause():
    """Three flagged rows, three causes: a row the update cancels (kappa ~1e14), a row of fp32 terms near
    the underflow range (norm 4e-25, B = 0), and a row with an update as large as W at rank 384 and
    d_in 4096 under the tensor-core model (no cancellation: kappa ~1): named as such, never as each other."""
    from dora_num.ops.guard import _report, causes

    assert causes(torch.tensor([1e14, 1.0, 1.1]), torch.tensor([1.0, 4e-25, 1.0]), 4096) == [
        "cancellation", "underflow", "large update"]
    idx, kappa = torch.tensor([3, 5, 9]), torch.tensor([1e14, 1.0, 1.1])
    rel, rel_out, w = torch.full((3,), math.inf), torch.full((3,), 2.0**-24), torch.tensor([1.0, 4e-25, 1.0])
    with pytest.warns(CancellationWarning) as got:
        _report("layer", "warn", True, idx, kappa, rel, rel_out, stacklevel=2, w=w, d_in=4096)
    text = str(got[0].message)
    assert "cancellation (the update cancels the row of W: W ~ -s B A): 3 (kappa 1e+14" in text, text
    assert "fp32 terms near the underflow range (a tiny norm, no cancellation): 5 (kappa 1" in text, text
    assert "a large update (no cancellation" in text and ": 9 (kappa 1.1" in text, text
    with pytest.raises(CancellationError) as err:  # "raise": only the cancelling row is the adapter's doing
        _report("layer", "raise", True, idx, kappa, rel, rel_out, stacklevel=2, w=w, d_in=4096)
    assert "1 row(s): cancellation" in str(err.value) and " 5 (" not in str(err.value) and " 9 (" not in str(err.value)


def test_large_update_rows_are_called_large_updates():
    """rho = ||sBA|| / ||W|| = 1 at r = 384, d_in = 4096: the guarantee passes 2^-6 on every row without
    any cancellation (kappa ~1); the warning calls them large updates, not underflow or cancellation."""
    d_out, d_in, r, s = 16, 4096, 384, 192 / math.sqrt(384)
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)
    A = (torch.rand(r, d_in, generator=gen) * 2 - 1) / math.sqrt(d_in)
    B, _ = perturbed_adapter(W, A, s, seed=2, update_ratio=1.0)
    with pytest.warns(CancellationWarning) as got:
        dn.factored_row_norm(W, A, B, s, on_cancellation="warn")
    text = " ".join(str(w.message) for w in got)
    assert f"{d_out} row(s) recomputed in float64 (a large update (no cancellation" in text, text
    assert "underflow" not in text and "cancels the row" not in text, text


def test_rows_whose_fp32_intermediates_overflow_are_formed_in_float64():
    """s = 2^-100, A = B = 2^60: G = 2^120 and ba = 2^240 overflow fp32 while ||W + sBA|| = 2^20 + 1
    fits; with the guard that norm is returned (exactly: one rounding of an fp32 number), the rows
    beside it untouched; without the guard the error says what overflowed and that the norm fits;
    a norm beyond fp32 is still an error naming its row."""
    s = 2.0**-100
    W = torch.tensor([[1.0, 0.0], [0.5, 0.25]])
    A = torch.tensor([[2.0**60, 0.0]])
    B = torch.tensor([[2.0**60], [0.0]])
    exact = [math.sqrt(Fr(2**20 + 1) ** 2), math.sqrt(Fr(5, 16))]  # row 1: B = 0, the norm of W
    w = dn.factored_row_norm(W, A, B, s)
    assert float(w[0]) == 2.0**20 + 1 == exact[0]
    assert float(w[1]) == float(np.float32(exact[1]))
    with pytest.raises(ValueError, match=r"overflowed on rows \[0\] although their norms fit in float32 "
                                         r"\(formed in float64: up to 1\.04858e\+06\); rescale"):
        dn.factored_row_norm(W, A, B, s, on_cancellation="off")
    with pytest.raises(ValueError, match=r"the row norm of W \+ sBA exceeds 3\.4e38 on rows \[0\]"):
        dn.factored_row_norm(torch.tensor([[3e38, 3e38], [0.5, 0.25]]), A, B, s)


@pytest.mark.parametrize("tail", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_layer_g_on_rows_whose_fp32_intermediates_overflow(tail):
    """The layer's own path (the norm's tail with m: the Triton kernel's in-kernel recompute, or the torch
    tail's host recompute) on the rows of the test above: g = m / (2^20 + 1) exactly, no flag raised, as
    the public factored norm gives."""
    s = 2.0**-100
    W = torch.tensor([[1.0, 0.0], [0.5, 0.25]])
    A = torch.tensor([[2.0**60, 0.0]])
    B = torch.tensor([[2.0**60], [0.0]])
    m = torch.tensor([3.0, 0.5])
    with override(norm_tail=tail):
        g, bad = magnitude_scale_and_flag(W, A, B, s, m)
        want = m / dn.factored_row_norm(W, A, B, s)
        assert torch.equal(g, want) and float(want[0]) == float(np.float32(3.0 / (2**20 + 1)))
        code = decode(bad)[0] if bad.dim() else int(bad) % FLAG_COUNT
        assert code < FLAG_NONFINITE
