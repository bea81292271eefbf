"""``dora-num record convergence --ingest DIR...``: notebook 04's GPU processes merged into ``data/gpu/convergence``.

On the H200 each step costs ~0.1 s of host Python, so the recorded runs were made one process per
run (``--runs``, several processes sharing the GPU; ``.ci/gpu/convergence.sh``) after a
``--profile-only`` process alone; :func:`merge_parts` puts their folders together and :func:`ingest`
records them with provenance (the GPU machine's device and versions from the parts' own sidecars).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ...repro import recording
from .config import HISTORY_FLOAT_FORMAT, PATHS, run_plan
from .datasets import CONVERGENCE
from .recorded import Recorded, read_history
from .tidy import order, with_perturbed


def merge_parts(parts: list[Path]) -> Recorded:
    """One :class:`Recorded` from the folders of several processes of one study: at
    most one ``--profile-only`` folder and any number of run folders (e.g. one per
    seed).  Refuses parts whose configurations differ beyond seeds, repeat and
    paths, duplicated runs, and a fused arm that differs between parts."""
    parts = [Path(p) for p in parts]
    if not parts:
        raise ValueError("no folders to merge")
    summaries, profiles, runs = [], [], []
    for d in parts:
        f = CONVERGENCE.path("summary", d)
        if not f.is_file():
            raise FileNotFoundError(f"{d} has no {f.name} (not a convergence output folder)")
        sm = json.loads(f.read_text())
        summaries.append(sm)
        if sm.get("profile_only"):
            profiles.append(d)
        else:
            runs.append(d)
    if len(profiles) > 1:
        raise ValueError(f"more than one --profile-only folder: {profiles}")
    varying = {"seeds", "repeat_seed", "paths", "plan", "profile_steps", "profile_only", "deadline_s", "progress",
               "runs", "ulp_seeds"}
    cfg0 = {k: v for k, v in summaries[0]["config"].items() if k not in varying}
    for d, sm in zip(parts, summaries):
        cfg = {k: v for k, v in sm["config"].items() if k not in varying}
        diff = sorted(k for k in set(cfg) | set(cfg0) if cfg.get(k) != cfg0.get(k))
        if diff:
            raise ValueError(f"{d} was run with a different configuration: {diff}")
    impls = {sm["fused_impl"] for sm in summaries}
    if len(impls) != 1:
        raise ValueError(f"parts disagree on the fused arm: {sorted(impls)}")
    tables = {"history": [], "evals": [], "g_stats": []}
    merged_runs, skipped, plan, processes = {}, [], [], []
    for d, sm in zip(parts, summaries):
        processes.append({"folder": d.name, "profile_only": bool(sm.get("profile_only")),
                          "runs": list(sm.get("runs", {})), "elapsed_s": sm.get("elapsed_s")})
        if sm.get("profile_only"):
            continue
        dup = set(sm["runs"]) & set(merged_runs)
        if dup:
            raise ValueError(f"runs recorded twice: {sorted(dup)}")
        merged_runs.update(sm["runs"])
        skipped += sm.get("skipped", [])
        plan += sm["plan"]
        tables["history"].append(read_history(CONVERGENCE.path("history", d)))
        tables["evals"].append(with_perturbed(pd.read_csv(CONVERGENCE.path("evals", d))))
        tables["g_stats"].append(with_perturbed(pd.read_csv(CONVERGENCE.path("g_stats", d))))
    if not runs:
        raise ValueError("no run folders among the parts (only a profile)")
    seeds = sorted({p["seed"] for p in plan})
    reps = sorted({p["seed"] for p in plan if p["repeat"]})
    ulps = tuple(sorted({p["seed"] for p in plan if p.get("perturbed")}))
    order = {s.name: i for i, s in enumerate(run_plan(seeds, reps[0] if reps else None, PATHS, ulps))}
    plan.sort(key=lambda p: order.get(p["name"], len(order)))
    profile = pd.read_csv(CONVERGENCE.path("profile", profiles[0])) if profiles else pd.DataFrame(
        columns=["path", "impl", "step", "seconds"])
    first = summaries[parts.index(runs[0])]
    summary = {**first,
               "config": {**first["config"], "seeds": seeds, "ulp_seeds": list(ulps),
                          "repeat_seed": reps[0] if reps else None, "plan": [p["name"] for p in plan]},
               "plan": plan, "runs": merged_runs, "skipped": skipped, "processes": processes,
               "run_order": "one process per run (see processes); plan listed in run_plan's order"}
    summary["config"].pop("runs", None)  # each part's own selection, meaningless once merged
    if profiles:
        sp = summaries[parts.index(profiles[0])]
        summary["profile"] = sp.get("profile")
        summary["profile_config"] = sp["config"]
    else:
        summary.pop("profile", None)
    cat = (lambda fs: pd.concat(fs, ignore_index=True))
    return Recorded(cat(tables["history"]), cat(tables["evals"]), cat(tables["g_stats"]), profile, summary,
                    runs[0])


def commits_by_seed(summary: dict) -> dict[int, list[str | None]]:
    """``{seed: [commits]}``: the distinct commits the processes of each seed's runs ran, as the ingest
    named them (the same-batch test compares a seed's fused run with its own 1-ulp replicates only, so one
    commit per seed is what it needs; a merged record may hold seeds recorded at different commits)."""
    seed_of = {p["name"]: p["seed"] for p in summary["plan"]}
    out: dict[int, set] = {}
    for proc in summary["processes"]:
        for run in proc["runs"]:
            out.setdefault(seed_of[run], set()).add(proc.get("git_sha"))
    return {s: sorted(c, key=str) for s, c in sorted(out.items())}


def ingest(parts: list[Path], dest: Path, *, git_sha: str | None = None, loss_only: bool = False,
           seed_commits: dict[int, str] | None = None) -> list[Path]:
    """Merge the GPU processes' folders (:func:`merge_parts`) into ``dest`` (e.g.
    ``data/gpu/convergence``) with provenance: the GPU machine's device description
    and library versions from the parts' own sidecars, ``git_sha`` the commit that ran
    (the device machine's copy of the repository has no ``.git`` of its own commit: the sidecars'
    ``git`` is not it).  ``seed_commits``: the commit each seed's processes ran where the parts
    come from several device calls (``{seed: sha}``; a seed not named ran ``git_sha``), kept per
    process in the summary.  ``loss_only``: the per-step loss and ``summary.json`` alone (what the
    same-batch test reads)."""
    rec = merge_parts(parts)
    seed_of = {p["name"]: p["seed"] for p in rec.summary["plan"]}
    for proc in rec.summary["processes"]:
        seeds = {seed_of[r] for r in proc["runs"]}
        shas = {(seed_commits or {}).get(s, git_sha) for s in seeds} or {git_sha}  # a profile: no seed
        if len(shas) != 1:  # one process ran one commit: its seeds cannot be named at two
            raise ValueError(f"process {proc['folder']} ran seeds {sorted(seeds)}, named at different commits: "
                             f"{sorted(shas, key=str)}")
        proc["git_sha"] = shas.pop()
    name = CONVERGENCE.relpath
    history = rec.history[rec.history.metric == "loss"] if loss_only else rec.history
    tables = {name("history"): order(history, ["metric", "value"]), name("summary"): rec.summary}
    if not loss_only:
        tables |= {name("evals"): order(rec.evals, ["metric", "value"]),
                   name("g_stats"): order(rec.g_stats, ["module", "statistic", "value"]), name("profile"): rec.profile}
    return recording.ingest(tables, Path(dest), machine=recording.machine_from_sidecar(CONVERGENCE.path("summary", rec.folder)),
                            producer=CONVERGENCE.producer,
                           git_sha=git_sha, params=rec.summary["config"], sources=parts,
                           float_formats={name("history"): HISTORY_FLOAT_FORMAT})
