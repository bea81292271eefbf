"""Collapse with seeds: the compact capture record, the seeds plan, and the statistics of studies/cancellation/seeds.py
checked on synthetic data with known truth (interval coverage, recovered exponents)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dora_num.numerics.collapse import collapse_stats
from dora_num.studies.cancellation import record_trained as G
from dora_num.studies.cancellation import record_trained_launch as L
from dora_num.studies.cancellation import runs as P
from dora_num.studies.cancellation import seed_stats as T
from dora_num.studies.cancellation import seeds as S

MODULES = [f"encoder.layer.{i}.attention.self.query" for i in range(3)] + ["encoder.layer.0.intermediate.dense"]


# --------------------------------------------------------------------------
# The compact record
# --------------------------------------------------------------------------

def test_capture_stats_counts_and_summaries_match_the_definitions():
    """Counts against collapse_stats' fractions x n; terciles of ||W_j|| hold a third of the rows each; the
    summaries from their formulas."""
    rng = np.random.default_rng(3)
    gm1 = {n: rng.normal(0, 3e-3, 63) * (rng.random(63) < 0.7) for n in MODULES}  # exact g = 1 in ~30% of rows
    w = {n: rng.lognormal(0, 0.3, 63) for n in MODULES}
    t = T.capture_stats(gm1, w)
    assert len(t) == len(MODULES) * (T.WBINS + 1)
    for n in MODULES:
        whole = t[(t.module == n) & (t.wbin == T.ALL_ROWS)].iloc[0]
        bins = t[(t.module == n) & (t.wbin >= 0)]
        assert bins["rows"].tolist() == [21, 21, 21]
        for f in ("bf16", "fp16", "fp8_e4m3fn"):
            st = collapse_stats(1.0 + gm1[n], f)
            assert whole[T.count_column("one", f)] == round(st["frac_rounds_to_one"] * 63)
            assert whole[T.count_column("sym", f)] == round(st["frac_symmetric_zone"] * 63)
            assert bins[T.count_column("one", f)].isna().all()  # counts per module only: the unit resampled
        assert whole["gm1_rms"] == pytest.approx(math.sqrt(sum(x * x for x in gm1[n]) / 63), rel=1e-12)
        assert whole["abs_median"] == sorted(abs(gm1[n]))[31]
        lo_bin = bins[bins.wbin == 0].iloc[0]
        assert lo_bin["w_median"] == np.sort(w[n])[10]  # the smallest third's middle value


def test_capture_stats_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="3 values of g - 1 but 4 row norms"):
        T.capture_stats({MODULES[0]: np.zeros(3)}, {MODULES[0]: np.ones(4)})


def test_seeds_plan_and_its_command_line():
    plan = P.seeds_plan([1, 2])
    assert len(plan) == 22 and {s.seed for s in plan} == {1, 2} and not any(s.export for s in plan)
    assert {s.role for s in plan} == {"grid"} and "r384_lr0.0001_rslora_s2" in {s.name for s in plan}
    with pytest.raises(ValueError, match="seed 0 is the full plan"):
        P.seeds_plan([0])
    cfg = G.plan_and_config("seeds", "cpu", [1])[1]
    assert cfg.capture_best and cfg.compact and cfg.train_config(plan[0]).seed == 1
    cmd = L.run_command(plan[-1], "seeds", cfg, "W", deadline_at=1.0, python="py")
    a = G.build_parser().parse_args(cmd[5:])
    assert (a.plan, a.seeds, a.smoke, a.run) == ("seeds", [2], False, plan[-1].name)
    (spec,) = P.select(G.plan_and_config(G.plan_name(a), "cpu", a.seeds)[0], [a.run])
    assert spec == plan[-1]


def test_seed_launch_wall_prediction():
    """From the recorded launch: one seed per device call fits the 540 s launch (the slowest recorded
    configuration, r=384 lr 1e-4, 316 s, plus its best captures); two seeds in one call do not."""
    one, two = L.predict_seeds_wall(P.seeds_plan([1]), 540), L.predict_seeds_wall(P.seeds_plan([1, 2]), 540)
    assert one["fits"] and 316 < one["slowest_run_s"] < 400
    assert not two["fits"] and two["gpu_share_factor"] == pytest.approx(22 / 13)


def test_compact_steps_keep_fixed_best_and_last():
    assert G.compact_steps([0, 10, 100, 200, 300, 400, 450], (0, 10, 100, 300), 400, 450) == [10, 100, 300, 400, 450]
    assert G.compact_steps([0, 10, 20], (0, 10), 0, 20) == [0, 10, 20]  # a run that never beat the base model


# --------------------------------------------------------------------------
# Learning-rate integral
# --------------------------------------------------------------------------

def test_cumulative_lr_is_the_trainer_s_schedule():
    """Against torch's LambdaLR with the trainer's factor, stepped and summed."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 20))
    total, got = 0.0, {}
    for t in range(1, 61):
        total += opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        got[t] = total
    for t in (1, 7, 20, 21, 60):
        assert S.cumulative_lr(3e-4, t, 20) == pytest.approx(got[t], rel=1e-12)


