"""The convergence statistics on synthetic series whose verdict is known."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dora_num.studies.convergence import equivalence as eq

N_STEPS = 2000


def ar1(rng, n, phi, sigma):
    """AR(1) with stationary standard deviation ``sigma`` (tau_int = (1+phi)/(1-phi))."""
    e = rng.normal(0.0, sigma * math.sqrt(1 - phi * phi), n)
    x = np.empty(n)
    x[0] = rng.normal(0.0, sigma)
    for t in range(1, n):
        x[t] = phi * x[t - 1] + e[t]
    return x


def frame(curves: dict[tuple, np.ndarray]) -> pd.DataFrame:
    rows = []
    for (path, seed, rep), y in curves.items():
        rows.append(pd.DataFrame({"path": path, "seed": seed, "repeat": rep, "step": np.arange(1, y.size + 1),
                                  "loss": y}))
    return pd.concat(rows, ignore_index=True)


def synthetic_runs(rng, *, fused_bias=0.0, fused_noise=1e-4, seeds=(0, 1, 2)):
    """Loss curves: a shared decay + per-seed batch noise (sd 0.05, the seed-to-seed
    spread) + a per-run trajectory wobble; fused = eager of its seed + bias + noise."""
    t = np.arange(1, N_STEPS + 1)
    trend = 0.1 + 2.0 * np.exp(-t / 300)
    out = {}
    for s in seeds:
        eager = trend + rng.normal(0, 0.05, N_STEPS) + ar1(rng, N_STEPS, 0.9, 0.01)
        out[("eager", s, 0)] = eager
        out[("fused", s, 0)] = eager + fused_bias + ar1(rng, N_STEPS, 0.9, fused_noise)
    out[("eager", seeds[0], 1)] = out[("eager", seeds[0], 0)].copy()
    return frame(out)


# -- summaries ---------------------------------------------------------------

def test_delta_summary_known_values():
    s = eq.delta_summary([1.0, 2.0, 3.0, 4.0], [1.0, 2.5, 1.0, 4.25], steps=[10, 20, 30, 40])
    assert s["mean_abs"] == pytest.approx((0 + 0.5 + 2 + 0.25) / 4)
    assert (s["max_abs"], s["step_of_max"], s["bitwise_equal_steps"], s["final_abs"]) == (2.0, 30, 1, 0.25)
    assert s["first_diff_step"] == 20
    assert eq.delta_summary([1.0, 2.0], [1.0, 2.0], steps=[5, 6])["first_diff_step"] == -1


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]], ids=["empty", "nan", "inf"])
def test_series_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="series"):
        eq.delta_summary(bad, bad)


def test_delta_summary_length_mismatch():
    with pytest.raises(ValueError, match="equal length"):
        eq.delta_summary([1.0, 2.0], [1.0])


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.9], ids=["white", "phi0.5", "phi0.9"])
def test_integrated_autocorrelation_time_of_ar1(phi):
    """tau_int of AR(1) is (1+phi)/(1-phi); the estimator's relative standard error
    is about sqrt(2 (2W+1) / n) (Sokal), W <= 5 tau: we allow 4 of those."""
    rng = np.random.default_rng(7)
    n = 50_000
    x = ar1(rng, n, phi, 1.0)
    tau = (1 + phi) / (1 - phi)
    rel_se = math.sqrt(2 * (2 * eq.SOKAL_C * tau + 1) / n)
    assert eq.integrated_autocorr_time(x) == pytest.approx(tau, rel=4 * rel_se)


def test_block_size_grows_with_autocorrelation():
    rng = np.random.default_rng(1)
    white = eq.block_means(rng.normal(size=N_STEPS))
    slow = eq.block_means(ar1(rng, N_STEPS, 0.98, 1.0))
    assert white.size == math.ceil(math.sqrt(N_STEPS))
    assert slow.size >= 2 * slow.tau_int > white.size
    assert white.means.size == N_STEPS // white.size


# -- the tests' size and power -----------------------------------------------

def _tost_rejection_rate(rng, phi, reps, *, naive=False):
    """Fraction of rejections when the true mean sits exactly on the margin (H0 true)."""
    margin, hits = 0.1, 0
    for _ in range(reps):
        d = margin + ar1(rng, N_STEPS, phi, 1.0)
        if naive:  # per-step values treated as independent
            se = d.std(ddof=1) / math.sqrt(d.size)
            p = max(stats.t.cdf((d.mean() - margin) / se, d.size - 1), stats.t.cdf((-d.mean() - margin) / se, d.size - 1))
            hits += p < eq.ALPHA
        else:
            hits += eq.tost(d, margin)["equivalent"]
    return hits / reps


def test_tost_holds_its_level_under_autocorrelation():
    """H0 true (mean = margin), AR(1) phi = 0.9: the block-mean TOST rejects at most
    alpha + 3 binomial standard errors of the Monte Carlo; the naive per-step test
    (autocorrelation ignored) rejects far more often: the correction is needed."""
    reps = 300
    mc_se = math.sqrt(eq.ALPHA * (1 - eq.ALPHA) / reps)
    rate = _tost_rejection_rate(np.random.default_rng(3), 0.9, reps)
    naive = _tost_rejection_rate(np.random.default_rng(3), 0.9, reps, naive=True)
    assert rate <= eq.ALPHA + 3 * mc_se
    assert naive > eq.ALPHA + 3 * mc_se


def test_tost_detects_equivalence_and_bias():
    rng = np.random.default_rng(5)
    assert eq.tost(ar1(rng, N_STEPS, 0.5, 0.01), 0.01)["equivalent"]
    biased = eq.tost(0.02 + ar1(rng, N_STEPS, 0.5, 0.01), 0.01)
    assert not biased["equivalent"] and biased["ci_low"] > 0.01


def test_tost_needs_enough_blocks():
    res = eq.tost(np.zeros(20), 1.0)  # 20 steps -> 4 blocks of 5
    assert not res["equivalent"] and "blocks" in res["reason"]


@pytest.mark.parametrize("margin", [0.0, -1.0, float("inf"), float("nan")])
def test_tost_rejects_bad_margin(margin):
    with pytest.raises(ValueError, match="margin"):
        eq.tost(np.zeros(100), margin)


# -- run frames --------------------------------------------------------------

def test_pairs_and_delta_table():
    df = synthetic_runs(np.random.default_rng(0))
    dt = eq.delta_table(df)
    assert dict(dt.kind.value_counts()) == {"fused_vs_eager": 3, "seed_to_seed": 6, "repeat": 1}
    assert (dt[dt.kind == "repeat"].max_abs == 0).all()
    ss = dt[dt.kind == "seed_to_seed"].mean_abs
    # two independent N(0, 0.05) batch noises: E|x - y| = 2 * 0.05 / sqrt(pi)
    assert ss.mean() == pytest.approx(2 * math.hypot(0.05, 0.01) / math.sqrt(math.pi), rel=0.05)


def test_margin_from_eager_refuses_fused_rows():
    df = synthetic_runs(np.random.default_rng(0))
    with pytest.raises(ValueError, match="eager runs only"):
        eq.margin_from_eager(df)
    m = eq.margin_from_eager(df[df.path == "eager"])
    assert m.pairs == 3 and m.margin == pytest.approx(eq.MARGIN_FRACTION * m.floor)


def test_margin_needs_two_seeds():
    df = synthetic_runs(np.random.default_rng(0), seeds=(0,))
    with pytest.raises(ValueError, match="two seeds"):
        eq.margin_from_eager(df[df.path == "eager"])


def test_misaligned_runs_raise():
    df = synthetic_runs(np.random.default_rng(0))
    df = df[~((df.path == "fused") & (df.seed == 1) & (df.step == 7))]
    with pytest.raises(ValueError, match="same steps"):
        eq.delta_table(df)


# -- the same-batch floor ----------------------------------------------------

def same_batch_runs(rng, *, fused_scale=1.0, replicates=3, seeds=(0, 1, 2)):
    """Per seed: eager (trend + batch noise of that seed), fused and 1-ulp replicates = eager + their own
    trajectory wobble (AR(1), phi 0.9), the fused one ``fused_scale`` times as large as a replicate's."""
    t = np.arange(1, N_STEPS + 1)
    trend = 0.1 + 2.0 * np.exp(-t / 300)
    plain, moved = {}, {}
    for s in seeds:
        eager = trend + rng.normal(0, 0.05, N_STEPS)
        plain[("eager", s, 0)] = eager
        plain[("fused", s, 0)] = eager + fused_scale * ar1(rng, N_STEPS, 0.9, 1e-3)
        for k in range(replicates):
            moved[("eager", s, k)] = eager + ar1(rng, N_STEPS, 0.9, 1e-3)
    return pd.concat([frame(plain).assign(perturbed=False), frame(moved).assign(perturbed=True)],
                     ignore_index=True)


