"""The launcher of ``dora-num record adapters-gpu``: every run of a plan as its own process, one deadline
for all, the output packed into the files a GPU machine returns (at most 8, 16 MiB each).

:func:`launch` starts ``python -m dora_num record adapters-gpu --run NAME ...`` per run (one torch thread
each), waits, sends SIGTERM (handled as a deadline stop) then SIGKILL to runs still alive after the
deadline, and writes ``plan.json`` (plan, configuration, :func:`predict`, each process's exit and log
tail) and ``part-K.tar`` (:func:`pack`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from .datasets import TRAINED
from .runs import FINAL_MARGIN_S, RunSpec, base_info

PART_BYTES = 15 * 2**20  # under the 16 MiB a returned file may have
MAX_PARTS = 5  # + plan.json, its sidecar, launch.log: the 8 files that come back


PACK_RESERVE_S = 20.0  # wall after the deadline: SIGTERM (+4 s), SIGKILL (+12 s), plan.json, tar (~50 MB, ~1 s)
TERM_AFTER_S, KILL_AFTER_S = 4.0, 12.0  # after the deadline: SIGTERM, then SIGKILL, to runs still alive
STARTUP_S = 30.0  # process start to first step on the H200 (imports, model, CUDA context, Triton JIT): a guess
# Recorded basis of the prediction: convergence study, H200, batch 64, max_len 64 (the same padded length as
# here: no text is longer than 76 tokens), r=16, bf16 autocast, 4 processes sharing the GPU
# (data/gpu/convergence/summary.json, runs.*.median_s_per_step: 0.099-0.111 s).
RECORDED_S_PER_STEP = (0.099, 0.111)


def predict(plan: list[RunSpec], cfg, wall_s: float) -> dict:
    """Steps each run can reach before the deadline, at the recorded time per step (host-bound:
    each process on its own core) and at a GPU-bound guess: 13 processes time-sharing one GPU,
    each step ~10 ms of GPU work (about 2500 small kernels), so ~0.13 s per step and process."""
    train_s = wall_s - PACK_RESERVE_S - STARTUP_S - FINAL_MARGIN_S
    n_evals = cfg.max_steps // cfg.eval_every
    eval_s = 0.3  # 912 texts in 8 host-bound forwards
    lo, hi = RECORDED_S_PER_STEP
    gpu_bound = max(hi, 0.010 * len(plan))
    out = {"train_s": train_s, "processes": len(plan), "s_per_step_host_bound": [lo, hi],
           "s_per_step_gpu_bound_guess": gpu_bound}
    for label, sps in (("steps_host_bound", lo), ("steps_gpu_bound", gpu_bound)):
        per_step = sps + eval_s / cfg.eval_every
        out[label] = int(min(cfg.max_steps, train_s / per_step))
    out["reaches_max_steps"] = out["steps_host_bound"] >= cfg.max_steps
    out["note"] = ("no run reaches max_steps at these speeds: each ends by plateau or deadline; in the recorded "
                   "r=16, lr=1e-4 run MRR@10 still gained 0.0095 between steps 1200 and 1600, so lr=1e-4 runs are "
                   "expected to plateau late (> 2000 steps) or hit the deadline; lr=1e-3 runs to plateau earlier"
                   if not out["reaches_max_steps"] else "")
    out["n_evals_max"] = n_evals
    return out


RECORDED_PROCESSES = 13  # processes side by side in the launch of data/adapters/trained (its manifest's processes)
PACK_S = 5.0  # plan.json and the tar of one seeds launch (~10 MB): measured ~1 s for 50 MB


def predict_seeds_wall(plan: list[RunSpec], wall_s: float, manifest: dict | None = None) -> dict:
    """The wall time of a seeds launch from the recorded launch of the same configurations (H200, seed 0,
    13 processes on one GPU: its manifest's ``processes.*.wall_s``, ``runs.*.capture_s``).

    Per run: the recorded process wall of its (rank, lr, rsLoRA) configuration, times ``max(1, n / 13)``
    (GPU-bound: ``n`` processes time-share the GPU as 13 did; fewer are not assumed faster), plus one
    capture per evaluation up to its recorded best step (the most a new-best capture can add: each
    evaluation a new best) at the run's largest recorded capture time.  The launch ends with its slowest run,
    then packs.  Not predicted: a seed whose plateau comes later than seed 0's (the launch's deadline,
    ``wall_s - PACK_RESERVE_S``, then stops it: stop reason ``deadline``)."""
    import json

    if manifest is None:
        manifest = json.loads(TRAINED.path("manifest").read_text())
    every = manifest["config"]["eval_every"]
    rec = {}
    for name, r in manifest["runs"].items():
        s = r["spec"]
        if r["role"] != "grid":
            continue
        rec[(s["rank"], s["lr"], s["use_rslora"])] = {
            "wall_s": manifest["processes"][name]["wall_s"], "best_step": r["best_step"],
            "capture_s_max": max(r["capture_s"].values())}
    factor = max(1.0, len(plan) / RECORDED_PROCESSES)
    runs = {}
    for spec in plan:
        k = (spec.rank, spec.lr, spec.use_rslora)
        if k not in rec:
            raise ValueError(f"{spec.name}: no recorded run of rank {spec.rank}, lr {spec.lr:g}, rsLoRA "
                             f"{spec.use_rslora} to predict it from")
        r = rec[k]
        runs[spec.name] = r["wall_s"] * factor + (r["best_step"] // every) * r["capture_s_max"]
    slowest = max(runs.values())
    total = slowest + PACK_S
    return {"basis": "data/adapters/trained manifest: recorded process wall per configuration (H200, 13 processes)",
            "processes": len(plan), "gpu_share_factor": factor, "run_wall_s": runs, "slowest_run_s": slowest,
            "launch_wall_s": total, "wall_s": wall_s,
            "fits": bool(slowest <= wall_s - PACK_RESERVE_S)}


def _log_to(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    return log


def launch(plan: list[RunSpec], plan_name: str, cfg, out: Path, *, wall_s: float, base_path=None,
           git_sha: str | None = None, python: str = sys.executable, poll_s: float = 1.0) -> dict:
    """Start every run of ``plan`` as its own process, wait (deadline ``wall_s - PACK_RESERVE_S``
    after now), then write ``plan.json`` and pack the runs into ``part-K.tar`` under ``out``."""
    from ...repro.provenance import save_json

    t0 = time.time()
    out = Path(out)
    work = out / "work"
    log = _log_to(out / "launch.log")
    deadline_at = t0 + wall_s - PACK_RESERVE_S
    pred = predict(plan, cfg, wall_s)
    log(f"{len(plan)} runs ({plan_name}, {cfg.device}), wall {wall_s:.0f} s, training deadline in "
        f"{deadline_at - t0:.0f} s; predicted steps {pred['steps_gpu_bound']}-{pred['steps_host_bound']}")
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    procs = {}
    (work / "logs").mkdir(parents=True, exist_ok=True)
    for spec in plan:
        cmd = run_command(spec, plan_name, cfg, work, deadline_at=deadline_at, base_path=base_path, python=python)
        f = open(work / "logs" / f"{spec.name}.log", "w")
        procs[spec.name] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), f, time.time())
    termed = killed = False
    last_report, ended = time.time(), {}
    while any(p.poll() is None for p, _, _ in procs.values()):
        now = time.time()
        ended.update({n: now for n, (p, _, _) in procs.items() if n not in ended and p.poll() is not None})
        if not termed and now > deadline_at + TERM_AFTER_S:
            termed = True
            for name, (p, _, _) in procs.items():
                if p.poll() is None:
                    log(f"{name}: still running {TERM_AFTER_S:.0f} s after the deadline: SIGTERM")
                    p.send_signal(signal.SIGTERM)
        if not killed and now > deadline_at + KILL_AFTER_S:
            killed = True
            for name, (p, _, _) in procs.items():
                if p.poll() is None:
                    log(f"{name}: SIGKILL (its results are lost)")
                    p.kill()
        if now - last_report > 60:
            last_report = now
            for name in procs:
                lines = [ln for ln in (work / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
                         if ln.startswith(name + ":")]
                log(f"  {lines[-1] if lines else name + ': (starting)'}")
        time.sleep(poll_s)
    results = {}
    for name, (p, f, started) in procs.items():
        f.close()
        lines = (work / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        results[name] = {"returncode": p.returncode, "log_tail": lines[-8:],
                         "wall_s": ended.get(name, time.time()) - started}
        if p.returncode != 0:
            log(f"{name}: exit {p.returncode}: " + " | ".join(lines[-3:]))
    summary = {"plan_name": plan_name, "plan": [dataclasses.asdict(s) | {"name": s.name, "role": s.role}
                                                for s in plan],
               "config": dataclasses.asdict(cfg), "wall_s": wall_s, "deadline_after_s": deadline_at - t0,
               "prediction": pred, "processes": results, "git_sha": git_sha, "torch": torch.__version__,
               "elapsed_before_pack_s": time.time() - t0, "base": base_info(base_path)}
    save_json(summary, work / "plan.json", params=summary["config"], producer=TRAINED.producer)
    parts = pack(work, out)
    summary["parts"] = [p.name for p in parts]
    summary["elapsed_s"] = time.time() - t0
    save_json(summary, out / "plan.json", params=summary["config"], producer=TRAINED.producer)
    log(f"packed {len(parts)} parts ({sum(p.stat().st_size for p in parts) / 2**20:.1f} MiB) in "
        f"{summary['elapsed_s']:.0f} s total; {sum(r['returncode'] == 0 for r in results.values())}/{len(plan)} runs ok")
    return summary


def run_command(spec: RunSpec, plan_name: str, cfg, work: Path, *, deadline_at: float | None,
                base_path=None, python: str = sys.executable) -> list[str]:
    """The command line of one run's process (``dora-num record adapters-gpu --run NAME ...``)."""
    cmd = [python, "-m", "dora_num", "record", "adapters-gpu", "--run", spec.name, "--work", str(work),
           "--device", cfg.device] + (["--smoke"] if plan_name.endswith("smoke") else [])
    if plan_name.startswith("seeds"):
        cmd += ["--plan", "seeds", "--seeds", str(spec.seed)]
    if deadline_at is not None:
        cmd += ["--deadline-at", repr(deadline_at)]
    if base_path is not None:
        cmd += ["--base", str(base_path)]
    return cmd


