"""Notebook 04's headline in the README and its takeaway (fused vs eager training against the 1-ulp floor): the
sentences and the statistics they state, read from the committed data (``d``: the ``data/`` folder).
:mod:`dora_num.repro.results` gathers every study folder's ``headline.py`` into the README and checks each
strong word against the statistics it returns."""

from __future__ import annotations

import re

from pathlib import Path

from ...repro.headline import Stats, pct, read_csv, read_json
from .datasets import CONVERGENCE, SAMEBATCH

# shown under the headline in the README (figures/04_convergence/*.png)
FIGURES = ("deltas_vs_floor",)


def _training(d: Path) -> Stats:
    """Notebook 04: fused vs eager per seed against the same-batch floor (eager with m moved by 1 ulp): the
    ratio test's R and upper bound per seed, its power and controls, and what it cannot detect (the early
    window: :func:`_early`); how many 1-ulp runs per seed, whether they ran at the runs' commit; the
    different-batch floor for contrast."""
    u = read_csv(d, "04_convergence/ulp_perturbation_deltas.csv")
    v = read_csv(d, "04_convergence/verdict.csv")
    tested = v[v.role == "tested"].set_index("seed")
    agree, differ = v[v.role == "control: agree"], v[v.role == "control: differ"]
    tost = v[v.role.str.startswith("dropped test")]
    m = read_json(d, "04_convergence/margin.json")
    cfg = read_json(d, CONVERGENCE.file("summary"))["config"]
    at = read_json(d, CONVERGENCE.file("history") + ".provenance.json")["extra"]["measured_at_git_sha"]
    shas = dict(re.findall(r"(eager_s\*_ulp runs|runs) ([0-9a-f]{40})", at))
    return {"steps": cfg["steps"], "seeds": len(cfg["seeds"]), "seed_first": min(cfg["seeds"]),
            "seed_last": max(cfg["seeds"]), "rank": cfg["rank"], "lr": cfg["lr"],
            **{f"ratio_seed{int(k)}": r for k, r in tested.ratio.items()},
            **{f"ratio_high_seed{int(k)}": r for k, r in tested.ratio_high.items()},
            "ratio_min": tested.ratio.min(), "ratio_max": tested.ratio.max(), "bound": tested.bound.max(),
            "power_at_1_min": tested.power_at_1.min(), "ulp_runs_per_seed": int(u.groupby("seed_a").size().min()),
            "same_batch_floor_mean": u.mean_abs.mean(), "tests_passed": int(tested.within.sum()),
            "tests": len(tested), "agree_controls": len(agree), "agree_passed": int(agree.within.sum()),
            "differ_controls": len(differ), "differ_failed": int((~differ.within.astype(bool)).sum()),
            "differ_ratio_min": differ.ratio.min(), "seed_floor": m["floor"], "seed_floor_batches_differ": 1.0,
            "tost_says_equivalent_on_other_batches": float(tost.within.astype(bool).any()),
            "floor_at_another_commit": float(len(set(shas.values())) > 1), **_wave(d), **_early(d)}


def _early(d: Path) -> Stats:
    """Notebook 04's early window (:func:`..equivalence.early_window`), over the seeds of both the 2000-step runs
    and the one-commit wave: when fused and eager part, when the 1-ulp floor saturates, fused over the floor
    before both have saturated and after."""
    e = read_csv(d, "04_convergence/early_window.csv")
    return {"fused_first_diff_min": int(e.fused_first_diff_step.min()),
            "fused_first_diff_max": int(e.fused_first_diff_step.max()),
            "floor_first_diff_max": int(e.floor_first_diff_step.max()),
            "floor_saturation_step_max": int(e.floor_saturation_step.max()),
            "window_end_max": int(e.window_end.max()), "early_share_max": e.early_share.max(),
            "early_ratio_min": e.early_ratio.min(), "early_ratio_max": e.early_ratio.max(),
            "late_ratio_min": e.late_ratio.min(), "late_ratio_max": e.late_ratio.max(),
            "saturation_window": int(e.saturation_window.iloc[0]),
            "saturation_fraction": float(e.saturation_fraction.iloc[0]), "early_window_sets": e.runs.nunique()}


def _early_text(s: Stats) -> str:
    """What the ratio test can and cannot detect, from :func:`_early`."""
    both = "both sets of runs" if s["early_window_sets"] > 1 else "the runs"
    return (f"What the test can and cannot detect: fused and eager losses are bitwise equal until they first "
            f"differ, at step {s['fused_first_diff_min']} to {s['fused_first_diff_max']} (per seed, {both}); the "
            f"1-ulp runs part from eager by step {s['floor_first_diff_max']} and their mean |delta loss| reaches "
            f"{pct(s['saturation_fraction'])} of its late-run level (a trailing {s['saturation_window']}-step mean "
            f"against the mean over the second half) by step {s['floor_saturation_step_max']}; until both have "
            f"saturated (by step {s['window_end_max']}, at most {pct(s['early_share_max'])} of the steps) fused is "
            f"{s['early_ratio_min']:.3g} to {s['early_ratio_max']:.3g} times the floor, after it "
            f"{s['late_ratio_min']:.3g} to {s['late_ratio_max']:.3g}: two runs on the same batches that have "
            f"decorrelated sit at a ratio of about 1 whatever parted them, so the test cannot fail a kernel that "
            f"is worse than rounding but whose runs decorrelate the same way, and its only failing control "
            f"uses other batches")