@pytest.mark.parametrize("scale, within", [(1.0, True), (0.5, True), (2.0, False)], ids=["same", "half", "twice"])
def test_ratio_test_on_known_ratios(scale, within):
    rng = np.random.default_rng(5)
    floor = np.mean([np.abs(ar1(rng, N_STEPS, 0.9, 1e-3)) for _ in range(3)], axis=0)
    res = eq.ratio_test(np.abs(scale * ar1(rng, N_STEPS, 0.9, 1e-3)), floor)
    assert res["within"] is within, res
    assert res["ratio"] <= res["ratio_high"]


def test_ratio_test_power_and_size_by_simulation():
    """At a true ratio of 1 + margin the test passes at most ~alpha of the time (its size); at a true ratio
    of 1 at least the reported power_at_1 (within simulation noise)."""
    rng = np.random.default_rng(9)

    def trial(scale):
        u = [ar1(rng, N_STEPS, 0.9, 1e-3) for _ in range(3)]
        floor = np.mean([np.abs(x) for x in u], axis=0)
        return eq.ratio_test(np.abs(scale * ar1(rng, N_STEPS, 0.9, 1e-3)), floor)

    at_margin = [trial(1.0 + eq.FLOOR_MARGIN)["within"] for _ in range(200)]
    assert np.mean(at_margin) <= 2 * eq.ALPHA  # size: 0.05 nominal, 0.1 allows for 200 trials
    at_one = [trial(1.0) for _ in range(100)]
    assert np.mean([r["within"] for r in at_one]) >= np.mean([r["power_at_1"] for r in at_one]) - 0.1


