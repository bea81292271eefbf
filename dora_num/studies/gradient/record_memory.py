"""Notebook 06's measured memory: the training step of :mod:`~dora_num.studies.gradient.memory_model`
run for real, its peak taken, beside the model's prediction.

:func:`measure_peak` runs the step and measures: on CUDA,
``torch.cuda.max_memory_allocated`` minus the level before the model was built
(after a warm-up matmul, so cuBLAS's workspace is excluded); on CPU, the dynamic
part only (:func:`dora_num.oracles.measure_cpu_allocations`: the profiler's
allocator events during the step, above the level at its start), compared with
``peak - static`` of the model (:func:`compare`).

``dora-num record memory --out DIR [--base MODEL_DIR]`` runs the H200 validation
(:func:`gpu_configs`) in one process;
``dora-num record memory --ingest DIR --git-sha SHA`` records it into
``data/gpu/memory/``.  The out-of-sample check (:mod:`~dora_num.studies.gradient.memory_holdout`):
``--predict-holdout`` registers the predictions here, on the CPU, before any measurement;
``--holdout --out DIR`` measures the registered configurations on one GPU (under 2 minutes on an
H100; ``--smoke``: the stack ones at CPU sizes, on the CPU where there is no GPU) and prints the
verdict against the registered predictions; ``--ingest DIR`` records whichever tables DIR holds.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, replace
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as Fn
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...adapters.model import load_base_model, mean_pool
from ...adapters.train import TrainConfig, inject_dora
from ...ops.layer import DoRALinear
from ...ops import finite as _finite
from ...oracles import measure_cpu_allocations
from ...repro import recording as recorded
from ...repro.recording import parser as recorder_parser, require_cuda
from . import memory_holdout as holdout
from .datasets import MEMORY, MEMORY_HOLDOUT, MEMORY_HOLDOUT_PREDICTIONS
from .memory_model import MINILM, NORMS, TOLERANCE, MemoryConfig, predict_peak

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------
# The measured step
# --------------------------------------------------------------------------

class _Stack:
    """``x -> gelu(DoRALinear(x))`` x n_layers (``cfg.arch == "stack"``)."""

    @staticmethod
    def build(cfg: MemoryConfig, device):
        dt = _DTYPES[cfg.dtype]
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        layers = []
        for _ in range(cfg.n_layers):
            lin = nn.Linear(cfg.hidden, cfg.hidden, bias=False, device=device, dtype=dt)
            lin.weight.requires_grad_(False)
            # adapter_dtype=None: A, B in W's dtype and m fp32, the memory model's (and the recorded runs') setting
            lay = DoRALinear.from_linear(lin, cfg.rank, compose_path=cfg.compose, chunk_bytes=cfg.chunk_bytes,
                                         norm=cfg.norm, adapter_dtype=None)
            with torch.no_grad():
                lay.lora_B.normal_(0, 1e-3)
            layers.append(lay)
        torch.random.set_rng_state(gen_state)
        model = nn.ModuleList(layers)
        x = torch.randn(cfg.batch * cfg.seq, cfg.hidden, device=device, dtype=dt)
        return model, x

    @staticmethod
    def loss(model, x, cfg):
        def block(lay, h):
            return Fn.gelu(lay(h))

        h = x
        for lay in model:
            h = checkpoint(block, lay, h, use_reentrant=False) if cfg.checkpointing else block(lay, h)
        return (h.float() ** 2).mean()


def _bert_build(cfg: MemoryConfig, device, base_path):
    if cfg.targets != "all":  # inject_dora below adapts every encoder linear
        raise ValueError(f"measure_peak adapts every linear of the encoder (targets='all'); targets="
                         f"{cfg.targets!r} is modelled by predict_peak, not measured")
    dt = _DTYPES[cfg.dtype]
    model, _ = load_base_model(base_path, dtype=dt)
    inject_dora(model, TrainConfig(rank=cfg.rank, compose_path=cfg.compose, progress=False), norm=cfg.norm)
    model.to(device)
    for n, p in model.named_parameters():
        p.requires_grad_(("lora_" in n) or n.endswith("magnitude"))
    if cfg.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train() if cfg.dropout else model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _bert_loss(model, batch, cfg):
    out = model(**batch).last_hidden_state
    return (mean_pool(out.float(), batch["attention_mask"]) ** 2).mean()


def adamw_eps(dtype: str) -> float:
    """AdamW's ``eps`` for parameters of ``dtype``: torch's 1e-8, raised to fp16's smallest normal (6.1e-5).

    Pure fp16 AdamW with 1e-8 divides by zero: 1e-8 rounds to 0 in fp16, and so does ``(1 - beta2) g^2``
    for every ``|g| < 5.5e-3`` (under fp16's smallest subnormal, 6e-8), so ``denom = sqrt(v) + eps = 0``
    and the first step writes NaN (``0/0``, a zero gradient) or -Inf into A and B (the H100 holdout's
    fp16 configuration: ``A contains non-finite values``, every element NaN).  A larger ``eps`` changes
    the update, not a byte of the step's memory (the states stay fp16)."""
    return float(torch.finfo(torch.float16).tiny) if dtype == "fp16" else 1e-8


def measure_peak(cfg: MemoryConfig, *, device: str = "cpu", base_path=None) -> dict:
    """Measured peak of the second training step (bytes): ``{"peak": ..., "kind": ...}``.

    CUDA: absolute peak above the pre-model baseline (``kind="total"``), compared
    with ``predict_peak()["peak"]``.  CPU: dynamic part only (``kind="dynamic"``).
    """
    cfg.validate()
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    # A deferred finiteness flag (ops/finite.py, CUDA's default) keeps its call's layer alive until a later
    # operator call reads it: the last forward's (and a checkpointed recompute's, on the autograd engine's
    # thread) outlive the step.  Read here, before the baseline, they would otherwise be freed during this
    # configuration's first forward, after its baseline counted them, and its peak comes out low by one or
    # two of the previous configuration's layers (the H100 holdout at 5f01c08: a peak of -620 MB).
    _finite.check_pending(all_threads=True)
    if cuda:
        # the previous configuration's tensors, if a reference cycle keeps them, are collected now, not in the
        # middle of this one's build: else the baseline counts them and the peak above it comes out too low (the
        # first holdout run on the H100 measured 9.6 MB for a model of 268 MB of weights, after a 2.5 GB one)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        a = torch.randn(256, 256, device=dev)
        (a @ a).sum().item()  # cuBLAS workspace, outside the model's budget
        del a
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
    if cfg.arch == "stack":
        model, inp = _Stack.build(cfg, dev)
        loss_fn = _Stack.loss
    else:
        model, inp = _bert_build(cfg, dev, base_path)
        loss_fn = _bert_loss
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, eps=adamw_eps(cfg.dtype), foreach=False)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, inp, cfg)
        loss.backward()
        opt.step()
        return float(loss.detach())

    step()  # creates the optimizer states
    if cuda:
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        res = {"peak": int(torch.cuda.max_memory_allocated() - baseline), "kind": "total",
               "seconds": time.perf_counter() - t0}
    else:
        opt.zero_grad(set_to_none=True)
        m = measure_cpu_allocations(step)
        res = {"peak": int(m["peak_extra"]), "kind": "dynamic"}
    _finite.check_pending(all_threads=True)  # this step's last flags: nothing of the model outlives the call
    del model, opt, params, inp
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        res["left_allocated"] = int(torch.cuda.memory_allocated() - baseline)  # 0 unless something outlived the step
    return res


