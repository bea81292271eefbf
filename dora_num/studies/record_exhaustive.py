"""``dora-num record exhaustive --out DIR [--smoke] [--only SECTION ...] [--budget-s S]``: the exhaustive
GPU runs of notebooks 01-03, one process, each section writing under DIR.

- ``census``: the fp32 sqrt census over all 2^32 patterns for torch CUDA, ``tl.sqrt``, ``tl.sqrt_rn``
  and inline PTX ``sqrt.rn.f32`` (kernel: :mod:`dora_num.studies.fma.census_kernels`).
- ``accumulation``: the tensor-core accumulation probe of ``torch.mm(..., out_dtype=float32)``
  (:mod:`dora_num.studies.bounds.accumulation`).
- ``compose``: every exhaustive 16-bit compose configuration (:mod:`dora_num.studies.bounds.exhaustive`),
  after a bit-for-bit check of the kernel against the package; every mismatch count must be 0.

``device.json`` records the GPU, versions, git sha, each section's wall time and whether the compose
section stopped at ``--budget-s``; ``--ingest DIR`` copies a full run into ``data/gpu/exhaustive/``
(a ``--smoke`` run is refused).
"""

from __future__ import annotations

import lzma
import json
import math
import time
import traceback
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..repro import recording
from .bounds import accumulation as ACC
from .bounds import exhaustive as X
from .bounds.datasets import ACCUMULATION, COMPOSE_GPU
from ..repro.recording import parser as recorder_parser
from .fma import census as C
from .fma import census_kernels as CK
from .fma.datasets import SQRT_CENSUS_GPU
from ..numerics.formulas import scale_constants

SECTIONS = ("census", "accumulation", "compose")
DATASETS = (SQRT_CENSUS_GPU, ACCUMULATION, COMPOSE_GPU)


def _log(msg: str) -> None:
    print(f"[exhaustive-gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(out: Path, *, sections=SECTIONS, smoke: bool = False, budget_s: float = 480.0,
        git_sha: str | None = None) -> dict:
    """Run ``sections`` into ``out``; returns the ``device.json`` description."""
    from ..repro.recording import require_cuda

    require_cuda("exhaustive", torch.cuda.is_available())
    import triton

    out = Path(out)
    torch.backends.cuda.matmul.allow_tf32 = False
    desc = recording.describe_machine(git_sha, triton_runtime=triton.__version__, smoke=smoke,
                                      sections=list(sections), budget_s=budget_s, wall_s={})
    t_all = time.time()
    recording.write_machine(out, desc)
    for name in sections:
        t0 = time.time()
        try:
            if name == "census":
                for table, p in zip(census_gpu(smoke=smoke, log=_log), SQRT_CENSUS_GPU.paths(out)):
                    table.to_csv(p, index=False, lineterminator="\n")
            elif name == "accumulation":
                accumulation_gpu(out, smoke=smoke, log=_log)
            elif name == "compose":
                left = budget_s - (time.time() - t_all)
                df = compose_gpu(out, smoke=smoke, budget_s=max(left, 30.0), log=_log)
                planned = len(X.configurations())
                desc["compose_launches"] = len(df) // 4
                desc["compose_planned"] = None if smoke else planned
                desc["compose_stopped_early"] = (not smoke) and desc["compose_launches"] < planned
        except Exception:  # noqa: BLE001 - one GPU call: record the failure, run the other sections
            traceback.print_exc()
            desc.setdefault("failed_sections", []).append(name)
        desc["wall_s"][name] = round(time.time() - t0, 1)
        _log(f"{name}: {desc['wall_s'][name]} s")
        recording.write_machine(out, desc)
    desc["wall_s"]["total"] = round(time.time() - t_all, 1)
    recording.write_machine(out, desc)
    return desc


