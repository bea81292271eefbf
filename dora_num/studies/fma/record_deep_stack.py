"""``dora-num record deep-stack``: the paper's failing configuration on the GPU (an approximate division, an
approximate sqrt and contraction inside a fused DoRA kernel) in a 48-layer stack, final-logit cosine against
float64 (:mod:`.deep_stack`, whose docstring holds the prediction).

Writes one small CSV (one row per seed, depth and path) with a provenance sidecar, and ``device.json``, into
``--out``; ``--ingest`` records such a folder into ``data/``.  About 1 min on one H100.  ``--smoke``: tiny
sizes; on a machine without CUDA it runs on the CPU under ``TRITON_INTERPRET=1``, where the interpreter's
division and sqrt are correctly rounded (every kernel variant is then ``kernel_rn``): a check of the harness.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pandas as pd
import torch

from ...repro import recording as recorded
from ...repro.provenance import save_dataframe
from ...repro.recording import parser as recorder_parser, require_cuda
from .datasets import DEEP_STACK

SEEDS = (0, 1, 2)


def measure_all(shape, seeds, device) -> pd.DataFrame:
    from . import deep_stack as D  # Triton is imported here, after the interpreter's switch is read

    rows = []
    for seed in seeds:
        t = time.time()
        rows += D.measure(D.make_stack(shape, seed, device), seed)
        deep = max(shape.depths)
        worst = {r["path"]: r["one_minus_cos_max"] for r in rows if r["seed"] == seed and r["depth"] == deep}
        print(f"[deep-stack] seed {seed}: {time.time() - t:.1f} s; 1 - cos (worst token, depth {deep}) "
              + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()), flush=True)
    return pd.DataFrame(rows)


def build_parser(prog: str = "dora-num record deep-stack", name: str = "deep-stack"):
    p = recorder_parser(prog, __doc__, smoke="tiny sizes (on a machine without CUDA: the CPU, TRITON_INTERPRET=1)",
                        out=f"folder for {DEEP_STACK.filename()} and {recorded.MACHINE_FILE}")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    return p


def ingest_args(a) -> list[Path]:
    return recorded.ingest_folder(a.ingest, a.out or DEEP_STACK.dest(), producer=DEEP_STACK.producer,
                                  names=(DEEP_STACK.filename(),), git_sha=a.git_sha)


def record(a) -> int:
    cuda = torch.cuda.is_available()
    if not a.smoke:
        require_cuda("deep-stack", cuda)
    elif not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("dora-num record deep-stack --smoke on a machine without CUDA needs TRITON_INTERPRET=1 "
                         "in the environment (the kernel then runs in Triton's interpreter)")
    from . import deep_stack as D

    shape = D.SMOKE if a.smoke else D.FULL
    device = "cuda" if cuda else "cpu"
    t = time.time()
    df = measure_all(shape, a.seeds, device)
    secs = time.time() - t
    desc = recorded.describe_machine(a.git_sha, smoke=a.smoke, wall_s=round(secs, 1))
    params = {"shape": vars(shape) | {"depths": list(shape.depths)}, "seeds": list(a.seeds), "smoke": a.smoke,
              "wall_s": round(secs, 1), "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    save_dataframe(df, DEEP_STACK.path(folder=a.out), float_format="%.6g", params=params,
                   producer=DEEP_STACK.producer, device=desc["device"],
                   extra={"measured_at_git_sha": desc["git_sha"]})
    recorded.write_machine(a.out, desc)
    print(f"[deep-stack] {len(df)} rows in {secs:.0f} s on {desc['device'].get('name') or 'the CPU'}: "
          f"{DEEP_STACK.path(folder=a.out)}")
    return 0