def compare(cfgs, *, device: str = "cpu", base_path=None):
    """Predicted vs measured, one row per config (tidy; ``rel_err`` of the prediction)."""
    rows = []
    for cfg in cfgs:
        pred = predict_peak(cfg)
        meas = measure_peak(cfg, device=device, base_path=base_path)
        key = "peak" if meas["kind"] == "total" else "dynamic"
        rows.append({**asdict(cfg), **{f"pred_{k}": v for k, v in pred.items()}, "measured": meas["peak"],
                     "compared": key, "predicted": pred[key],
                     "rel_err": (pred[key] - meas["peak"]) / meas["peak"], "device": device,
                     # what outlived the step on CUDA: 0, else the next configuration's baseline counts it
                     **({"left_allocated": meas["left_allocated"]} if "left_allocated" in meas else {})})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# GPU validation (one process, <= 3 minutes on the H200)
# --------------------------------------------------------------------------

def gpu_configs(smoke: bool = False) -> list[MemoryConfig]:
    """The H200 validation set: a wide stack (hidden 8192, 4 layers, r=384, 8192 tokens) x
    norms x checkpointing x compose, the same stack at 256 tokens (where the norm
    transient sets the peak), and the MiniLM harness (fp32 and bf16)."""
    T = (2, 512) if smoke else (4, 2048)
    wide = MemoryConfig(arch="stack", hidden=2048 if smoke else 8192, n_layers=2 if smoke else 4, rank=64 if smoke
                        else 384, dtype="bf16", batch=T[0], seq=T[1], fp32_out_mm=True)
    cfgs = [replace(wide, norm=n, checkpointing=c) for n in NORMS for c in (False, True)]
    cfgs += [replace(wide, compose="fused"), replace(wide, dtype="fp32", fp32_out_mm=False)]
    cfgs += [replace(wide, batch=1, seq=256, norm=n) for n in NORMS]  # few tokens: the norm transient decides
    mini = replace(MINILM, batch=8 if smoke else 64, seq=64 if smoke else 128)
    cfgs += [mini, replace(mini, checkpointing=True), replace(mini, dtype="bf16", fp32_out_mm=True),
             replace(mini, norm="dense")]
    return cfgs


