"""The exhaustive compose check: the kernel (under the interpreter) against eager torch, the exact
result and compose_bound, bit for bit; its statistics against the CPU twin; the configurations."""

import math
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest

from dora_num.numerics.formats import FORMATS, round_fraction, round_to
from dora_num.studies import record_exhaustive
from dora_num.studies.bounds import exhaustive as E
from dora_num.studies.bounds import exhaustive_kernels as K
from dora_num.studies.bounds import exhaustive_report as R
from numerics._exact_ref import ordinal_ref, round_ref

RS = E.scale_constants(2 / math.sqrt(7))[0]
CONFIGS = [(1.0, 1.0), (E._f32(1 + 1e-3), RS), (1 - 2.0**-24, 0.5), (E._next32(1 - 2.0**-12, 0.0), RS)]
_rng = np.random.Generator(np.random.PCG64(5))
# tiles of 4096 pairs: random, around base = 1, tiny and huge bases (subnormals, overflow), negative
STARTS = [int(_rng.integers(0, 2**20)) * 4096, 0x3F80 << 16, 0x0001 << 16, 0xFBFF << 16]
# and per format: the largest finite base with the largest lora values (overflow of every variant's intermediates)
STARTS_TOP = {"bf16": 0x7F7F7000, "fp16": 0x7BFF7000}


def _pairs(fmt, start, n):
    f = FORMATS[fmt]
    idx = np.arange(start, start + n, dtype=np.int64)
    with np.errstate(invalid="ignore"):
        vb = (idx >> 16).astype(np.uint16).view(f.np_dtype).astype(np.float64)
        vl = (idx & 0xFFFF).astype(np.uint16).view(f.np_dtype).astype(np.float64)
    return vb, vl, np.isfinite(vb) & np.isfinite(vl)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("g, s", CONFIGS, ids=lambda v: f"{v:.9g}")
def test_kernel_bitwise_eager_exact_and_bound(fmt, g, s):
    """Per pair: the four computed variants equal eager torch, the exact result equals
    compose_exact, and each variant's bound, ulp bound and kappa_c equal compose_bound,
    compose_ulp_bound and compose_condition (bit for bit; a change of a bound fails here until
    the kernel's transcription follows)."""
    keys = [f"{f}/{a}" for f, a in K.VARIANTS] + ["exact", "kappa"] + [
        f"{k}:{f}/{a}" for k in ("bound", "ulp_bound") for f, a in K.VARIANTS]
    saw_inf = np.zeros(8, dtype=bool)
    for start in STARTS + [STARTS_TOP[fmt]]:
        res, out = E.bitwise_check(fmt, g, s, start, 4096, device="cpu", return_bounds=True)
        assert {k: v for k, v in res.items() if k != "n_finite"} == dict.fromkeys(keys, 0), (hex(start), res)
        vb, vl, fin = _pairs(fmt, start, 4096)
        assert res["n_finite"] == fin.sum() > 0
        # the slice exercises what it must: finite and infinite bounds, ulp bounds of 1 and more
        if start == STARTS[0]:
            fin_b = np.isfinite(out[fin, :8])
            assert fin_b.any()
            assert (out[fin, 4:8][fin_b[:, 4:]] == 1).any() and (out[fin, 4:8][fin_b[:, 4:]] > 1).any()
        saw_inf |= np.isinf(out[fin, :8]).any(0)
    # the overflow tests (bound inf) are exercised: at the top of the format the naive inner s*lora + base
    # overflows whatever s (per-op; with fp32 intermediates only from bf16, whose range is fp32's), and the
    # result X = (g-1) base + g s lora overflows the format for s >= 1
    must = [v for v, fa in enumerate(K.VARIANTS) if fa == ("compose_naive", "per_op") or (
        fa == ("compose_naive", "fp32") and fmt == "bf16")]
    assert saw_inf[must].all() and saw_inf[[4 + v for v in must]].all(), saw_inf
    assert saw_inf.all() or s < 1, saw_inf


