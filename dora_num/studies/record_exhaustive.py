"""``dora-num record exhaustive --out DIR [--smoke] [--only SECTION ...] [--budget-s S]``: the
exhaustive GPU runs of notebooks 01-03, one process (``python -m dora_num.studies.record_exhaustive``
delegates here).

Sections (``--only``), in this order, each writing under DIR:

- ``census``: the fp32 sqrt census over all 2^32 patterns for torch CUDA, ``tl.sqrt``,
  ``tl.sqrt_rn`` and inline PTX ``sqrt.rn.f32`` (:mod:`dora_num.studies.fma.census_kernels`):
  ``sqrt_census_gpu_counts.csv``, ``sqrt_census_gpu_chunks.csv``, ``sqrt_census_gpu_timing.csv``.
- ``accumulation``: the tensor-core accumulation probe of ``torch.mm(..., out_dtype=float32)``
  (:mod:`dora_num.studies.bounds.accumulation`): ``accumulation_probe.json.gz``,
  ``accumulation_findings.json``.
- ``compose``: every exhaustive 16-bit compose configuration
  (:mod:`dora_num.studies.bounds.exhaustive`): ``compose_exhaustive.csv`` (rewritten after each
  launch, so a stopped run keeps what it has) and ``compose_exhaustive_bitwise.csv`` (the kernel's
  computed variants, exact result, bounds, ulp bounds and ``kappa_c`` against eager torch on CUDA
  and the package's numpy functions: every mismatch count must be 0).

``device.json`` (:func:`dora_num.repro.recording.describe_machine`) records the GPU, versions,
git sha, the sections' wall times, how many compose launches ran of how many planned, and
whether the compose section stopped at ``--budget-s``.  ``--smoke`` runs every kernel path
(inline PTX included) on slices, in well under a minute.  ``--ingest DIR`` copies a full run into
``data/gpu/exhaustive/`` through :func:`dora_num.repro.recording.ingest` (the measuring
machine's description from ``device.json``; a ``--smoke`` run is refused).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..repro import recording as recorded

SECTIONS = ("census", "accumulation", "compose")
INGEST_DIR = ("gpu", "exhaustive")
PRODUCER = "dora-num record exhaustive"


def _log(msg: str) -> None:
    print(f"[exhaustive-gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(out: Path, *, sections=SECTIONS, smoke: bool = False, budget_s: float = 480.0,
        git_sha: str | None = None) -> dict:
    """Run ``sections`` into ``out``; returns the ``device.json`` description."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("dora-num record exhaustive needs a CUDA GPU (this machine has none)")
    import triton

    out = Path(out)
    torch.backends.cuda.matmul.allow_tf32 = False
    desc = recorded.describe_machine(git_sha, triton_runtime=triton.__version__, smoke=smoke, sections=list(sections),
                                     budget_s=budget_s, wall_s={})
    t_all = time.time()
    recorded.write_machine(out, desc)
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
                from .bounds.exhaustive import configurations, run_gpu as comp_run

                left = budget_s - (time.time() - t_all)
                df = comp_run(out, smoke=smoke, budget_s=max(left, 30.0), log=_log)
                desc["compose_launches"] = len(df) // 4
                desc["compose_planned"] = None if smoke else len(configurations())
                desc["compose_stopped_early"] = (not smoke) and desc["compose_launches"] < len(configurations())
        except Exception:  # noqa: BLE001 - one GPU call: record the failure, run the other sections
            import traceback

            traceback.print_exc()
            desc.setdefault("failed_sections", []).append(name)
        desc["wall_s"][name] = round(time.time() - t0, 1)
        _log(f"{name}: {desc['wall_s'][name]} s")
        recorded.write_machine(out, desc)
    desc["wall_s"]["total"] = round(time.time() - t_all, 1)
    recorded.write_machine(out, desc)
    return desc


def ingest(src: Path, dest: Path | None = None, *, git_sha: str | None = None) -> list[Path]:
    """Copy a run folder (all its files, ``device.json`` included) into ``data/gpu/exhaustive/``
    with provenance (:func:`dora_num.repro.recording.ingest_folder`); a ``--smoke`` run is refused."""
    from ..repro.paths import data_dir

    desc = recorded.read_machine(src)
    if desc.get("smoke"):
        raise ValueError(f"{src} holds a --smoke run; ingest a full run")
    keys = ("sections", "smoke", "budget_s", "wall_s", "failed_sections", "compose_launches", "compose_planned",
            "compose_stopped_early")
    return recorded.ingest_folder(src, Path(dest) if dest is not None else data_dir(*INGEST_DIR), producer=PRODUCER,
                                  git_sha=git_sha, params={k: desc.get(k) for k in keys})


def build_parser(prog: str = PRODUCER, name: str = "exhaustive") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output folder of the run (with --ingest: the data folder, "
                                             "default data/gpu/exhaustive)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    ap.add_argument("--smoke", action="store_true", help="slices of every kernel path (< 1 min)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the compose section stops cleanly once the run has taken this long (default 480)")
    ap.add_argument("--git-sha", help="git sha of the code (the GPU copy of the tree has no .git)")
    ap.add_argument("--ingest", type=Path, metavar="RUN_DIR",
                    help="instead of measuring: copy RUN_DIR into data/gpu/exhaustive/ (or --out) with provenance")
    return ap


def record(args) -> int:
    if args.ingest:
        for p in ingest(args.ingest, args.out, git_sha=args.git_sha):
            print(p)
        return 0
    if not args.out:
        print(f"{PRODUCER}: --out DIR is required", file=sys.stderr)
        return 2
    sha = recorded.measured_git_sha(args.git_sha)
    desc = run(args.out, sections=tuple(args.only or SECTIONS), smoke=args.smoke, budget_s=args.budget_s, git_sha=sha)
    return 1 if desc.get("failed_sections") else 0


def main(argv: list[str] | None = None) -> int:
    from .cli import run as run_recorder

    return run_recorder("exhaustive", argv)


if __name__ == "__main__":
    sys.exit(main())
