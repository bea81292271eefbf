"""``python -m dora_num.studies.exhaustive_gpu --out DIR [--smoke]``: the exhaustive GPU runs, one process.

Sections (``--only``), in this order, each writing under DIR:

- ``census``: the fp32 sqrt census over all 2^32 patterns for torch CUDA, ``tl.sqrt``,
  ``tl.sqrt_rn`` and inline PTX ``sqrt.rn.f32`` (:mod:`dora_num.studies.fma.census_kernels`):
  ``sqrt_census_gpu_counts.csv``, ``sqrt_census_gpu_chunks.csv``, ``sqrt_census_gpu_timing.csv``.
- ``accumulation``: the tensor-core accumulation probe of ``torch.mm(..., out_dtype=float32)``
  (:mod:`dora_num.studies.bounds.accumulation`): ``accumulation_probe.json``,
  ``accumulation_findings.json``.
- ``compose``: every exhaustive 16-bit compose configuration
  (:mod:`dora_num.studies.bounds.exhaustive`): ``compose_exhaustive.csv`` (rewritten after each
  launch, so a stopped run keeps what it has) and ``compose_exhaustive_bitwise.csv`` (the kernel's
  four computed variants and exact result against eager torch on CUDA and ``compose_exact``).

``device.json`` records the GPU, versions, git sha, the sections' wall times and whether the
compose section stopped at ``--budget-s``.  ``--smoke`` runs every kernel path (inline PTX
included) on slices, in well under a minute.  ``--ingest DIR`` copies a run into
``data/gpu/exhaustive/`` with provenance sidecars (device description from ``device.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SECTIONS = ("census", "accumulation", "compose")


def _log(msg: str) -> None:
    print(f"[exhaustive-gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(out: Path, *, sections=SECTIONS, smoke: bool = False, budget_s: float = 480.0,
        git_sha: str | None = None) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("exhaustive_gpu needs a CUDA GPU (this machine has none)")
    from .suite import device_description

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    desc = {**device_description(git_sha), "smoke": smoke, "sections": list(sections), "wall_s": {}}
    t_all = time.time()

    def save():
        (out / "device.json").write_text(json.dumps(desc, indent=2, default=str) + "\n")

    save()
    for name in sections:
        t0 = time.time()
        try:
            if name == "census":
                from .fma.census_kernels import gpu_census

                counts, per, timing = gpu_census(smoke=smoke, log=_log)
                counts.to_csv(out / "sqrt_census_gpu_counts.csv", index=False, lineterminator="\n")
                per.to_csv(out / "sqrt_census_gpu_chunks.csv", index=False, lineterminator="\n")
                timing.to_csv(out / "sqrt_census_gpu_timing.csv", index=False, lineterminator="\n")
            elif name == "accumulation":
                from .bounds.accumulation import run_gpu as acc_run

                acc_run(out, smoke=smoke, log=_log)
            elif name == "compose":
                from .bounds.exhaustive import run_gpu as comp_run

                left = budget_s - (time.time() - t_all)
                df = comp_run(out, smoke=smoke, budget_s=max(left, 30.0), log=_log)
                desc["compose_launches"] = len(df) // 4
        except Exception:  # noqa: BLE001 - one GPU call: record the failure, run the other sections
            import traceback

            traceback.print_exc()
            desc.setdefault("failed_sections", []).append(name)
        desc["wall_s"][name] = round(time.time() - t0, 1)
        _log(f"{name}: {desc['wall_s'][name]} s")
        save()
    desc["wall_s"]["total"] = round(time.time() - t_all, 1)
    save()
    return desc


INGEST_DIR = ("gpu", "exhaustive")


def ingest(src: Path, dest: Path | None = None) -> list[Path]:
    """Copy a run folder into ``data/gpu/exhaustive/`` through the provenance helper."""
    from ..repro.paths import data_dir
    from ..repro.provenance import write_artifact

    src = Path(src)
    desc = json.loads((src / "device.json").read_text())
    if desc.get("smoke"):
        raise ValueError(f"{src} holds a --smoke run; ingest a full run")
    dest = Path(dest) if dest is not None else data_dir(*INGEST_DIR)
    written = []
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        written.append(write_artifact(
            dest / f.name, f.read_bytes(), device=desc["device"], producer="dora_num.studies.exhaustive_gpu",
            params={"sections": desc.get("sections"), "smoke": desc.get("smoke"), "wall_s": desc.get("wall_s"),
                    "failed_sections": desc.get("failed_sections")},
            extra={"gpu_git_sha": desc.get("git_sha"), "gpu_versions": desc.get("versions")}))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dora_num.studies.exhaustive_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output folder of the run (or, with --ingest, the data folder)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    ap.add_argument("--smoke", action="store_true", help="slices of every kernel path (< 1 min)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the compose section stops cleanly once the run has taken this long (default 480)")
    ap.add_argument("--git-sha", help="git sha of the code (when the GPU copy has no .git)")
    ap.add_argument("--ingest", metavar="RUN_DIR", help="copy RUN_DIR into data/gpu/exhaustive/ with provenance")
    args = ap.parse_args(argv)
    if args.ingest:
        for p in ingest(Path(args.ingest), Path(args.out) if args.out else None):
            print(p)
        return 0
    if not args.out:
        ap.error("--out DIR is required")
    sha = args.git_sha or os.environ.get("DORA_NUM_GIT_SHA")
    if sha is None:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = None
    desc = run(Path(args.out), sections=tuple(args.only or SECTIONS), smoke=args.smoke, budget_s=args.budget_s,
               git_sha=sha)
    return 1 if desc.get("failed_sections") else 0


if __name__ == "__main__":
    sys.exit(main())