def run_measure(out: Path, *, base_path=None, smoke: bool = False, git_sha: str | None = None) -> Path:
    require_cuda("memory", torch.cuda.is_available(), "it records torch.cuda.max_memory_allocated")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cfg in gpu_configs(smoke):
        t0 = time.perf_counter()
        try:
            df = compare([cfg], device="cuda", base_path=base_path)
            row = df.iloc[0].to_dict()
            row["error"] = ""
        except Exception as e:  # noqa: BLE001 - record and continue: one call of GPU time
            row = {**asdict(cfg), "error": repr(e)[:300]}
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"[memory] {cfg.arch} h={cfg.hidden} {cfg.dtype} norm={cfg.norm} ckpt={cfg.checkpointing} "
              f"compose={cfg.compose}: measured={row.get('measured')} predicted={row.get('predicted')} "
              f"rel_err={row.get('rel_err')} {row['error']}", flush=True)
    pd.DataFrame(rows).to_csv(MEMORY.path("peaks", out), index=False, lineterminator="\n")
    recorded.write_machine(out, recorded.describe_machine(git_sha, smoke=smoke, tolerance=TOLERANCE))
    return MEMORY.path("peaks", out)


def ingest(src: Path, dest: Path | None = None, *, git_sha: str | None = None) -> list[Path]:
    """Copy a recorder's folder's tables (``memory_peaks.csv`` of the validation, the holdout's table, or
    both) into ``data/gpu/memory/`` with provenance (the GPU's description from the folder's ``device.json``)."""
    meta = recorded.read_machine(src)
    sets = [d for d in (MEMORY, MEMORY_HOLDOUT) if (Path(src) / d.filename()).is_file()]
    if not sets:
        raise FileNotFoundError(f"{src} holds neither {MEMORY.filename()} nor {MEMORY_HOLDOUT.filename()}")
    if MEMORY_HOLDOUT in sets and meta.get("smoke"):  # CPU sizes, other configurations: not the registered set
        raise ValueError(f"{src} is a --smoke run of the holdout, not its measurement: nothing ingested")
    out = []
    for d in sets:
        out += recorded.ingest_folder(src, dest or d.dest(), producer=d.producer, names=(d.filename(),),
                                      git_sha=git_sha, params={k: meta.get(k) for k in ("tolerance", "smoke", "holdout")})
    return out


def build_parser(prog: str = "dora-num record memory", name: str = "memory"):
    p = recorder_parser(prog, __doc__, smoke="small sizes (with --holdout: CPU sizes, on the CPU without a GPU)",
                        out=f"output folder ({MEMORY.filename()} or, with --holdout, {MEMORY_HOLDOUT.filename()}; "
                            f"{recorded.MACHINE_FILE})", out_required=False)
    p.add_argument("--base", type=Path, default=None, help="MiniLM model folder (default: the packaged one)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--holdout", action="store_true",
                   help="measure the pre-registered out-of-sample configurations (memory_holdout.holdout_configs)")
    g.add_argument("--predict-holdout", action="store_true",
                   help="register the holdout's predictions under data/ (CPU; once, before any measurement)")
    return p


def ingest_args(a) -> list[Path]:
    return ingest(a.ingest, a.out, git_sha=a.git_sha)