def ingest(src: Path, dest: Path | None = None, *, git_sha: str | None = None) -> list[Path]:
    """Copy a run folder (all its files, ``device.json`` included) into ``data/gpu/exhaustive/``
    with provenance (:func:`dora_num.repro.recording.ingest_folder`); a ``--smoke`` run is refused."""
    desc = recording.read_machine(src)
    if desc.get("smoke"):
        raise ValueError(f"{src} holds a --smoke run; ingest a full run")
    keys = ("sections", "smoke", "budget_s", "wall_s", "failed_sections", "compose_launches", "compose_planned",
            "compose_stopped_early")
    return recording.ingest_folder(src, Path(dest) if dest is not None else COMPOSE_GPU.dest(),
                                   producer=COMPOSE_GPU.producer, git_sha=git_sha,
                                   params={k: desc.get(k) for k in keys})


def build_parser(prog: str = "dora-num record exhaustive", name: str = "exhaustive"):
    p = recorder_parser(prog, __doc__, smoke="slices of every kernel path (< 1 min)",
                        out="output folder of the run")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="the compose section stops cleanly once the run has taken this long (default 480)")
    return p


def ingest_args(a) -> list[Path]:
    return ingest(a.ingest, a.out, git_sha=a.git_sha)


def record(a) -> int:
    sha = recording.measured_git_sha(a.git_sha)
    desc = run(a.out, sections=tuple(a.only or SECTIONS), smoke=a.smoke, budget_s=a.budget_s, git_sha=sha)
    return 1 if desc.get("failed_sections") else 0


# --------------------------------------------------------------------------
# The sections
# --------------------------------------------------------------------------

GPU_IMPLS = ("torch.sqrt (CUDA)", "tl.sqrt", "tl.sqrt_rn", "ptx sqrt.rn.f32")


def census_gpu(*, smoke: bool = False, chunk: int = 1 << 28, log=print):
    """The GPU census: ``(counts, per_chunk, timing)``.  ``smoke``: 2^24 inputs around 1.0 and
    the same count from the top (negative NaNs), every implementation and code path."""
    dev = "cuda"
    ranges = [(0x3F000000, 1 << 23), (0xFF800000, 1 << 23)] if smoke else \
        [(s, chunk) for s in range(0, 1 << 32, chunk)]
    counts, per, timing = [], [], []
    for impl in GPU_IMPLS:
        if impl != "torch.sqrt (CUDA)":  # compile outside the timed part
            CK.census_values(0, 1 << 16, impl, device=dev)
        else:
            CK.census_values(0, 1 << 16, "external", torch.sqrt(CK.input_patterns(0, 1 << 16, dev)), device=dev)
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ms, kern, t0 = 0.0, None, time.time()
        for ci, (s0, n) in enumerate(ranges):
            ev[0].record()
            if impl == "torch.sqrt (CUDA)":
                r = torch.sqrt(CK.input_patterns(s0, n, dev))
                v = CK.census_values(s0, n, "external", r, device=dev)
                del r
            else:
                v, kern = CK.census_values(s0, n, impl, device=dev, return_kernel=True)
            ev[1].record()
            torch.cuda.synchronize()
            ms += ev[0].elapsed_time(ev[1])
            c, p = CK.tables(v, ci, impl)
            counts.append(c)
            per.append(p)
            del v
        timing.append({"implementation": impl, "inputs": sum(n for _, n in ranges), "device_ms": ms,
                       "wall_s": time.time() - t0, **(CK.ptx_sqrt_counts(kern) if kern is not None else {})})
        log(f"[census] {impl}: {ms:.0f} ms on the device for {timing[-1]['inputs']:,} inputs")
    cnt = pd.concat(counts).groupby(["implementation", "code"], as_index=False)["count"].sum()
    return C.decode_codes(cnt), pd.concat(per, ignore_index=True), pd.DataFrame(timing)