@pytest.mark.parametrize("fmt, base_bits, g, s", [
    ("bf16", 0x3F81, E._f32(1 + 1e-3), RS),   # base ~ 1: the lora values that cancel (g-1) base are in the row
    ("fp16", 0x7BFF, 1.0, 1.0),              # base = 65504: overflow of the exact result and of the naive inner
])
def test_kernel_statistics_equal_the_cpu_twin(fmt, base_bits, g, s):
    """One full row (every lora for one base): the kernel's reduced statistics (histogram,
    violations, maxima and the worst inputs) equal those of cpu_exhaustive."""
    stats, _ = E.launch(fmt, g, s, start=base_bits << 16, n=1 << 16, device="cpu", tile=4096, iters=4)
    cfg = {"format": fmt, "g_label": "", "g": g, "s_label": "", "s": s}
    got = pd.DataFrame(E.stats_rows(cfg, stats, 1 << 16))
    want = pd.DataFrame(E.cpu_exhaustive(fmt, g, s, base_bits=[base_bits]))
    cols = [c for c in want.columns if c in got.columns]
    pd.testing.assert_frame_equal(got[cols], want[cols], check_dtype=False)


def test_exact_terms_leave_no_double_between():
    """The kernel's claim: H is within no fp64 number of X and sign(rho) = sign(X - H) (checked
    with Fraction on random and on cancelling pairs)."""
    rng = np.random.Generator(np.random.PCG64(1))
    g, s = E._f32(1 + 1e-3), RS
    b = round_to(rng.normal(0, 1, 3000) * 10.0 ** rng.integers(-30, 30, 3000), "bf16")
    lc = round_to(-(g - 1) * b / (g * s) * (1 + rng.normal(0, 1e-2, 3000)), "bf16")  # cancelling
    lr = round_to(rng.normal(0, 1, 3000), "bf16")
    for l_ in (lc, lr):
        H, rho = E.exact_terms(b, l_, g, s)
        for hi, r, bb, ll in zip(H[:1500], rho[:1500], b[:1500], l_[:1500]):
            X = (Fraction(g) - 1) * Fraction(float(bb)) + Fraction(g) * Fraction(s) * Fraction(float(ll))
            assert (X > hi) == (r > 0) and (X < hi) == (r < 0)
            nxt = np.nextafter(hi, np.inf if X > hi else -np.inf)
            assert X == hi or (min(Fraction(hi), Fraction(float(nxt))) <= X <= max(Fraction(hi), Fraction(float(nxt)))
                               and X != Fraction(float(nxt)))
            assert round_fraction(X, "bf16") == round_fraction(X, "bf16")


