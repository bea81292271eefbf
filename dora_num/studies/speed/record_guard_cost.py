"""What the factored norm's cancellation guard costs on the GPU: guard on vs off, same run, interleaved.

    dora-num record guard-cost --out DIR [--smoke]    # on a CUDA machine
    dora-num record guard-cost --ingest DIR [--git-sha SHA]   # here: -> data/gpu/guard_cost.csv

Measured per configuration (``W`` bf16; ``A``, ``B`` bf16 or fp32; a realistic adapter,
``||sBA|| = 5% ||W||`` per row, on which the guard must not fire: checked, and the norms with the
guard on and off are checked bitwise equal before anything is timed), each with
``on_cancellation="recompute"`` (guard on) and ``"off"``, alternated over ``ROUNDS`` rounds of
``triton.testing.do_bench`` medians (L2 flushed):

The method in full: docs/methods.md, studies/speed/record_guard_cost.py.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ...repro.recording import parser as recorder_parser
from ...repro.recording import MACHINE_FILE
from .datasets import GUARD_COST

ROUNDS = 5
FULL = [(8192, 8192, 384, "bfloat16"), (8192, 8192, 384, "float32"), (4096, 4096, 384, "bfloat16")]
SMOKE = [(1024, 1024, 64, "bfloat16"), (1024, 1024, 64, "float32")]
UPDATE_RATIO = 0.05  # ||sBA|| / ||W|| per row: a realistic adapter (dora_num.oracles.perturbed_adapter's default)


def _inputs(d_out, d_in, r, ab_dtype, device="cuda", seed=0):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    W = (torch.randn(d_out, d_in, device=device, generator=gen) / math.sqrt(d_in)).bfloat16()
    A = (torch.rand(r, d_in, device=device, generator=gen) * 2 - 1) / math.sqrt(d_in)
    s = 192 / math.sqrt(r)  # rsLoRA alpha = 192
    B = torch.randn(d_out, r, device=device, generator=gen)
    upd = (s * (B @ A)).norm(dim=1, keepdim=True)
    B = B * (UPDATE_RATIO * W.float().norm(dim=1, keepdim=True) / upd)
    dt = getattr(torch, ab_dtype)
    m = W.float().norm(dim=1) * (1 + 1e-3 * torch.randn(d_out, device=device, generator=gen))
    return W, A.to(dt).contiguous(), B.to(dt).contiguous(), s, m


def prepare(d_out: int, d_in: int, r: int, ab_dtype: str, device: str = "cuda"):
    """``(fns, info)``: the three measurements' guard-on and guard-off callables for one
    configuration, and the checks made before timing (``info["checks_ok"]``: the guard fires on no
    row, and the norms and ``g`` are bitwise equal with the guard on and off)."""
    import torch

    from ...numerics.formulas import scale_constants
    from ...ops.guard import CANCELLATION_REL, guard_constants
    from ...ops.kernels.norm_tail import norm_tail
    from ...ops.norm import default_eps, factored_row_norm
    from ...ops.weight_norm import cached_base_row_norm_sq, magnitude_scale_and_flag

    W, A, B, s, m = _inputs(d_out, d_in, r, ab_dtype, device)
    base_sq = cached_base_row_norm_sq(W)
    s32, two_s, s_sq = scale_constants(s)
    U = W.float() @ A.float().T  # the tail's inputs (their values matter only for the checks)
    G = A.float() @ A.float().T
    C = guard_constants(two_s, s_sq, W, r)
    eps = default_eps(m.dtype)
    fns = {
        "tail": {"on": lambda: norm_tail(U, B, G, base_sq, two_s, s_sq, m=m, eps=eps, guard=C,
                                         rel_max=CANCELLATION_REL, recompute=(W, A, s32)),
                 "off": lambda: norm_tail(U, B, G, base_sq, two_s, s_sq, m=m, eps=eps)},
        # the same kernel with the guard but without the recompute branch: what the branch itself costs
        "tail_guard_only": {"on": lambda: norm_tail(U, B, G, base_sq, two_s, s_sq, m=m, eps=eps, guard=C,
                                                    rel_max=CANCELLATION_REL),
                            "off": lambda: norm_tail(U, B, G, base_sq, two_s, s_sq, m=m, eps=eps)},
        "layer_g": {"on": lambda: magnitude_scale_and_flag(W, A, B, s, m, on_cancellation="recompute"),
                    "off": lambda: magnitude_scale_and_flag(W, A, B, s, m, on_cancellation="off")},
        "public": {"on": lambda: factored_row_norm(W, A, B, s, base_sq=base_sq, on_cancellation="recompute"),
                   "off": lambda: factored_row_norm(W, A, B, s, base_sq=base_sq, on_cancellation="off")},
    }
    t_on, t_off = fns["tail"]["on"](), fns["tail"]["off"]()
    fired = int((t_on.rel > CANCELLATION_REL).sum())
    g_on, bad_on = fns["layer_g"]["on"]()
    g_off, _ = fns["layer_g"]["off"]()
    ok = (fired == 0 and int(bad_on.max()) == 0 and torch.equal(t_on.wnorm, t_off.wnorm)
          and torch.equal(g_on, g_off) and torch.equal(fns["public"]["on"](), fns["public"]["off"]()))
    ref = torch.linalg.vector_norm(W.double() + s * (B.double() @ A.double()), dim=1)
    rel_err = float(((fns["public"]["on"]().double() - ref).abs() / ref).max())
    info = dict(d_out=d_out, d_in=d_in, rank=r, w_dtype="bfloat16", ab_dtype=ab_dtype, update_ratio=UPDATE_RATIO,
                rows_fired=fired, checks_ok=bool(ok), rel_bound_max=float(t_on.rel.max()), rel_err_fp64=rel_err)
    return fns, info


def run(out: Path, *, smoke: bool = False, git_sha: str | None = None) -> Path:
    import pandas as pd
    import torch

    from ...repro.provenance import device_info, versions
    from ..bench import time_ms
    from ...repro.recording import require_cuda

    require_cuda("guard-cost", torch.cuda.is_available())
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for d_out, d_in, r, ab in (SMOKE if smoke else FULL):
        fns, common = prepare(d_out, d_in, r, ab)
        if not common["checks_ok"]:  # never time a configuration whose check failed
            rows.append({**common, "measure": "check", "variant": "failed", "round": -1})
            print(f"{d_out}x{d_in} r={r} {ab}: CHECK FAILED ({common})", flush=True)
            continue
        mine = []
        for rnd in range(1 if smoke else ROUNDS):
            for measure, pair in fns.items():
                times = {}
                for variant in (("off", "on") if rnd % 2 == 0 else ("on", "off")):  # alternate the order
                    t = time_ms(pair[variant], warmup=10 if smoke else 25, rep=30 if smoke else 100)
                    times[variant] = t.ms
                    mine.append({**common, "measure": measure, "variant": variant, "round": rnd, **t.as_dict()})
                mine.append({**common, "measure": measure, "variant": "ratio_on_over_off", "round": rnd,
                             "ms": times["on"] / times["off"]})
        rows += mine
        med = summary(pd.DataFrame(mine))
        print(f"{d_out}x{d_in} r={r} A/B {ab}: guard on/off median ratio " +
              ", ".join(f"{a.measure} {a.on_over_off:.4f}" for a in med.itertuples()), flush=True)
        del fns
        torch.cuda.empty_cache()
    pd.DataFrame(rows).to_csv(GUARD_COST.path(folder=out), index=False, lineterminator="\n")
    meta = {"device": device_info(), "versions": versions(), "git_sha": git_sha, "smoke": smoke,
            "rounds": 1 if smoke else ROUNDS, "argv": sys.argv}
    (out / MACHINE_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return GUARD_COST.path(folder=out)


def summary(df):
    """Median over rounds of the on/off time ratio per configuration and measurement."""
    r = df[df["variant"] == "ratio_on_over_off"]
    keys = ["d_out", "d_in", "rank", "ab_dtype", "measure"]
    return r.groupby(keys)["ms"].median().rename("on_over_off").reset_index()


def ingest(src: Path, dest: Path | None = None, *, git_sha: str | None = None) -> Path:
    """Record a ``--out`` folder as ``data/gpu/guard_cost.csv`` with provenance (the GPU's device
    description from its ``device.json``)."""
    import pandas as pd

    from ...repro.provenance import save_dataframe

    meta = json.loads((src / MACHINE_FILE).read_text())
    df = pd.read_csv(GUARD_COST.path(folder=src))
    dest = dest or GUARD_COST.dest()
    return save_dataframe(df, GUARD_COST.path(folder=dest), device=meta["device"],
                          producer=GUARD_COST.producer,
                          params={"smoke": meta.get("smoke"), "rounds": meta.get("rounds"),
                                  "update_ratio": UPDATE_RATIO},
                          extra={"measured_at_git_sha": git_sha or meta.get("git_sha"),
                                 "versions_gpu": meta.get("versions"), "argv_gpu": meta.get("argv")})


def build_parser(prog: str = "dora-num record guard-cost", name: str = "guard-cost"):
    return recorder_parser(prog, __doc__, smoke="small shapes, one round (seconds)",
                           out=f"output folder ({GUARD_COST.filename()}, {MACHINE_FILE})")


def ingest_args(a) -> list[Path]:
    import pandas as pd

    p = ingest(a.ingest, a.out, git_sha=a.git_sha)
    print(summary(pd.read_csv(p)).to_string(index=False))
    return [p]


def record(a) -> int:
    print(run(a.out, smoke=a.smoke, git_sha=a.git_sha))
    return 0
