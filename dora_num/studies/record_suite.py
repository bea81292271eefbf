"""``dora-num record suite --out DIR`` (alias ``dora-num gpu-suite``): every GPU measurement of
notebooks 02 and 05, in one process; ``dora-num record SECTION`` runs one section alone.

Each section lives beside its question (``fma``: :mod:`.fma.record_fma`; ``compose``:
:mod:`.speed.record_compose`; ``tiles``: :func:`tiles_section`, the compose kernels' sweep of
:mod:`.speed.record_compose` and the norm kernels' of :mod:`.speed.record_norm`; ``norm``, ``layer``,
``model``: :mod:`.speed.record_norm`, :mod:`.speed.record_layer`, :mod:`.speed.record_model`) and
writes its data set's files under DIR (atomically); ``device.json`` holds the device, versions, git
sha, the operator configuration (``op_config``) and the copy bandwidth every percentage is taken
against.  ``--ingest DIR`` copies a suite folder into ``data/gpu/`` (a section: its own files only; a
``--repeat`` run, a second session of the timed sections, into ``data/gpu/repeat/``).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from ..repro import recording as recorded
from . import inputs
from ..repro.recording import parser as recorder_parser
from .datasets import DATASETS
from .fma.datasets import FMA
from .speed import datasets as D
from .bench import copy_bandwidth, device_name, gpu_description, log, time_ms, write_csv
from .fma.record_fma import bench_fma
from .speed.record_compose import DEFAULT_DOUT, DEFAULT_TOKENS, bench_compose, tile_sweep
from .speed.record_layer import LAYER_SHAPES, bench_layers
from .speed.record_norm import NORM_SHAPES, NORM_TILES_FULL, NORM_TILES_SMOKE, bench_norms, norm_tile_sweep

# The sections: the data sets recorded by this module, and the model level (its own recorder, run here too)
SECTION_DATA = {d.subcommand: d for d in DATASETS.values() if d.module == __name__ and d is not D.SUITE} | {
    D.MODEL.subcommand: D.MODEL}
SECTIONS = tuple(SECTION_DATA)
SEED = inputs.SUITE_SEED


def run_suite(out: Path, *, sections: tuple[str, ...], smoke: bool = False, git_sha: str | None = None,
              repeat: bool = False) -> None:
    from ..repro.recording import require_cuda

    require_cuda("suite", torch.cuda.is_available())
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    desc = gpu_description(git_sha)
    copy = copy_bandwidth(256 * 2**20 if smoke else 2 * 2**30)
    desc["copy"] = copy
    desc["smoke"] = smoke
    desc["sections"] = list(sections)
    desc["repeat"] = repeat  # a repeat session of the timed sections: ingested beside the first
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

    section(FMA.subcommand, lambda: write_csv(bench_fma(out, n=1 << (16 if smoke else 22),
                                                        sample=1 << (12 if smoke else 18)),
                                              FMA.path("variants", out)))
    section(D.TILES.subcommand, lambda: tiles_section(out, copy_gbps, smoke=smoke))
    section(D.NORM.subcommand, lambda: write_csv(bench_norms(((1024, 1024, 64),) if smoke else NORM_SHAPES,
                                                             (torch.bfloat16, torch.float32)), D.NORM.path("bench", out)))
    section(D.LAYER.subcommand, lambda: write_csv(bench_layers(((1024, 1024, 64, 512),) if smoke else LAYER_SHAPES,
                                                               profile_to=D.LAYER.path("profile", out)),
                                                  D.LAYER.path("bench", out)))

    def compose_section():
        ck = D.COMPOSE.path("bench", out)
        if smoke:
            bench_compose((512,), (512, 4096), (torch.bfloat16,), copy_gbps, checkpoint=ck)
            return
        bench_compose(DEFAULT_TOKENS, DEFAULT_DOUT, (torch.bfloat16, torch.float16, torch.float32), copy_gbps,
                      None, checkpoint=ck)

    section(D.COMPOSE.subcommand, compose_section)

    def model_section():  # a Llama-architecture decoder at 8B layer shapes vs PEFT
        from .speed.record_model import run as run_model  # transformers and peft: imported when it runs

        desc["model"] = run_model(out, smoke=smoke, copy_gbps=copy_gbps)

    section(D.MODEL.subcommand, model_section)
    desc["wall_s"] = time.time() - t0
    recorded.write_machine(out, desc)
    log(f"done in {desc['wall_s']:.0f} s")


def tiles_section(out: Path, copy_gbps: float | None, *, smoke: bool = False, device="cuda", timer=time_ms) -> Path:
    """The ``tiles`` section: the compose kernels' sweep at 8192x8192 bf16 (not with ``smoke``; against
    the suite's ``copy_gbps``) and the norm kernels' (:func:`~.speed.record_norm.norm_tile_sweep`, at
    the operator's shapes, or tiny ones with ``smoke``, on ``device``, timed by ``timer``), one table
    whose rows name their kernel, tiles and device, written atomically into ``out``."""
    rows = [] if smoke else [{**r, "gpu": device_name(device)} for r in tile_sweep(copy_gbps)]
    rows += norm_tile_sweep(**(NORM_TILES_SMOKE if smoke else NORM_TILES_FULL), device=device, timer=timer)
    path = D.TILES.path("sweep", out)
    write_csv(rows, path)
    return path


def ingest(src: Path, dest: Path | None = None, only: tuple[str, ...] | None = None,
           git_sha: str | None = None, name: str = "suite") -> list[Path]:
    """Copy a suite folder's files (``device.json`` included; ``only``: those files) into ``data/gpu/``
    with provenance; the device description and git sha come from the folder's ``device.json``."""
    desc = recorded.read_machine(src)
    ds = SECTION_DATA.get(name, D.SUITE)
    if desc.get("repeat"):  # another session: the data set whose folder is dest (SPEED_REPEAT by default), its files only
        tail = Path(dest).resolve().parts if dest is not None else ()
        ds = next((s for s in D.SESSIONS if tail[-len(Path(s.folder).parts):] == Path(s.folder).parts), D.SPEED_REPEAT)
        only = only or tuple(n for n in map(ds.filename, ds.roles) if (Path(src) / n).is_file())
    return recorded.ingest_folder(src, Path(dest) if dest is not None else ds.dest(), producer=ds.producer,
                                  names=only, git_sha=git_sha,
                                  params={"sections": desc.get("sections"), "smoke": desc.get("smoke")}, seed=SEED,
                                  extra={"copy_gbps": desc.get("copy", {}).get("gbps")})


def build_parser(prog: str, name: str = "suite"):
    p = recorder_parser(prog, __doc__, smoke="tiny sizes (a quick check of the suite itself)",
                        out="output folder for the raw CSV/JSON/NPZ files")
    if name == "suite":
        p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
        p.add_argument("--repeat", action="store_true",
                       help="a repeat session of the timed sections: --ingest puts it beside the first "
                            f"(data/{D.SPEED_REPEAT.folder}), which it never replaces")
    p.set_defaults(sections=SECTIONS if name == "suite" else (name,), name=name)
    return p


def ingest_args(a) -> list[Path]:
    only = None if a.name == D.SUITE.subcommand else tuple(p.name for p in SECTION_DATA[a.name].paths(a.ingest))
    return ingest(a.ingest, a.out, only=only, git_sha=a.git_sha, name=a.name)


def record(args) -> int:
    sha = recorded.measured_git_sha(args.git_sha)
    sections = tuple(getattr(args, "only", None) or args.sections)
    run_suite(Path(args.out), sections=sections, smoke=args.smoke, git_sha=sha, repeat=getattr(args, "repeat", False))
    return 0