def _wave(d: Path) -> Stats:
    """Notebook 04's one-commit wave: the same test with three 1-ulp replicates per seed."""
    w = read_csv(d, "04_convergence/samebatch_verdict.csv")
    t = w[w.role == "tested"]
    agree, differ = w[w.role == "control: agree"], w[w.role == "control: differ"]
    dev = read_json(d, SAMEBATCH.file("history") + ".provenance.json")["device"]["name"]
    procs = read_json(d, SAMEBATCH.file("summary"))["processes"]
    commits = {p.get("git_sha") for p in procs} - {None}  # per process, from its sidecar (one per seed: the ingest)
    return {"wave_seeds": len(t), "wave_commits": len(commits) or 1, "wave_seed_list": ", ".join(str(int(x)) for x in t.seed),
            "wave_ratio_min": t.ratio.min(), "wave_ratio_max": t.ratio.max(), "wave_high_max": t.ratio_high.max(),
            "wave_passed": int(t.within.sum()), "wave_ulp_runs_per_seed": int(t.replicates.min()),
            "wave_agree_passed": int(agree.within.sum()), "wave_agree": len(agree),
            "wave_agree_min": agree.ratio.min(), "wave_agree_max": agree.ratio.max(),
            "wave_differ_failed": int((~differ.within.astype(bool)).sum()), "wave_differ": len(differ),
            "wave_gpu": dev.replace("NVIDIA ", "").split(" ")[0]}


def _training_text(s: Stats) -> str:
    per = ", ".join(f"{v:.3g}" for k, v in s.items() if k.startswith("ratio_seed"))
    high = ", ".join(f"{v:.3g}" for k, v in s.items() if k.startswith("ratio_high_seed"))
    n = s["ulp_runs_per_seed"]
    reps = (f"one 1-ulp run per seed, so the floor's own spread is not measured and no known-agree control "
            f"exists" if n == 1 else f"{n} 1-ulp runs per seed ({s['agree_passed']} of {s['agree_controls']} "
            f"known-agree controls pass)")
    other = (", recorded at another commit than the fused and eager runs" if s["floor_at_another_commit"] else
             ", at the same commit as the fused and eager runs")
    return (f"over {s['steps']} MiniLM steps (rank {s['rank']}, lr {s['lr']:g}) the mean |delta loss| of fused vs "
            f"eager is {per} times that of eager vs eager with m moved by 1 ulp (same seed and batches) for seeds "
            f"{s['seed_first']} to {s['seed_last']}; a ratio test on block means puts the 95% upper bounds at "
            f"{high}, below the pre-set {s['bound']:g} on {s['tests_passed']} of {s['tests']} seeds (power at a "
            f"true ratio of 1: at least {s['power_at_1_min']:.2f}), and the same test rejects eager runs of another "
            f"seed, on different batches ({s['differ_failed']} of {s['differ_controls']}, ratios from "
            f"{s['differ_ratio_min']:.3g}); {reps}{other}. {_early_text(s)}. In a wave recorded on an "
            f"{s['wave_gpu']}, each seed's runs at one commit, with "
            f"{s['wave_ulp_runs_per_seed']} 1-ulp runs per seed (seeds {s['wave_seed_list']}"
            f"{'' if s['wave_seeds'] >= s['seeds'] else ' so far'}"
            f"{'' if s['wave_commits'] == 1 else '; ' + str(s['wave_commits']) + ' commits'}"
            f"), R is "
            f"{s['wave_ratio_min']:.3g} to {s['wave_ratio_max']:.3g} (upper bounds at most {s['wave_high_max']:.3g}), "
            f"{s['wave_agree_passed']} of {s['wave_agree']} known-agree controls pass (each replicate against the "
            f"others: R {s['wave_agree_min']:.3g} to {s['wave_agree_max']:.3g}) and {s['wave_differ_failed']} of "
            f"{s['wave_differ']} known-differ controls fail. The seed-to-seed floor ({s['seed_floor']:.2g}) compares "
            f"runs with different batches, and the signed-mean TOST this page used before calls two such runs "
            f"equal, so neither decides")


def headline(d: Path) -> tuple[list[str], Stats]:
    s = _training(d)
    return ([f"fused vs eager training: {_training_text(s)}"], s)


def _t_training(d: Path) -> tuple[str, Stats]:
    s = _training(d)
    t = read_csv(d, "05_memory_and_speed/targets.csv")
    fwd = t[t.target == "fwd_pct_copy"]
    top = fwd.loc[fwd.measured.idxmax()]
    s["fwd_pct_copy"], s["fwd_pct_copy_shape"] = top.measured, top["shape"]
    text = _training_text(s)
    return (f"**Fused training moves the loss about as much as a 1-ulp change of m does: within {s['bound']:g} "
            f"times that distance on {s['tests_passed']} of {s['tests']} seeds.** {text[0].upper()}{text[1:]}. The "
            f"fused compose's forward reaches {s['fwd_pct_copy']:.3g}% of the GPU's copy bandwidth at "
            f"{s['fwd_pct_copy_shape']} (H200, one session).", s)


# the README's numbered takeaways this notebook backs: (function, the figure that shows it)
TAKEAWAYS = (
    (_t_training, "04_convergence/deltas_vs_floor"),
)