def test_launch_constants_exact_and_refusals():
    consts, f32s = E.launch_constants("bf16", E._f32(1 + 1e-3), RS)
    g, gm1, ch, cl, s = consts[:5]
    assert Fraction(gm1) == Fraction(g) - 1 and Fraction(ch) + Fraction(cl) == Fraction(g) * Fraction(s)
    assert ch == E._f32(ch) and abs(Fraction(cl)) <= abs(Fraction(ch)) / 2**24
    assert f32s[2] == round_to(np.array([g]), "bf16")[0]
    with pytest.raises(ValueError, match="outside"):
        E.launch_constants("bf16", 3.0, 1.0)
    with pytest.raises(ValueError, match="fp32 values"):
        E.launch_constants("bf16", 1 + 1e-9, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        E.launch("bf16", 1.0, 1.0, start=0, n=1000, device="cpu")


def test_configurations_cover_the_edges():
    cfgs = E.configurations()
    assert len(cfgs) == 2 * len(E.g_values()) * len(E.S_VALUES)
    assert cfgs[0]["g_label"] == "exactly_1" and {c["format"] for c in cfgs[:2]} == {"bf16", "fp16"}
    g = dict(E.g_values())
    for f in ("bf16", "fp16"):  # inside the edge g rounds to 1 in the format, outside it does not
        for side in ("above", "below"):
            inside, outside = g[f"{f}_edge_{side}_inside"], g[f"{f}_edge_{side}_outside"]
            assert round_to(np.array([inside]), f)[0] == 1.0 != round_to(np.array([outside]), f)[0]
        assert round_to(np.array([g[f"{f}_edge_above"]]), f)[0] == 1.0  # the tie rounds to even: 1


def test_fp8_exhaustive_matches_the_record():
    from dora_num.studies.bounds.datasets import COMPOSE_FP8

    (path,) = COMPOSE_FP8.require()
    rec = pd.read_csv(path)
    assert (rec["violations"] == 0).all() and (rec["ulp_bound_violations"] == 0).all(), rec[rec["violations"] > 0]
    stable32 = rec.query("formula == 'compose_stable' and arith == 'fp32'")
    assert (stable32["kappa_le_one_ulp_over_1ulp"] == 0).all()  # lemma 1's 1-ulp claim on every fp8 pair
    fresh = E.fp8_exhaustive(smoke=True)
    key = ["format", "g", "s", "formula", "arith"]
    m = fresh.merge(rec, on=key, suffixes=("", "_rec"))
    assert len(m) == len(fresh)
    for c in ("n_measured", "ulp_0", "ulp_1", "violations", "max_ulp", "overflow_agree", "spurious_nonfinite",
              "bound_inf", "ratio_ge_half", "max_err_over_bound") + K.ULP_NAMES:
        assert (m[c] == m[f"{c}_rec"]).all(), c


@pytest.mark.parametrize("fmt", ["fp6_e3m2", "fp6_e2m3", "fp4_e2m1"])
def test_sub_byte_formats_every_pair_recounted_from_fractions(fmt):
    """cpu_exhaustive over every (base, lora) pair of an OCP MX fp6/fp4 format (64 x 64, 16 x 16) at g
    exactly 1, on both sides of the format's collapse edges and realistic, two scales: each row's
    counts recounted here from exact rationals: the correctly rounded result (the independent
    search), each variant's error |c - X| against its bound decided exactly, its ulp distance from
    the independent ordinals (the computed values c are emulate's, the quantity the row describes)."""
    from dora_num.numerics.bounds import compose_bound, compose_ulp_bound
    from dora_num.numerics.emulate import emulate

    f = FORMATS[fmt]
    bits, vals = E.all_values(fmt)
    assert bits.size == 1 << f.bits and np.isfinite(vals).all()  # no inf, no NaN pattern
    b, l_ = (x.ravel() for x in np.meshgrid(vals, vals, indexing="ij"))
    gs = [(lab, g) for lab, g in E.g_values(("bf16", f.name)) if "bf16" not in lab and "ulp32" not in lab]
    assert {"exactly_1", f"{fmt}_edge_above", f"{fmt}_edge_below"} <= {lab for lab, _ in gs}
    for i, (g_label, g) in enumerate(gs):  # s alternating between 1 (exact products) and an rsLoRA scale
        for s_label, s_raw in [(E.S_VALUES[0], E.S_VALUES[2])[i % 2]]:
            s = E.scale_constants(s_raw)[0]
            rows = E.cpu_exhaustive(fmt, g, s, g_label, s_label)
            X = [(Fraction(g) - 1) * Fraction(x) + Fraction(g) * (Fraction(s) * Fraction(y)) for x, y in zip(b, l_)]
            want = [float(round_ref(fmt, x)) for x in X]
            ordinal = {v: ordinal_ref(fmt, Fraction(v)) for v in set(want) | set(vals.tolist())}  # every value
            gg = np.full(b.shape, g)
            for row in rows:
                inputs = {"base": b, "lora": l_, "g": gg, "s": s}
                c = emulate(row["formula"], inputs, fmt, row["arith"])
                B = compose_bound(row["formula"], b, l_, gg, s, fmt, row["arith"])
                U = compose_ulp_bound(row["formula"], b, l_, gg, s, fmt, row["arith"])
                d = np.array([abs(ordinal[ci] - ordinal[w]) for ci, w in zip(c.tolist(), want)])
                within = [math.isinf(Bi) or abs(Fraction(ci) - x) <= Fraction(Bi) for ci, x, Bi in zip(c, X, B)]
                assert all(within) and row["violations"] == 0, (g_label, s_label, row["formula"], row["arith"])
                assert ((d <= U) | np.isinf(U)).all() and row["ulp_bound_violations"] == 0
                assert (row["n_pairs"], row["n_measured"]) == (b.size, b.size)
                assert (row["max_ulp"], row["ulp_0"], row["ulp_1"]) == (d.max(), (d == 0).sum(), (d == 1).sum())
                assert row["frac_correctly_rounded"] == (d == 0).mean()


def test_recheck_worst_reproduces_the_run():
    rows = pd.DataFrame(E.cpu_exhaustive("bf16", E._f32(1 + 1e-3), RS, base_bits=[0x3F81, 0xC2F7]))
    chk = R.recheck_worst(rows)
    assert len(chk) == 2 * len(rows) and chk["agrees"].all(), chk
    assert (chk["err_over_bound"] <= 1).all()


@pytest.mark.gpu
def test_gpu_kernel_bitwise():
    for fmt in ("bf16", "fp16"):
        for g, s in CONFIGS[:3]:
            res = E.bitwise_check(fmt, g, s, 0x3F80 << 16, 1 << 20, device="cuda")
            assert all(v == 0 for k, v in res.items() if k != "n_finite"), res


def test_report_tables_and_recorded_data(tmp_path):
    """The reading side on the committed fp8 record: the summary and the 1-ulp claim per format x
    formula x arithmetic; a missing GPU record is named with the command that records it; the
    recorded bitwise check is read back, and a mismatch is reported."""
    from dora_num.repro.paths import RecordedDataMissing

    ex = R.load_all(gpu=False)
    assert set(ex["format"]) == {"fp8_e4m3fn", "fp8_e5m2"}
    summ, claim = R.summary(ex), R.one_ulp_claim(ex)
    assert len(summ) == len(claim) == 2 * len(K.VARIANTS)
    assert (summ["violations"] == 0).all() and (summ["ulp_bound_violations"] == 0).all()
    st = claim.query("formula == 'compose_stable' and arith == 'fp32'")
    assert (st["kappa_le_one_ulp_over_1ulp"] == 0).all() and (st["frac_well_conditioned"] > 0.99).all()
    with pytest.raises(RecordedDataMissing, match="dora-num record exhaustive"):
        R.load_gpu(tmp_path)
    chk = pd.DataFrame([{"format": "bf16", "g": 1.0, "s": 1.0, "n_finite": 5, "compose_stable/fp32": 0, "kappa": 0}])
    chk.to_csv(tmp_path / E.BITWISE_FILE, index=False)
    assert R.gpu_bitwise_failures(tmp_path) == []
    chk.assign(kappa=2).to_csv(tmp_path / E.BITWISE_FILE, index=False)
    assert R.gpu_bitwise_failures(tmp_path) == ["bf16 g=1.0 s=1.0: kappa=2"]


def test_gpu_driver_under_the_interpreter(tmp_path):
    """run_gpu's SMOKE plan on the CPU (a 4096-pair slice): the bitwise check comes first and is all
    zero, every planned launch writes its four rows, and the rows read back as the notebooks read them."""
    logs = []
    df = record_exhaustive.compose_gpu(tmp_path, smoke=True, device="cpu", pairs=4096, check_pairs=4096, log=logs.append)
    chk = pd.read_csv(tmp_path / E.BITWISE_FILE)
    assert len(chk) == 4 and R.gpu_bitwise_failures(tmp_path) == [], chk
    assert any("every output bit for bit" in m for m in logs), logs
    rec = R.load_gpu(tmp_path)
    assert len(rec) == len(df) == 4 * 2 * 2 * 2 and set(rec["format"]) == {"bf16", "fp16"}
    assert (rec["n_pairs"] == 4096).all() and (rec["violations"] == 0).all() and (rec["ulp_bound_violations"] == 0).all()
    assert R.summary(rec)["configs"].eq(4).all()
