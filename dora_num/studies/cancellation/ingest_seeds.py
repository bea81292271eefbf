"""``dora-num record adapters-gpu --ingest DIR [DIR ...]`` for launches of plan ``seeds``: the compact record.

Each launch (one device call per seed: :func:`.record_trained_launch.predict_seeds_wall`) returns
``plan.json`` and ``part-K.tar`` holding per run ``run.json``, ``evals.csv`` and the :mod:`.seed_stats` table of
every kept capture.  :func:`ingest_seeds` gathers them, adds seed 0 (the full plan's record: its grid runs'
committed final ``g``, summarised by the same :func:`.seed_stats.capture_stats`; no best-checkpoint capture
exists for it unless its best step was a capture step) and writes :data:`.datasets.TRAINED_SEEDS`.  The runs'
``captures.npz`` (``m``, ``wnorm``, ``wnorm64`` at the best and last step) are left out: ``--keep DIR`` holds them.

The method in full: docs/methods.md (collapse with seeds).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from ...repro import recording
from .datasets import TRAINED, TRAINED_SEEDS
from .ingest_trained import run_labels, unpack
from .runs import RAW_FILES, resolve_base
from .seed_stats import FLOAT_FORMAT, base_row_norms, capture_stats, read_stats

def is_seeds_launch(folder) -> bool:
    """Whether ``folder`` (a launch's returned files) holds a launch of plan ``seeds``."""
    return json.loads((Path(folder) / "plan.json").read_text())["plan_name"].startswith("seeds")


def config_name(name: str) -> str:
    """A run's configuration (its name without the ``_sK`` seed suffix)."""
    head, _, tail = name.rpartition("_s")
    return head if head and tail.isdigit() else name


def _labels(info: dict, source: str) -> dict:
    lab = run_labels(info)
    return {**lab, "config": config_name(info["name"]), "seed": int(info.get("seed", info["study_config"]["seed"])),
            "warmup_steps": info["study_config"]["warmup_steps"], "stop_reason": info["stop_reason"],
            "steps": info["steps"], "best_step": info["best_step"], "source": source}


def seed0_stats(trained_folder=None, workdir=None) -> tuple[pd.DataFrame, pd.DataFrame, dict, dict]:
    """Seed 0 from the full plan's record: :func:`.seed_stats.capture_stats` of each grid run's committed
    final ``g`` (``g_final.npz``) against the base row norms of the weights it was trained on; its evaluations;
    and its base (``manifest.json: base``)."""
    from ...adapters.model import load_base_model
    from .trained import load_trained

    tr = load_trained(trained_folder)
    with tempfile.TemporaryDirectory(prefix="dora-num-seeds-base-") as tmp:
        model, _ = load_base_model(resolve_base(tr.manifest["base"], Path(workdir or tmp)))
    names = sorted(next(iter(tr.g_final.values())))
    w = base_row_norms(model, names)
    frames, runs = [], {}
    for run, g in sorted(tr.g_final.items()):
        info = tr.manifest["runs"][run]
        step = tr.final_steps[run]
        frames.append(capture_stats({n: g[n] - 1.0 for n in names}, w).assign(
            run=run, step=step, best=step == info["best_step"], final=True))
        runs[run] = {"launch": None, "labels": _labels(info, f"full plan record: final g ({TRAINED.filename('g_final')})"),
                     **{k: info.get(k) for k in ("stop_reason", "steps", "best_step", "best_mrr10", "mrr10_base",
                                                 "mrr10_final")}}
    ev = tr.evals[tr.evals["run"].isin(tr.g_final)].assign(seed=0)
    return pd.concat(frames, ignore_index=True), ev, tr.manifest["base"], runs


def ingest_seeds(folders, dest, *, git_sha: str | None = None, keep=None, replace: bool = False, notes=(),
                 seed0: bool = True, trained_folder=None, log=print) -> list[Path]:
    """Launches of plan ``seeds`` (``folders``) and, with ``seed0``, the full plan's record
    (``trained_folder``; default ``data/adapters/trained``) into ``dest``.  The launches and seed 0 must have
    used the same base weights, and no seed may come twice."""
    folders, dest = [Path(f) for f in folders], Path(dest)
    if dest.is_dir() and any(dest.iterdir()):
        if not replace:
            raise FileExistsError(f"{dest} already holds a record: pass replace=True (--replace) to overwrite it")
        shutil.rmtree(dest)
    tmp = Path(tempfile.mkdtemp(prefix="dora-num-ingest-seeds-"))
    try:
        stats, evals, runs, launches, first_info = [], [], {}, [], None
        for i, f in enumerate(folders):
            if not is_seeds_launch(f):
                raise ValueError(f"{f} is not a launch of plan seeds")
            root = unpack(f, (Path(keep) if keep else tmp) / f"launch-{i}")
            plan = json.loads((root / "plan.json").read_text())
            # launches may come from different commits (one seed a device call): each names its own
            launches.append({"folder": f.name, "git_sha": plan.get("git_sha"), "plan_name": plan["plan_name"],
                             "config": plan["config"],
                             "wall_s": plan["wall_s"], "elapsed_s": plan.get("elapsed_s"),
                             "processes": {k: {"returncode": v["returncode"], "wall_s": v["wall_s"]}
                                           for k, v in plan["processes"].items()},
                             "parts": {p.name: recording_sha(p) for p in sorted(f.glob("part-*.tar"))}})
            for spec in plan["plan"]:
                d = root / "runs" / spec["name"]
                need = [d / RAW_FILES[k] for k in ("info", "evals", "stats")]
                if not all(p.is_file() for p in need):
                    launches[-1].setdefault("missing_runs", []).append(spec["name"])
                    continue
                info = json.loads(need[0].read_text())
                if info["name"] in runs:
                    raise ValueError(f"run {info['name']} comes twice (in {runs[info['name']]['launch']} and {f.name})")
                first_info = first_info or (info, d)
                lab = _labels(info, "seeds plan: compact capture statistics")
                stats.append(read_stats(need[2]).assign(run=info["name"]))
                evals.append(pd.read_csv(need[1]).assign(run=info["name"], seed=lab["seed"]))
                runs[info["name"]] = {"launch": f.name, "labels": lab, **{k: info.get(k) for k in (
                    "seed", "stop_reason", "steps", "best_step", "best_mrr10", "mrr10_base", "mrr10_final",
                    "best_steps", "stats_steps", "median_s_per_step", "train_s", "build_s", "base")}}
        if not runs:
            raise ValueError(f"no complete run in {[str(f) for f in folders]}")
        bases = {r["base"]["fingerprint"] for r in runs.values()}
        base0 = None
        if seed0:
            s0, e0, base0, s0_runs = seed0_stats(trained_folder, tmp)
            bases.add(base0["fingerprint"])
            stats.insert(0, s0)
            evals.insert(0, e0)
        if len(bases) != 1:
            raise ValueError(f"the runs used different base weights: {sorted(bases)}")
        if seed0:
            runs.update(s0_runs)
        table = pd.concat(stats, ignore_index=True)
        first = ["run", "step", "best", "final"]
        table = table[first + [c for c in table.columns if c not in first]]
        seeds = sorted({r["labels"]["seed"] for r in runs.values()})
        info, folder = first_info
        name_of = TRAINED_SEEDS.relpath
        artifacts = {
            name_of("stats"): table,
            name_of("evals"): pd.concat(evals, ignore_index=True)[["run", "seed", "step", "mrr10", "val_loss"]],
            name_of("manifest"): {"seeds": seeds, "launches": launches, "runs": runs, "notes": [str(n) for n in notes],
                                  "base": info["base"], "git_sha": git_sha,
                                  "seed0": ({"source": TRAINED.relpath("g_final"), "steps": "final only",
                                             "base": base0} if seed0 else None),
                                  "left_out": {"captures": f"m, wnorm, wnorm64 at the best and last step "
                                                           f"(runs/<name>/{RAW_FILES['captures']}: --keep)",
                                               "regenerate": TRAINED_SEEDS.how_to_record}}}
        log(f"{len(runs)} runs, seeds {seeds}, {len(table)} rows")
        return recording.ingest(artifacts, dest, machine=recording.machine_from_sidecar(folder / RAW_FILES["info"]),
                                producer=TRAINED_SEEDS.producer, git_sha=launch_commits(launches, git_sha),
                                params=launches[0]["config"], seed=None,
                                extra={"plan": "seeds", "seeds": seeds, **({"notes": list(notes)} if notes else {})},
                                sources=folders, inputs={f"{i}/{p.name}": p for i, f in enumerate(folders)
                                                                  for p in sorted(f.glob("part-*.tar"))},
                                float_formats={name_of("stats"): FLOAT_FORMAT, name_of("evals"): "%.9g"})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def launch_commits(launches: list[dict], git_sha: str | None = None) -> str | None:
    """The commit the sidecars name as measured: ``git_sha`` where given, else the launches' own commits
    (comma-separated, in launch order, each once) where every launch names one, else None (the first launch's
    machine file then speaks for it)."""
    if git_sha:
        return git_sha
    shas = [la.get("git_sha") for la in launches]
    if not shas or not all(shas):
        return None
    return ",".join(dict.fromkeys(shas))


def recording_sha(path) -> str:
    from ...repro.provenance import sha256_file

    return sha256_file(path)