def test_cumulative_lr_cosine_is_transformers_schedule():
    import torch
    from transformers import get_cosine_schedule_with_warmup

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-5)
    sched = get_cosine_schedule_with_warmup(opt, 200, 2000)
    total = 0.0
    for _ in range(2000):
        total += opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    assert S.cumulative_lr_cosine(1e-5, 2000, 0.1) == pytest.approx(total, rel=1e-12)


# --------------------------------------------------------------------------
# Intervals: coverage on synthetic data with a known fraction
# --------------------------------------------------------------------------

REPS = 200
ROWS = 384


def _coverage(draw, truth, interval, reps=REPS, seed=0):
    rng = np.random.default_rng(seed)
    hit = 0
    for i in range(reps):
        k, n = draw(rng)
        lo, hi = interval(k, n, i)
        hit += lo <= truth <= hi
    return hit / reps


def _wilson_rows(k, n, _):  # rows as independent trials: the interval that ignores modules
    from scipy.stats import binomtest

    ci = binomtest(int(k.sum()), int(n.sum())).proportion_ci(0.95, method="wilson")
    return ci.low, ci.high


def _boot(k, n, i):
    b = S.bootstrap_fraction(k, n, n_resamples=999, rng=i)
    return b["lo"], b["hi"]


def test_module_bootstrap_covers_the_fraction_and_the_row_interval_does_not():
    """One seed, 36 modules whose fractions vary (Beta(2, 3): the population fraction 0.4): the modules
    bootstrap covers 0.4 at about 95 % (binomial sd of 200 draws: 1.5 %); the row-level interval, blind to the
    module spread, covers it far less (the harness can fail an interval)."""
    def draw(rng):
        p = rng.beta(2, 3, 36)
        n = np.full((1, 36), ROWS)
        return rng.binomial(ROWS, p)[None, :], n

    assert 0.90 <= _coverage(draw, 0.4, _boot) <= 0.99
    assert _coverage(draw, 0.4, _wilson_rows) < 0.5


def _crossed_truth(mu, sa, sb):
    """E[expit(mu + a + b)], a ~ N(0, sa^2), b ~ N(0, sb^2): Gauss-Hermite quadrature (exact to ~1e-12 here)."""
    x, w = np.polynomial.hermite_e.hermegauss(80)
    z = mu + sa * x[:, None] + sb * x[None, :]
    return float((w[:, None] * w[None, :] / (2 * np.pi) / (1 + np.exp(-z))).sum())


def test_seeds_by_modules_bootstrap_covers_a_crossed_fraction():
    """8 seeds x 36 modules, logit p = mu + a_seed + b_module: the pigeonhole bootstrap covers the population
    fraction at about nominal (measured 0.945); one seed of the same design, whose interval can only resample
    modules, misses the seed spread (measured 0.615): why a one-seed interval is flagged."""
    mu, sa, sb = -0.4, 0.3, 0.8
    truth = _crossed_truth(mu, sa, sb)

    def draw(seeds):
        def f(rng):
            z = mu + sa * rng.normal(size=(seeds, 1)) + sb * rng.normal(size=(1, 36))
            return rng.binomial(ROWS, 1 / (1 + np.exp(-z))), np.full((seeds, 36), ROWS)
        return f

    assert 0.90 <= _coverage(draw(8), truth, _boot) <= 0.99
    assert _coverage(draw(1), truth, _boot) < 0.8


def test_bootstrap_refuses_bad_counts():
    with pytest.raises(ValueError, match="0 <= k <= n"):
        S.bootstrap_fraction(np.array([[5, 1]]), np.array([[4, 4]]))


# --------------------------------------------------------------------------
# Scaling model: known exponents recovered; held-out errors; the paper's prediction
# --------------------------------------------------------------------------

TRUE = {"intercept": 0.7, "log_L": 0.8, "log_t": 0.15, "log_w": -1.0, "log_r": 0.05}