def compose_gpu(out_dir, *, smoke: bool = False, budget_s: float = 540.0, log=print, device="cuda",
            pairs: int | None = None, check_pairs: int = 1 << 20) -> pd.DataFrame:
    """First the kernel against the package on the device (:func:`bitwise_check` on ``check_pairs``
    pairs around ``base ~ 1`` at two (g, s) per format: computed variants, exact result, bounds,
    ulp bounds, ``kappa_c``; every count must be 0) into ``out_dir/compose_exhaustive_bitwise.csv``;
    then every configuration (``smoke``: two formats x 2 g x 2 s on a 2^24-pair slice around
    ``base ~ 1``), written to ``out_dir/compose_exhaustive.csv.xz`` after each launch.  Stops cleanly,
    with what it has, once ``budget_s`` has passed (``stopped_early`` in the log).  ``device`` and
    ``pairs`` (the slice of the smoke launches) let the tests run the driver under the interpreter."""
    cuda = str(device).startswith("cuda")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfgs = X.configurations()
    start, n = 0, 1 << 32
    if smoke:
        keep_g = {"exactly_1", "bf16_edge_above_outside"}
        cfgs = [c for c in cfgs if c["g_label"] in keep_g and c["s_label"] != "0.5"]
        start, n = 0x3F80 << 16, pairs or 1 << 24
    rows, t0 = [], time.time()
    if cuda:
        for f in ("bf16", "fp16"):  # compile outside the timed launches (the events would include the compile)
            X.launch(f, 1.0, 1.0, start=0, n=256 * 256, device=device)
        torch.cuda.synchronize()
    log(f"[exhaustive] compiled in {time.time() - t0:.0f} s")
    checks = [{"format": f, "g": g, "s": s_, **X.bitwise_check(f, g, s_, 0x3F80 << 16, check_pairs, device=device)}
              for f in ("bf16", "fp16") for g, s_ in ((1.0, 1.0), (float(np.float32(1 + 1e-3)), scale_constants(2 / math.sqrt(7))[0]))]
    chk = pd.DataFrame(checks)
    chk.to_csv(out_dir / X.BITWISE_FILE, index=False, lineterminator="\n")
    bad = int(chk.drop(columns=["format", "g", "s", "n_finite"]).to_numpy().sum())
    log(f"[exhaustive] kernel vs the package on {device} ({len(checks)} x {check_pairs:,} pairs): "
        + ("every output bit for bit" if bad == 0 else f"{bad} MISMATCHES (see {X.BITWISE_FILE})")
        + f"; {time.time() - t0:.0f} s; now {len(cfgs)} launches of {n:,} pairs each")
    for i, cfg in enumerate(cfgs):
        if time.time() - t0 > budget_s:
            log(f"[exhaustive] stopped_early after {i} of {len(cfgs)} launches ({time.time() - t0:.0f} s)")
            break
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        else:
            tc = time.perf_counter()
        stats, _ = X.launch(cfg["format"], cfg["g"], cfg["s"], start=start, n=n, device=device)
        if cuda:
            ev1.record()
            torch.cuda.synchronize()
            ms = ev0.elapsed_time(ev1)
        else:
            ms = (time.perf_counter() - tc) * 1e3
        rows += X.stats_rows(cfg, stats, n, start=start, kernel_ms=ms)
        pd.DataFrame(rows).to_csv(out_dir / X.RESULT_FILE, index=False, lineterminator="\n")
        log(f"[exhaustive] {i + 1}/{len(cfgs)} {cfg['format']} g={cfg['g_label']} s={cfg['s_label']}: {ms:.0f} ms; "
            f"elapsed {time.time() - t0:.0f} s")
    return pd.DataFrame(rows)


def accumulation_gpu(out_dir, *, smoke: bool = False, log=print) -> list[dict]:
    """Probe ``torch.mm(a, b, out_dtype=torch.float32)`` on CUDA for every format x shape x K
    and write the raw outputs (``ACC.PROBE_FILE``, xz) and ``accumulation_findings.json``."""
    def mm(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = []
    for fmt in ACC.FORMATS:
        for shape in (ACC.SHAPES[:1] if smoke else ACC.SHAPES):
            for K in ((384,) if smoke else ACC.K_VALUES):
                rec = ACC.run_probes(mm, fmt, K, shape=shape, device="cuda", positions=(0, K - 1) if smoke else None)
                recs.append(rec)
                f = ACC.analyze(rec)
                log(f"[accumulation] {fmt} {shape[0]} K={K}: {f}")
    (out_dir / ACC.PROBE_FILE).write_bytes(lzma.compress((json.dumps(recs) + "\n").encode(), preset=9))
    findings = [{**ACC.analyze(r), "bound": ACC.bound_factor(ACC.analyze(r))} for r in recs]
    (out_dir / ACCUMULATION.filename("findings")).write_text(json.dumps(findings, indent=1, default=str) + "\n")
    return findings