def test_ratio_test_rejects_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        eq.ratio_test(np.ones(10), np.ones(11))
    with pytest.raises(ValueError, match="margin"):
        eq.ratio_test(np.ones(100), np.ones(100), margin=0.0)
    assert eq.ratio_test(np.ones(20), np.ones(20))["reason"].startswith("only")  # too few blocks: no verdict
    flat = eq.ratio_test(np.ones(100), np.zeros(100))  # replicates equal to the baseline: no verdict, no NaN p
    assert not flat["within"] and flat["p"] == 1.0 and "floor is 0" in flat["reason"]


@pytest.mark.parametrize("scale, equivalent", [(1.0, True), (3.0, False)], ids=["like-one-ulp", "three-ulps-worth"])
def test_same_batch_verdict_and_its_controls(scale, equivalent):
    v = eq.same_batch_verdict(same_batch_runs(np.random.default_rng(3), fused_scale=scale))
    t = v["table"]
    assert v["equivalent"] is equivalent and v["seeds"] == [0, 1, 2]
    assert v["controls_as_expected"]  # each replicate agrees with the others; another seed's batches differ
    assert dict(t.role.value_counts()) == {"tested": 3, "control: agree": 9, "control: differ": 3}
    assert (t[t.role == "control: differ"].ratio > 10).all()


def test_same_batch_verdict_needs_replicates():
    df = synthetic_runs(np.random.default_rng(0))
    with pytest.raises(ValueError, match="1-ulp replicates"):
        eq.same_batch_verdict(df)


# -- the early window: what the ratio test can see ----------------------------

def test_saturation_step_on_a_known_ramp():
    """|delta| 0 for steps 1-2, 1 from step 3 on; late level 1. Trailing means over 4 steps: step 4 -> 0.5,
    step 5 -> 0.75, step 6 -> 1, so 90% is first reached at step 6 (and at 75% already at step 5)."""
    x = np.r_[0.0, 0.0, np.ones(98)]
    assert eq.late_level(x) == 1.0
    assert eq.saturation_step(x, window=4, fraction=0.9) == 6
    assert eq.saturation_step(x, window=4, fraction=0.75) == 5
    assert eq.saturation_step(x, np.arange(101, 201), window=4) == 106  # reported on the series' own steps
    assert eq.saturation_step(np.zeros(100)) == -1  # never parts: no level to reach
    assert eq.saturation_step(np.ones(5), window=10) == -1  # shorter than the window


@pytest.mark.parametrize("kw, match", [({"window": 0}, "window"), ({"window": 2.0}, "window"),
                                       ({"fraction": 0.0}, "fraction"), ({"fraction": 1.5}, "fraction")])
def test_saturation_step_rejects_bad_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        eq.saturation_step(np.ones(100), **kw)