def _synthetic_stats(rng, noise=0.05):
    """A seeds-record-shaped table whose per-tercile RMS follows TRUE exactly up to log-normal noise."""
    rows = []
    for lr in (1e-4, 1e-3):
        for r in (8, 64, 384):
            for seed in (0, 1, 2):
                run = f"r{r}_lr{lr:g}_s{seed}"
                for step in (10, 30, 100, 300, 1000):
                    Lv = float(S.cumulative_lr(lr, step, 200))
                    for j, mod in enumerate(MODULES):
                        for b in range(T.WBINS):
                            w = 0.5 * (1 + j) * (1 + 0.3 * b)
                            y = (TRUE["intercept"] + TRUE["log_L"] * math.log(Lv) + TRUE["log_t"] * math.log(step)
                                 + TRUE["log_w"] * math.log(w) + TRUE["log_r"] * math.log(r) + noise * rng.normal())
                            rows.append({"run": run, "config": run[:-3], "seed": seed, "rank": r, "lr": lr,
                                         "variant": "standard", "warmup_steps": 200, "step": step, "best": False,
                                         "final": step == 1000, "module": mod, "wbin": b, "rows": 128,
                                         "gm1_rms": math.exp(y), "w_median": w})
    return pd.DataFrame(rows)


def test_fit_recovers_known_exponents_and_held_out_error_is_the_noise():
    d = S.design(_synthetic_stats(np.random.default_rng(7)))
    fit = S.fit_scaling(d)
    for k, v in TRUE.items():
        assert abs(fit.coef[k] - v) < 4 * fit.se[k], (k, fit.coef[k], v, fit.se[k])
    assert fit.resid_sd == pytest.approx(0.05, rel=0.1)
    e = S.held_out_summary(S.held_out(d, "lr"))
    # pooled over 4 modules x 3 terciles, the noise averages down below its per-row 0.05
    assert e["rmse_log"] < 0.05 and abs(e["bias_log"]) < 0.03


def test_fit_without_a_true_feature_fails_out_of_sample():
    """Leave out log_w (true slope -1): the held-out error is no longer the noise (the check can fail)."""
    d = S.design(_synthetic_stats(np.random.default_rng(7)))
    assert S.held_out_summary(S.held_out(d, "lr", features=("log_L", "log_t", "log_r")))["rmse_log"] > 0.2


def test_paper_prediction_is_the_model_at_the_paper_s_setting():
    d = S.design(_synthetic_stats(np.random.default_rng(7)))
    fit, err = S.fit_scaling(d), S.held_out(d, "lr")
    out = S.predict_paper(fit, err, w_range=(1.0, 4.0))
    Lp = S.cumulative_lr_cosine(1e-5, 2000, 0.1)
    mid = out["by_w"][1]
    truth = math.exp(TRUE["intercept"] + TRUE["log_L"] * math.log(Lp) + TRUE["log_t"] * math.log(2000)
                     + TRUE["log_w"] * math.log(2.0) + TRUE["log_r"] * math.log(128))
    assert mid["w"] == pytest.approx(2.0) and mid["lo"] <= mid["g_std"] <= mid["hi"]
    assert mid["g_std"] == pytest.approx(truth, rel=0.1)
    assert out["by_w"][0]["g_std"] > out["by_w"][2]["g_std"]  # slope -1 in ||W||


def test_scaling_record_and_its_words_follow_the_fit():
    """The record the notebook saves: the fit, both hold-outs and the paper's prediction; its markdown states
    the record's own numbers (a changed exponent changes the text) and where the measured std falls."""
    st = _synthetic_stats(np.random.default_rng(7))
    rec = S.scaling_record(st)
    assert rec["fit"]["coef"]["log_w"] == pytest.approx(TRUE["log_w"], abs=0.05)
    assert rec["held_out_lr"]["n"] == rec["held_out_rank"]["n"] > 0
    assert set(rec["held_out_lr_by_value"]) == {"lr=0.0001", "lr=0.001"}
    text = S.scaling_markdown(rec)
    assert f"||W_j||^{rec['fit']['coef']['log_w']:.2f}" in text and "held out by rank" in text
    p = rec["paper"]
    inside = [b for b in p["by_w"] if b["measured_inside"]]
    assert ("at none of the three" in text) == (not inside)
    rec["fit"]["coef"]["log_w"] = -2.5
    assert "||W_j||^-2.50" in S.scaling_markdown(rec)


