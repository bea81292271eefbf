"""The convergence runner: plan, configuration, the CPU fused arm, the SMOKE study, DDP."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from dora_num.adapters.train import train
from dora_num.ops.layer import DoRALinear
from dora_num.repro.paths import REPO_ROOT
from dora_num.repro.provenance import read_provenance
from dora_num.studies.convergence import config as cc
from dora_num.studies.convergence import ingest_convergence
from dora_num.studies.convergence import recorded as cvr
from dora_num.studies.convergence import record_convergence as cv
from dora_num.studies.convergence import tidy as ct
from dora_num.studies.convergence import equivalence as eq

@pytest.fixture(autouse=True)
def one_thread():
    """1 CPU thread (see ConvergenceConfig.threads: 2 threads on the shared 2-core CI machine are ~40x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = dict(cc.SMOKE, steps=2, eval_every=2, eval_limit=8, batch_size=4, max_len=8, progress=False)  # threads=1


def test_run_plan_order():
    names = [s.name for s in cc.run_plan((0, 1, 2), 0)]
    assert names == ["eager_s0", "fused_s0", "eager_s0_rep1", "eager_s1", "fused_s1", "eager_s2", "fused_s2"]
    assert [s.name for s in cc.run_plan((3,), None, ("eager",))] == ["eager_s3"]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(seeds=()), "seeds must not be empty"),
        (dict(seeds=(0, 0)), "distinct"),
        (dict(repeat_seed=5), "repeat_seed"),
        (dict(steps=0), "steps"),
        (dict(paths=("fast",)), "paths"),
        (dict(fused_impl="triton"), "fused_impl"),
        (dict(profile_steps=-1), "profile_steps"),
    ],
    ids=["no-seeds", "dup-seeds", "repeat-not-a-seed", "zero-steps", "bad-path", "bad-impl", "neg-profile"],
)
def test_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(cc.ConvergenceConfig(), **change).validate()