def test_early_window_on_known_runs():
    """200 steps. The 1-ulp replicate parts at step 3 by 1 and stays 1 apart; fused parts at step 50 by 1.
    Window 4 at 90%: the floor saturates at step 6, fused at step 53 = the window's end. Before it fused moves
    the loss at 4 of 53 steps, the floor at 51: ratio 4/51; after it both 1 at every step: ratio 1."""
    n = 200
    eager = np.linspace(2.0, 1.0, n)
    step = np.arange(1, n + 1)
    plain = frame({("eager", 0, 0): eager, ("fused", 0, 0): eager + (step >= 50)})
    moved = frame({("eager", 0, 0): eager + (step >= 3)})
    df = pd.concat([plain.assign(perturbed=False), moved.assign(perturbed=True)], ignore_index=True)
    row = eq.early_window(df, window=4, fraction=0.9).iloc[0]
    assert (row.fused_first_diff_step, row.floor_first_diff_step) == (50, 3)
    assert (row.floor_saturation_step, row.fused_saturation_step, row.window_end) == (6, 53, 53)
    assert row.early_share == 53 / n
    assert row.early_ratio == pytest.approx(4 / 51, rel=1e-12) and row.late_ratio == 1.0


def test_early_window_of_a_fused_run_that_never_parts():
    """Fused bitwise equal to eager: no saturation step; the whole run is the window, fused 0 times the floor."""
    n = 50
    eager = np.linspace(2.0, 1.0, n)
    plain = frame({("eager", 0, 0): eager, ("fused", 0, 0): eager.copy()})
    moved = frame({("eager", 0, 0): eager + 0.5})
    df = pd.concat([plain.assign(perturbed=False), moved.assign(perturbed=True)], ignore_index=True)
    row = eq.early_window(df).iloc[0]
    assert (row.fused_first_diff_step, row.fused_saturation_step, row.window_end) == (-1, -1, n)
    assert row.early_ratio == 0.0 and np.isnan(row.late_ratio)


def test_early_window_needs_a_fused_run_beside_replicates():
    with pytest.raises(ValueError, match="fused run"):
        eq.early_window(same_batch_runs(np.random.default_rng(1)).query("path == 'eager'"))


def test_paper_table_is_like_for_like():
    """The paper's seed-to-seed spread keeps the batch order: it stands beside our same-batch floor, and our
    different-batch floor has no paper value."""
    df = same_batch_runs(np.random.default_rng(2))
    tidy = df.melt(id_vars=["path", "seed", "repeat", "step", "perturbed"], value_vars=["loss"], var_name="metric")
    v = eq.same_batch_verdict(tidy)
    tab = eq.paper_comparison(tidy, None, v, {"eager": 0.02, "fused": 0.018}).set_index("quantity")
    assert tab.loc["time per step fused / eager", "ours"] == pytest.approx(0.9)
    ratio = tab.filter(like="the paper's way", axis=0).iloc[0]  # one mean over the midpoint of a range, both sides
    def curve(seed, path, repeat, perturbed):
        return df[(df.seed == seed) & (df.path == path) & (df.repeat == repeat) & (df.perturbed == perturbed)].loss.to_numpy()

    fe = np.mean([np.abs(curve(s, "fused", 0, False) - curve(s, "eager", 0, False)).mean() for s in (0, 1, 2)])
    floor = [np.mean([np.abs(curve(s, "eager", k, True) - curve(s, "eager", 0, False)).mean() for k in range(3)])
             for s in (0, 1, 2)]
    assert ratio.ours == pytest.approx(fe / ((min(floor) + max(floor)) / 2))
    assert ratio.paper == pytest.approx(7.1e-4 / 8.05e-4)
    r = tab.filter(like="the ratio test's R", axis=0).iloc[0]
    assert r.ours == pytest.approx(v["fused_ratio_mean"]) and np.isnan(r.paper)
    assert np.isnan(tab.filter(like="different batches", axis=0).paper).all()


def test_the_signed_mean_tost_calls_different_batches_equivalent():
    """Why the TOST is not the verdict: on two eager seeds (different batches at every step, 100x the
    same-batch floor apart) it still says "equivalent", since the signed mean of d is about 0."""
    df = same_batch_runs(np.random.default_rng(4))
    margin = eq.margin_from_eager(df[df.path == "eager"])
    row = eq.tost_on_other_batches(df, margin)
    assert row["within"] and row["p"] < eq.ALPHA
    sb = eq.same_batch_verdict(df)["table"]
    assert not sb[sb.role == "control: differ"].within.any()  # the same-batch test does tell them apart
