"""Train the early-training DoRA adapters of notebook 01 (CPU, 50 steps, a few minutes per run).

The trained adapters (H200, until MRR@10 plateaus) come from :mod:`.record_trained`; their early captures
(steps 10-300, batch 64) replaced the grid below in notebook 01, and only the agreement runs
(``agreement.csv``) are committed: the grid and its export are written when asked for, not read by any notebook.

    dora-num record adapters                 # the full grid + agreement runs
    dora-num record adapters --ranks 16 --lrs 1e-3
    dora-num record adapters --agreement-only

The method in full: docs/methods.md, studies/cancellation/record_adapters.py.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pandas as pd
import torch

from ...adapters.model import minilm_path
from ...adapters.peft_io import export_peft_dora
from ...adapters.train import TrainConfig, config_dict, train
from ...repro.provenance import save_dataframe, write_artifact
from ...repro.recording import parser as recorder_parser
from .analysis import agreement_verdict
from .datasets import AGREEMENT

RANKS = (8, 16, 64, 128)
LRS = (1e-3, 1e-4)
# Sized for the shared 2-core CPU machine, one torch thread per run, two runs at a time: the
# recorded runs took a median 4.2-21 s per step at batch 16 / max_len 32 on a loaded machine
# (data/adapters/runs/*_history.csv, column seconds), about the same for every rank since the
# frozen MiniLM dominates.  On a free machine or a GPU raise --steps.
STEPS = 50
CAPTURE = (10, 25, 50)
BATCH = 16
MAX_LEN = 32
EXPORT = (16, 1e-3)
AGREEMENT_STEPS = 20
ADAPTER_DIR = "minilm_dora_r16"


def run_name(rank: int, lr: float) -> str:
    return f"r{rank}_lr{lr:g}"


def g_npz_bytes(g_by_step: dict[int, dict[str, np.ndarray]]) -> bytes:
    steps = sorted(g_by_step)
    names = sorted(g_by_step[steps[0]])
    sizes = [g_by_step[steps[0]][n].size for n in names]
    arr = np.stack([np.concatenate([g_by_step[s][n] for n in names]).astype(np.float32) for s in steps])
    buf = io.BytesIO()
    np.savez_compressed(buf, g_minus_1=arr, steps=np.asarray(steps, dtype=np.int64),
                        modules=np.asarray(names), offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    return buf.getvalue()


def load_g_npz(path) -> dict[int, dict[str, np.ndarray]]:
    """Inverse of :func:`g_npz_bytes`: ``{step: {module: g - 1 (float32)}}``."""
    with np.load(path, allow_pickle=False) as z:
        arr, steps, names, off = z["g_minus_1"], z["steps"], z["modules"], z["offsets"]
        return {int(s): {str(n): arr[i, off[j]:off[j + 1]] for j, n in enumerate(names)} for i, s in enumerate(steps)}


def run_one(rank: int, lr: float, *, steps: int = STEPS, capture=CAPTURE, out=None, progress=True) -> dict:
    out = out or AGREEMENT.dest()
    cfg = TrainConfig(rank=rank, lr=lr, steps=steps, batch_size=BATCH, max_len=MAX_LEN, seed=0,
                      capture_steps=tuple(capture), progress=progress,
                      eval_steps=(0, steps) if (rank, lr) == EXPORT else (steps,))  # step 0 = the base model, once
    t0 = time.perf_counter()
    res = train(cfg)
    name = run_name(rank, lr)
    prov = dict(params=config_dict(cfg), seed=cfg.seed, producer=AGREEMENT.producer,
                extra={"wall_seconds": time.perf_counter() - t0, "seconds_per_step_median": res.seconds_per_step})
    runs = out / "runs"
    write_artifact(runs / f"{name}.npz", g_npz_bytes(res.g_minus_1), **prov)
    save_dataframe(pd.DataFrame(res.history).assign(run=name, rank=rank, lr_peak=lr), runs / f"{name}_history.csv", **prov)
    save_dataframe(pd.DataFrame(res.evals).assign(run=name, rank=rank, lr_peak=lr), runs / f"{name}_evals.csv", **prov)
    if (rank, lr) == EXPORT:
        export_peft_dora(res.model, out / ADAPTER_DIR, base_model_name_or_path="sentence-transformers/all-MiniLM-L6-v2",
                         **{**prov, "extra": {**prov["extra"], "base_weights": str(minilm_path())}})
    e = {d["step"]: d for d in res.evals}
    return {"run": name, "s_per_step": res.seconds_per_step, "mrr_final": e[steps]["mrr10"],
            "mrr_base": e[0]["mrr10"] if 0 in e else None}


def run_agreement(steps: int = AGREEMENT_STEPS, out=None, progress=True) -> pd.DataFrame:
    out = out or AGREEMENT.dest()
    base = TrainConfig(rank=16, lr=1e-3, steps=steps, batch_size=BATCH, max_len=MAX_LEN, seed=0, progress=progress)
    variants = {"dora_num": {}, "peft": {"backend": "peft"}, "dora_num_perturbed": {"perturb_seed": 1}}
    cols = {}
    for label, ch in variants.items():
        cfg = TrainConfig(**{**config_dict(base), **ch})
        cfg.capture_steps, cfg.eval_steps = (), ()
        res = train(cfg)
        cols[label] = [h["loss"] for h in res.history]
        cols[f"s_per_step_{label}"] = [h["seconds"] for h in res.history]
    df = pd.DataFrame({"step": np.arange(1, steps + 1), **cols})
    save_dataframe(df, AGREEMENT.path("runs", out), params=config_dict(base), seed=0, producer=AGREEMENT.producer)
    return df


def build_parser(prog: str = "dora-num record adapters", name: str = "adapters"):
    p = recorder_parser(prog, __doc__, ingest=None, smoke=None, out="output folder (default data/adapters/)",
                        out_required=False)
    p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    p.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--agreement-only", action="store_true", help="only the PEFT agreement runs (what is committed)")
    p.add_argument("--no-agreement", action="store_true")
    p.add_argument("--agreement-steps", type=int, default=AGREEMENT_STEPS)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def record(a) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.agreement_only:
        order = sorted(((r, lr) for r in a.ranks for lr in a.lrs), key=lambda k: (k != EXPORT, -k[1], k[0]))
        for r, lr in order:
            print(run_one(r, lr, steps=a.steps, out=a.out), flush=True)
    if not a.no_agreement:
        df = run_agreement(a.agreement_steps, out=a.out)
        print(agreement_verdict(df), flush=True)
    return 0
