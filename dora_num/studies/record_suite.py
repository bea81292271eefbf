"""``dora-num record suite --out DIR`` (alias ``dora-num gpu-suite``): every GPU
measurement of notebooks 02 and 05, in one process.

Each section lives beside its question and writes one tidy CSV under DIR;
``device.json`` holds the device, versions, git sha and the copy bandwidth every
percentage is taken against (:func:`dora_num.repro.recording.describe_machine`).

=========  ====================================  ==========================================
section    module                                file
=========  ====================================  ==========================================
``copy``   :func:`dora_num.studies.bench.copy_bandwidth`   ``device.json`` (always measured)
``fma``    :mod:`dora_num.studies.fma.record_fma`            ``fma_sqrt.csv``, ``fma_sqrt_sample.npz``
``tiles``  :mod:`dora_num.studies.speed.record_compose`      ``tile_sweep.csv`` (full mode only)
``norm``   :mod:`dora_num.studies.speed.record_norm`         ``norm_bench.csv``
``layer``  :mod:`dora_num.studies.speed.record_layer`        ``layer_bench.csv``, ``layer_profile.txt``
``compose`` :mod:`dora_num.studies.speed.record_compose`     ``compose_bench.csv``
``model``  :mod:`dora_num.studies.speed.record_model`        ``model_bench.csv``, ``model_agreement.csv``,
                                                            ``model_probe.csv``, ``model_predictions.csv``
=========  ====================================  ==========================================

``dora-num record suite --ingest DIR`` copies a suite folder into ``data/gpu/``
(:func:`ingest`).  Each section is also a recorder of its own name
(``dora-num record fma --out DIR`` = ``dora-num record suite --only fma --out DIR``).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

from ..ops.config import get_config
from ..repro.paths import data_dir
from ..repro import recording as recorded
from . import inputs
from .bench import copy_bandwidth, log, write_csv
from .fma.record_fma import bench_fma
from .speed.record_compose import DEFAULT_DOUT, DEFAULT_TOKENS, bench_compose, tile_sweep
from .speed.record_layer import LAYER_SHAPES, bench_layers
from .speed.record_norm import NORM_SHAPES, bench_norms

SECTIONS = ("fma", "tiles", "compose", "norm", "layer", "model")
SEED = inputs.SUITE_SEED


def device_description(git_sha: str | None) -> dict:
    return recorded.describe_machine(git_sha, triton_runtime=triton.__version__,
                                     dg_final_in_kernel=get_config().dg_stage2_in_kernel)


def run_suite(out: Path, *, sections: tuple[str, ...], smoke: bool = False, git_sha: str | None = None) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu-suite needs a CUDA GPU (this machine has none)")
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    desc = device_description(git_sha)
    copy = copy_bandwidth(256 * 2**20 if smoke else 2 * 2**30)
    desc["copy"] = copy
    desc["smoke"] = smoke
    desc["sections"] = list(sections)
    copy_gbps = copy["gbps"]
    log(f"copy bandwidth {copy_gbps:.0f} GB/s")
    recorded.write_machine(out, desc)

    def section(name, fn):
        if name not in sections:
            return
        try:
            fn()
        except Exception:  # noqa: BLE001 - one GPU run: record the failure, go on with the rest
            traceback.print_exc()
            desc.setdefault("failed_sections", []).append(name)

    section("fma", lambda: write_csv(bench_fma(out, n=1 << (16 if smoke else 22), sample=1 << (12 if smoke else 18)),
                                     out / "fma_sqrt.csv"))
    if not smoke:
        section("tiles", lambda: write_csv(tile_sweep(copy_gbps), out / "tile_sweep.csv"))
    section("norm", lambda: write_csv(bench_norms(((1024, 1024, 64),) if smoke else NORM_SHAPES,
                                                  (torch.bfloat16, torch.float32)), out / "norm_bench.csv"))
    section("layer", lambda: write_csv(bench_layers(((1024, 1024, 64, 512),) if smoke else LAYER_SHAPES,
                                                    profile_to=out / "layer_profile.txt"),
                                       out / "layer_bench.csv"))

    def compose_section():
        ck = out / "compose_bench.csv"
        if smoke:
            bench_compose((512,), (512, 4096), (torch.bfloat16,), copy_gbps, checkpoint=ck)
            return
        bench_compose(DEFAULT_TOKENS, DEFAULT_DOUT, (torch.bfloat16, torch.float16, torch.float32), copy_gbps,
                      None, checkpoint=ck)

    section("compose", compose_section)

    def model_section():  # a Llama-architecture decoder at 8B layer shapes vs PEFT
        from .speed.record_model import run as run_model  # transformers and peft: imported when it runs

        desc["model"] = run_model(out, smoke=smoke, copy_gbps=copy_gbps)

    section("model", model_section)
    desc["wall_s"] = time.time() - t0
    recorded.write_machine(out, desc)
    log(f"done in {desc['wall_s']:.0f} s")


def ingest(src: Path, dest: Path | None = None, only: tuple[str, ...] | None = None,
           git_sha: str | None = None) -> list[Path]:
    """Copy a suite folder's files (``device.json`` included) into ``data/gpu/`` with
    provenance; the device description and git sha come from the suite's ``device.json``
    (the GPU run), not from this machine."""
    desc = recorded.read_machine(src)
    return recorded.ingest_folder(src, Path(dest) if dest is not None else data_dir("gpu"),
                                  producer="dora-num record suite", names=only, git_sha=git_sha,
                                  params={"sections": desc.get("sections"), "smoke": desc.get("smoke")}, seed=SEED,
                                  extra={"copy_gbps": desc.get("copy", {}).get("gbps")})


# --------------------------------------------------------------------------
# Command line: dora-num record suite|fma|tiles|compose|norm|layer, dora-num gpu-suite
# --------------------------------------------------------------------------

def build_parser(prog: str, name: str = "suite") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output folder for the raw CSV/JSON/NPZ files (with --ingest: the data folder, "
                                 "default data/gpu)")
    if name == "suite":
        p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.set_defaults(sections=SECTIONS if name == "suite" else (name,))
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a quick check of the suite itself)")
    p.add_argument("--git-sha", help="git sha of the code (when the GPU copy has no .git)")
    p.add_argument("--ingest", metavar="SUITE_DIR",
                   help="instead of measuring: copy SUITE_DIR into data/gpu/ (or --out) with provenance")
    return p


def record(args) -> int:
    if args.ingest:
        only = None
        if tuple(args.sections) == ("model",):  # a model-only run: its files, not the suite's device.json
            from .speed.record_model import MODEL_FILES as only
        for p in ingest(Path(args.ingest), Path(args.out) if args.out else None, only=only, git_sha=args.git_sha):
            print(p)
        return 0
    if not args.out:
        print("gpu-suite: --out DIR is required", file=sys.stderr)
        return 2
    sha = recorded.measured_git_sha(args.git_sha)
    sections = tuple(getattr(args, "only", None) or args.sections)
    run_suite(Path(args.out), sections=sections, smoke=args.smoke, git_sha=sha)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .cli import run

    return run("suite", argv)


if __name__ == "__main__":
    sys.exit(main())