def test_eval_steps_every_200_and_the_end():
    assert cc.ConvergenceConfig().eval_steps == tuple(range(0, 2001, 200))
    assert dataclasses.replace(cc.ConvergenceConfig(), steps=450).eval_steps == (0, 200, 400, 450)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_custom_op_arm_is_bitwise_the_eager_compose(dtype):
    """The CPU fused arm (custom op, PyTorch implementation) computes the contract's
    forward and backward: bit for bit what the eager tier computes (docs/contract.md, promise 2)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(63, 33).to(dtype)
    x = torch.randn(5, 63, dtype=dtype)

    def run(impl):
        torch.manual_seed(1)
        mod = DoRALinear.from_linear(lin, 4, 8.0, compose_path="eager", compose_fn=cv.compose_fn_for(impl))
        with torch.no_grad():
            mod.lora_B.normal_(0, 0.1)
            mod.magnitude.mul_(1.001)
        xi = x.clone().requires_grad_(True)
        y = mod(xi)
        y.float().square().sum().backward()
        return [y.detach(), xi.grad, mod.lora_A.grad, mod.lora_B.grad, mod.magnitude.grad]

    eager, op = run("eager"), run("custom_op")
    assert cv.compose_fn_for("eager") is None and cv.compose_fn_for("custom_op") is cv.custom_op_compose
    for a, b in zip(eager, op):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_g_statistics_known_values():
    g = {0: {"a": np.array([0.0, 1e-3], np.float32), "b": np.array([-2e-3], np.float32)}}
    df = ct.g_statistics(g).set_index(["module", "statistic"]).value
    assert df["all", "max_abs"] == pytest.approx(2e-3)
    assert df["a", "mean"] == pytest.approx(5e-4)
    assert df["b", "min"] == pytest.approx(-2e-3)


def test_smoke_study_end_to_end(tmp_path):
    """Tiny live study on CPU: outputs, provenance, and the contract's consequence that
    the CPU fused arm and the repeat train bit for bit like eager."""
    cfg = cc.ConvergenceConfig(**dict(TINY, profile_steps=cc.PROFILE_WARMUP + 1))
    logged = []
    res = cv.run_study(cfg, tmp_path, log=logged.append)
    assert logged[0].startswith("profile") and "projected total" in logged[0]
    prof = pd.read_csv(tmp_path / "profile.csv")
    assert sorted(prof.path.unique()) == ["eager", "fused"] and len(prof) == 2 * cfg.profile_steps
    assert res.summary["projected_total_s"] > 0
    for name in ("history.csv.xz", "evals.csv", "g_stats.csv.xz", "profile.csv", "summary.json"):
        assert (tmp_path / name).is_file()
        assert read_provenance(tmp_path / name)["producer"] == "dora-num record convergence"
    hist = pd.read_csv(tmp_path / "history.csv.xz")
    assert set(hist.metric) == {"loss", "grad_norm", "lr", "seconds"}
    assert set(hist.run) == {"eager_s0", "fused_s0", "eager_s0_rep1", "eager_s1", "fused_s1"}
    assert set(hist[hist.path == "fused"].impl) == {"custom_op"}
    evals = pd.read_csv(tmp_path / "evals.csv")
    assert sorted(evals.step.unique()) == [0, 2]
    losses = ct.wide_loss(hist)
    dt = eq.delta_table(losses)
    assert (dt[dt.kind.isin(["fused_vs_eager", "repeat"])].max_abs == 0).all()
    assert (dt[dt.kind == "seed_to_seed"].mean_abs > 0).all()
    assert res.summary["fused_impl"] == "custom_op" and not res.summary["skipped"]
    rec = cvr.load_recorded(tmp_path)
    assert len(rec.history) == len(res.history) and rec.summary["plan"] == res.summary["plan"]
    assert set(ct.seconds_per_step(rec)) == {"eager", "fused"}
    # the history is written with 9 significant digits: loss and gradient norm come back bit-exact
    for metric in ("loss", "grad_norm"):
        written = rec.history[rec.history.metric == metric].value.to_numpy()
        measured = res.history[res.history.metric == metric].value.to_numpy()
        assert np.array_equal(written, measured), metric


def test_profile_only_then_runs_split_by_seed_are_merged(tmp_path):
    """The GPU recipe: a profile alone, then one process per seed; --ingest merges them
    into the folder notebook 04 reads, in the plan's order, with the parts' device."""
    base = dict(TINY, profile_steps=cc.PROFILE_WARMUP + 1)
    prof = cv.run_study(cc.ConvergenceConfig(**dict(base, profile_only=True)), tmp_path / "profile",
                        log=lambda *_: None)
    assert prof.summary["profile_only"] and not (tmp_path / "profile" / "history.csv.xz").exists()
    for seed, rep in ((1, None), (0, 0)):
        cv.run_study(cc.ConvergenceConfig(**dict(base, seeds=(seed,), repeat_seed=rep, profile_steps=0)),
                     tmp_path / f"s{seed}", log=lambda *_: None)
    parts = [tmp_path / "s1", tmp_path / "profile", tmp_path / "s0"]
    out = tmp_path / "merged"
    from dora_num.studies import cli

    assert cli.run("convergence", ["--ingest", *map(str, parts), "--out", str(out), "--git-sha", "abc123"]) == 0
    rec = cvr.load_recorded(out)
    assert [p["name"] for p in rec.summary["plan"]] == ["eager_s0", "fused_s0", "eager_s0_rep1", "eager_s1",
                                                        "fused_s1"]
    assert sorted(rec.history.run.unique()) == sorted(rec.summary["runs"])
    assert rec.summary["config"]["seeds"] == [0, 1] and rec.summary["config"]["repeat_seed"] == 0
    assert sorted(rec.profile.path.unique()) == ["eager", "fused"]
    side = read_provenance(out / "summary.json")
    assert side["extra"]["measured_at_git_sha"] == "abc123"
    assert side["device"] == read_provenance(tmp_path / "s0" / "summary.json")["device"]
    kept = rec.profile[rec.profile.step > cc.PROFILE_WARMUP]
    assert ct.seconds_per_step(rec, "profile")["eager"] == kept[kept.path == "eager"].seconds.median()
    secs = rec.history[(rec.history.metric == "seconds") & (rec.history.step > 1) & (rec.history.path == "fused")]
    assert ct.seconds_per_step(rec)["fused"] == secs.value.median()
    with pytest.raises(ValueError, match="runs recorded twice"):
        ingest_convergence.merge_parts([tmp_path / "s0", tmp_path / "s0"])
    other = tmp_path / "other"
    cv.run_study(cc.ConvergenceConfig(**dict(base, seeds=(2,), repeat_seed=None, profile_steps=0, lr=5e-4)),
                 other, log=lambda *_: None)
    with pytest.raises(ValueError, match="different configuration: \\['lr'\\]"):
        ingest_convergence.merge_parts([tmp_path / "s0", other])
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        ingest_convergence.merge_parts([tmp_path])


def test_ingest_names_each_seeds_commit(tmp_path):
    """A merged record may hold seeds recorded at different commits (each seed's fused run is compared
    with its own 1-ulp replicates only), named at the ingest (``--seed-git-sha``; the device's copy of the
    repository has no ``.git`` of the commit it ran): each process keeps its seed's commit."""
    base = dict(TINY, profile_steps=0, repeat_seed=None)
    for seed, runs in ((0, ("eager_s0", "fused_s0")), (1, ("eager_s1", "fused_s1"))):
        cv.run_study(cc.ConvergenceConfig(**dict(base, seeds=(seed,), runs=runs)), tmp_path / runs[0],
                     log=lambda *_: None)
    parts = [tmp_path / "eager_s0", tmp_path / "eager_s1"]
    out = tmp_path / "merged"
    from dora_num.studies import cli

    assert cli.run("convergence", ["--ingest", *map(str, parts), "--out", str(out), "--git-sha", "bbb",
                                   "--seed-git-sha", "0=aaa", "--loss-only"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert ingest_convergence.commits_by_seed(summary) == {0: ["aaa"], 1: ["bbb"]}
    with pytest.raises(SystemExit, match="SEED=SHA"):
        cli.run("convergence", ["--ingest", *map(str, parts), "--out", str(out), "--seed-git-sha", "x=aaa"])
    both = tmp_path / "both"  # one process that ran two seeds ran one commit
    cv.run_study(cc.ConvergenceConfig(**dict(base, seeds=(2, 3), runs=("eager_s2", "eager_s3"))), both,
                 log=lambda *_: None)
    with pytest.raises(ValueError, match=r"process both ran seeds \[2, 3\], named at different commits"):
        ingest_convergence.ingest([both], tmp_path / "bad", git_sha="bbb", seed_commits={2: "aaa"})
    assert ingest_convergence.ingest([both], tmp_path / "ok", git_sha="bbb", seed_commits={2: "bbb"})


def test_deadline_skips_whole_runs():
    """A run that would end after the deadline is skipped, never cut short."""
    cfg = cc.ConvergenceConfig(**dict(TINY, steps=1, eval_every=1, repeat_seed=None, deadline_s=1e-6))
    res = cv.run_study(cfg, None, log=lambda *_: None)
    assert list(res.summary["runs"]) == ["eager_s0"]
    assert [s["run"] for s in res.summary["skipped"]] == ["fused_s0", "eager_s1", "fused_s1"]


def test_load_recorded_names_the_missing_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="recorded data missing: .*history.csv.xz.*summary.json; record it "
                                                 "with: .*dora-num record convergence --ingest"):
        cvr.load_recorded(tmp_path)


def _tidy_loss(path):
    h = pd.read_csv(path)
    return h[h.metric.isin(["loss", "grad_norm"])].pivot_table(index="step", columns="metric", values="value")


def test_ddp_two_gloo_ranks_match_single_process(tmp_path):
    """2 gloo ranks on CPU (torchrun) against the single process, dropout off.

    DDP computes the single process's loss and gradient with sums associated
    differently (per-rank gradient sums then an all-reduce; slice-wise padding), a
    rounding-level change.  Tolerance: the measured effect of a rounding-level change
    of the same training, the single-process run with every initial magnitude moved
    by one fp32 ulp (``TrainConfig.perturb_seed``): DDP may not move the loss or the
    gradient norm further than that does, step by step.  Rounding-level changes share a scale
    but not a size (one perturbation left the loss unchanged on some CPUs, and DDP exceeded the
    largest of three by 2% on another), so the tolerance is 4 times the largest effect of three
    perturbations (random signs); the defect this guards against, a gradient summed over the two
    ranks instead of averaged (the single process at twice the learning rate), must exceed it
    (the test's power, asserted).
    """
    steps = 3
    args = ["--smoke", "--no-dropout", "--seeds", "0", "--no-repeat", "--paths", "eager", "--steps", str(steps),
            "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "dora_num", "record", "convergence", "--out", str(tmp_path / "ddp"), *args],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ddp = _tidy_loss(tmp_path / "ddp" / "history.csv.xz")

    cfg = cc.ConvergenceConfig(**dict(cc.SMOKE, steps=steps, seeds=(0,), repeat_seed=None, paths=("eager",),
                                      dropout=False, progress=False))
    spec = cc.RunSpec("eager", 0)
    hooks = cv.make_hooks(cfg, cv.Distributed())
    single = train(cc.train_config(cfg, spec, evals=False), hooks=hooks)
    s = pd.DataFrame(single.history).set_index("step")
    tol = None
    for seed in (1, 2, 3):
        perturbed = train(dataclasses.replace(cc.train_config(cfg, spec, evals=False), perturb_seed=seed),
                          hooks=hooks)
        effect = (pd.DataFrame(perturbed.history).set_index("step")[["loss", "grad_norm"]]
                  - s[["loss", "grad_norm"]]).abs()
        tol = effect if tol is None else np.maximum(tol, effect)
    tol = 4 * tol.max()
    base = cc.train_config(cfg, spec, evals=False)
    summed = train(dataclasses.replace(base, lr=2 * base.lr), hooks=hooks)
    defect = (pd.DataFrame(summed.history).set_index("step")[["loss", "grad_norm"]] - s[["loss", "grad_norm"]]).abs()
    assert (tol > 0).all() and (defect.max() > tol).all(), (tol, defect)  # a baseline, and power against the defect
    assert len(ddp) == steps
    diff = (ddp[["loss", "grad_norm"]] - s[["loss", "grad_norm"]]).abs()
    assert (diff.loss <= tol.loss).all(), (diff, tol)
    assert (diff.grad_norm <= tol.grad_norm).all(), (diff, tol)


def test_ulp_runs_are_planned_tagged_and_compared(tmp_path):
    """--ulp-seeds adds eager runs whose magnitudes moved by 1 ulp at init; they carry
    perturbed=True, stay out of the margin and the fused-vs-eager tables, and are
    compared with their unperturbed eager run by perturbation_deltas."""
    assert [s.name for s in cc.run_plan((0, 1), 0, cc.PATHS, (1,))] == [
        "eager_s0", "fused_s0", "eager_s0_rep1", "eager_s1", "fused_s1", "eager_s1_ulp"]
    reps = cc.run_plan((1,), None, cc.PATHS, (1,), ulp_replicates=3)
    assert [s.name for s in reps] == ["eager_s1", "fused_s1", "eager_s1_ulp", "eager_s1_rep1_ulp", "eager_s1_rep2_ulp"]
    seeds = [cc.ulp_perturb_seed(s) for s in reps if s.perturbed]
    assert seeds[0] == cc.ULP_SEED_OFFSET + 1 and len(set(seeds)) == 3  # the first as recorded before, each its own
    with pytest.raises(ValueError, match="ulp_seeds"):
        cc.ConvergenceConfig(**dict(TINY, ulp_seeds=(7,))).validate()
    cfg = cc.ConvergenceConfig(**dict(TINY, repeat_seed=None, ulp_seeds=(0,)))
    res = cv.run_study(cfg, tmp_path, log=lambda *_: None)
    rec = cvr.load_recorded(tmp_path)
    loss = ct.wide_loss(rec.history)
    assert set(rec.history[rec.history.perturbed].run) == {"eager_s0_ulp"}
    ulp = eq.perturbation_deltas(loss)
    assert list(ulp.run_b) == ["eager/0/0/ulp"] and ulp.mean_abs.iloc[0] > 0
    margin = eq.margin_from_eager(loss[loss.path == "eager"])
    assert margin.pairs == 1  # seeds 0 and 1; the 1-ulp run is not a third eager seed
    assert set(eq.delta_table(loss).kind) == {"fused_vs_eager", "seed_to_seed"}
    assert "eager_s0_ulp" in res.summary["runs"]