def test_fraction_and_sensitivity_tables_on_a_small_record():
    """Two seeds of one configuration: the pooled fraction is the counts' ratio, the interval contains it and
    says what it resampled; the sensitivity rows carry L."""
    rng = np.random.default_rng(0)
    frames = []
    for seed in (0, 1):
        gm1 = {n: rng.normal(0, 2e-3, 64) for n in MODULES}
        w = {n: np.ones(64) for n in MODULES}
        frames.append(T.capture_stats(gm1, w, formats=("bf16", "fp16")).assign(
            run=f"r8_lr0.001_s{seed}", config="r8_lr0.001", seed=seed, rank=8, lr=1e-3, variant="standard",
            warmup_steps=200, step=100, best=True, final=True))
    st = pd.concat(frames, ignore_index=True)
    assert S.with_labels(st[["run", "module"]], {"runs": {r: {"labels": {"run": r, "seed": k}} for k, r in
                                                          enumerate(st["run"].unique())}})["seed"].nunique() == 2
    ft = S.fraction_table(st, formats=("bf16",), zones=("one",), n_resamples=499)
    whole = st[st.wbin == T.ALL_ROWS]
    assert len(ft) == 2 and set(ft.checkpoint) == {"best", "final"}
    r = ft.iloc[0]
    assert r.fraction == whole["n_one_bf16"].sum() / whole["rows"].sum()
    assert r.lo <= r.fraction <= r.hi and r.interval_over == "seeds x modules (2 seeds)"
    sens = S.sensitivity_table(st, "bf16", "one")
    assert len(sens) == 2 and np.allclose(sens["L"], S.cumulative_lr(1e-3, 100, 200))
    import matplotlib.pyplot as plt

    from dora_num.studies.cancellation.plots import seeds_fraction_vs_lr_integral

    fig = seeds_fraction_vs_lr_integral(sens)
    assert "bf16 (fl(g) = 1)" in fig.axes[0].get_ylabel() and len(fig.axes[0].collections) == 3
    plt.close(fig)
    table = S.fractions_for_table(ft)
    assert table["seeds"].tolist() == ["0;1", "0;1"] and table["steps"].tolist() == ["100;100", "100;100"]
    from dora_num.studies.cancellation.plots import seeds_fractions

    fig = seeds_fractions(S.fraction_table(st, formats=("bf16", "fp16"), zones=("one",), n_resamples=99))
    assert [ax.get_title() for ax in fig.axes] == ["bf16", "fp16"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["r8\n1e-03"]
    plt.close(fig)


@pytest.mark.slow
def test_seeds_plan_smoke_on_the_cpu(tmp_path):
    """The seeds plan end to end at CPU smoke sizes: recorded (best captures, compact stats), ingested into a
    seeds record (without seed 0: the smoke runs use the packaged base) and analysed."""
    import json

    from dora_num.studies.cancellation.ingest_seeds import ingest_seeds

    plan, cfg = G.plan_and_config("seeds-smoke", "cpu", [1])
    files = G.record_inline(plan, "seeds-smoke", cfg, tmp_path / "launch", log=lambda m: None)
    out = ingest_seeds([files], tmp_path / "seeds", seed0=False, keep=tmp_path / "full", log=lambda m: None)
    rec = S.load_seeds(tmp_path / "seeds")
    assert sorted(rec.stats["run"].unique()) == sorted(s.name for s in plan) and len(out) == 3
    for name, info in rec.manifest["runs"].items():
        run = json.loads((tmp_path / "full" / "launch-0" / "runs" / name / "run.json").read_text())
        assert run["best_step"] in run["capture_steps"] and run["best_steps"][-1] == run["best_step"]
        st = rec.stats[rec.stats["run"] == name]
        assert st.loc[st["best"], "step"].unique().tolist() == [run["best_step"]]
        cap = P.Captures.load(tmp_path / "full" / "launch-0" / "runs" / name / "captures.npz")
        assert cap.steps.tolist() == sorted({run["best_step"], run["final_capture_step"]})
    whole = rec.stats[rec.stats["wbin"] == T.ALL_ROWS]
    assert (whole["n_one_bf16"] <= whole["rows"]).all() and whole["rows"].sum() % 20736 == 0  # counts exact
    ft = S.fraction_table(rec.stats, formats=("bf16",), n_resamples=199)
    assert (ft["interval_over"] == "modules (1 seed)").all() and ft["fraction"].between(0, 1).all()


def test_a_record_of_launches_at_several_commits_names_each():
    """The sidecars' measured commit: the one given, else each launch's own (once, in order), else none (a launch
    that names no commit leaves it to the machine file)."""
    from dora_num.studies.cancellation.ingest_seeds import launch_commits

    la = [{"git_sha": "a" * 40}, {"git_sha": "a" * 40}, {"git_sha": "b" * 40}]
    assert launch_commits(la) == "a" * 40 + "," + "b" * 40
    assert launch_commits(la[:2]) == "a" * 40
    assert launch_commits(la, "c" * 40) == "c" * 40
    assert launch_commits(la + [{"git_sha": None}]) is None