def pack(work: Path, out: Path, *, part_bytes: int = PART_BYTES, max_parts: int = MAX_PARTS) -> list[Path]:
    """Every file under ``work`` into ``out/part-K.tar`` (each at most ``part_bytes``), then ``work`` removed.
    A file larger than ``part_bytes`` or more than ``max_parts`` parts is an error (the device returns at
    most 8 files of 16 MiB)."""
    import shutil

    files = sorted(p for p in Path(work).rglob("*") if p.is_file())
    # tar: a 512-byte header per file (PAX: one more for long names) and its data padded to 512; the
    # archive ends with two zero blocks, padded to a 10240-byte record
    overhead = 2 * 512 + tarfile.RECORDSIZE
    groups, size = [[]], overhead
    for f in files:
        n = 2 * 512 + -(-f.stat().st_size // 512) * 512
        if n + overhead > part_bytes:
            raise ValueError(f"{f} is {f.stat().st_size} bytes, more than a part may hold ({part_bytes})")
        if size + n > part_bytes:
            groups.append([])
            size = overhead
        groups[-1].append(f)
        size += n
    if len(groups) > max_parts:
        raise ValueError(f"{len(groups)} parts needed, at most {max_parts} come back from the device")
    parts = []
    for k, group in enumerate(groups):
        path = Path(out) / f"part-{k}.tar"
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for f in group:
                tar.add(f, arcname=str(f.relative_to(work)), recursive=False)
        parts.append(path)
    shutil.rmtree(work)
    return parts