def write_predictions(dest=None, *, git_sha: str | None = None) -> Path:
    """Register the holdout's predictions (``dest``: a data folder, default the data set's under ``data/``):
    written atomically with provenance (the commit that predicted, the tolerance), and only where no
    different registration exists: the holdout is predicted once, before it is measured."""
    from ...repro.provenance import git_state, save_dataframe

    d = MEMORY_HOLDOUT_PREDICTIONS
    path = d.path("predictions", dest) if dest is not None else d.dest() / d.filename("predictions")
    table = holdout.predictions_table()
    if path.is_file():
        changes = holdout.prediction_changes(pd.read_csv(path), table)
        if changes:
            raise ValueError(f"{path} registers other predictions ({'; '.join(changes[:3])}): the holdout is "
                             "predicted once, before it is measured; a model changed since is disclosed, not "
                             "re-predicted (remove the file only to register a new holdout set)")
    state = git_state()
    return save_dataframe(table, path, producer=d.producer,
                          params={"tolerance": TOLERANCE, "configurations": len(table), "compared": holdout.COMPARED},
                          extra={"predicted_at_git_sha": git_sha or state.get("sha"),
                                 "predicted_with_dirty_tree": state.get("dirty"),
                                 "model": "dora_num.studies.gradient.memory_model.predict_peak"})


def run_holdout(out: Path, *, base_path=None, smoke: bool = False, git_sha: str | None = None,
                device: str | None = None) -> tuple[Path, "holdout.Verdict"]:
    """Measure the registered holdout (``smoke``: :func:`~dora_num.studies.gradient.memory_holdout.smoke_configs`)
    into ``out``, one row per configuration in the registered order, and its verdict.  Against the
    REGISTERED predictions (``predicted``; ``predicted_now``: today's model, for the record); in a smoke
    run, where nothing is registered, against the run's own (on the CPU: the dynamic part)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not smoke:
        require_cuda("memory --holdout", device == "cuda", "it records torch.cuda.max_memory_allocated")
    cases = holdout.smoke_configs() if smoke else holdout.holdout_configs()
    registered = None if smoke else holdout.registered_predictions()
    if registered is not None:
        changes = holdout.prediction_changes(registered)
        for c in changes[:5]:  # disclosed in the log; the verdict uses the registered numbers
            print(f"[memory holdout] the model changed since registration: {c}", flush=True)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, h in enumerate(cases):
        t0 = time.perf_counter()
        row = {"order": i, "id": h.id, **asdict(h.config)}
        try:
            r = compare([h.config], device=device, base_path=base_path).iloc[0]
            row.update(measured=int(r["measured"]), compared=r["compared"], predicted_now=int(r["predicted"]), error="",
                       left_allocated=r.get("left_allocated", float("nan")))
        except Exception as e:  # noqa: BLE001 - record and continue: one call of GPU time
            row.update(measured=float("nan"), compared="", predicted_now=float("nan"), error=repr(e)[:300])
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
    table = pd.DataFrame(rows)
    reg = registered if registered is not None else table.rename(columns={"predicted_now": "predicted"})
    v = holdout.verdict(table, reg[["order", "id", "predicted"]])
    table = table.merge(v.table[["id", "predicted", "rel_err", "status"]], on="id")
    table["within_tolerance"] = table["status"] == "within"
    table["device"] = name
    for r in table.itertuples():
        print(f"[memory holdout] {r.order:2d} {r.id:36s} measured={r.measured} predicted={r.predicted} "
              f"rel_err={r.rel_err:+.4f} {r.status} {r.error}", flush=True)
    print(f"[memory holdout] {v.summary()}", flush=True)
    path = MEMORY_HOLDOUT.path(None, out)
    table.to_csv(path, index=False, lineterminator="\n")
    recorded.write_machine(out, recorded.describe_machine(git_sha, smoke=smoke, tolerance=TOLERANCE, holdout=True,
                                                          first_miss=v.first_miss, max_abs_rel_err=v.max_abs_rel_err))
    return path, v


def record(a) -> int:
    if a.predict_holdout:
        print(write_predictions(a.out, git_sha=a.git_sha))
        return 0
    if a.out is None:  # a usage error (exit 2), as every recorder's missing --out
        build_parser().error("--out DIR is required (or --ingest DIR); --predict-holdout needs neither")
    if a.holdout:
        print(run_holdout(a.out, base_path=a.base, smoke=a.smoke, git_sha=a.git_sha)[0])
        return 0
    print(run_measure(a.out, base_path=a.base, smoke=a.smoke, git_sha=a.git_sha))
    return 0
